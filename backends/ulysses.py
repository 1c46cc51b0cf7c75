"""Ulysses: head-scatter all-to-all (DeepSpeed-Ulysses).

Sequence-sharded q, k, v go through one fused all-to-all to become
head-sharded full sequences in global token order; each rank runs ordinary
attention on its heads; one all-to-all brings the output back to sequence
shards. Needs the q heads to divide by P. For GQA/MQA the KV heads are
scattered when P divides them, and otherwise each KV head is replicated
P / kv_heads times (the minimum that gives every rank the one KV head its q
heads use); autograd sums the replicas' gradients.
"""

from __future__ import annotations

import torch

from ulysses_sp import comm, kernels, layout
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["UlyssesBackend"]


def _attend(q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
    """Attention over whole sequences; packed documents are the sequences of one varlen call,
    and a window is the kernel's (it is the same band in every document)."""
    varlen = None
    if spec.cu_seqlens is not None and len(spec.cu_seqlens) > 2:
        lens = [e - s for s, e in zip(spec.cu_seqlens, spec.cu_seqlens[1:])]
        key = ("ulysses-varlen", spec.cu_seqlens, spec.batch, str(q.device))
        varlen = topo.cached(key, lambda: kernels.Varlen.build(lens, lens, spec.batch, q.device))
    return kernels.attend(q, k, v, kernel=spec.kernel, causal=spec.causal, scale=spec.softmax_scale, varlen=varlen,
                          window=kernels.sliding_band(spec.window, spec.causal), softcap=spec.softcap)


class UlyssesBackend:
    name = "ulysses"

    def check(self, spec: AttnSpec, topo) -> str | None:
        problem = comm.head_scatter_problem(spec.q_heads, spec.kv_heads, topo.sp_size)
        return f"ulysses: {problem}; use ring, allgather or hybrid" if problem else None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        p = topo.sp_size
        comm_bytes = comm.head_scatter_bytes(spec, p)
        # forward and backward: two all-to-alls each, of the same volume; attention waits for them
        transfer = profile.link("all_to_all", topo.spans_nodes("sp")).seconds(2 * comm_bytes, calls=4) if p > 1 else 0.0
        hkv = comm.kv_heads_sent(spec.kv_heads, p)
        peak = spec.shard_bytes + spec.head_bytes * (2 * spec.q_heads + 2 * hkv)  # and the head-sharded copies
        peak += spec.kernel_workspace_bytes(spec.q_heads // p, spec.seq_len, spec.seq_len)
        seconds = transfer + profile.attention_fwd_bwd_seconds(spec, p)
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=comm_bytes, bwd_comm_bytes=comm_bytes)  # dout in, dq dk dv out

    def forward(self, q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
        p = topo.sp_size
        if p == 1:
            return _attend(q, k, v, spec, topo)
        k, v = comm.replicate_kv_for_scatter(k, v, p)
        table = layout.chunk_table(spec.layout, p)
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], topo.sp_group, table)
        (out,) = comm.heads_to_seq([_attend(q_h, k_h, v_h, spec, topo)], topo.sp_group, table)
        return out
