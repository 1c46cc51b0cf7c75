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
from ulysses_sp.spec import AttnSpec, Estimate, Profile

__all__ = ["UlyssesBackend", "kv_heads_sent"]


def kv_heads_sent(kv_heads: int, degree: int) -> int:
    """KV heads after the minimal replication: ``kv_heads`` if P divides it, else P."""
    return kv_heads if kv_heads % degree == 0 else degree


def _attend(q, k, v, spec: AttnSpec) -> torch.Tensor:
    """Attention over whole sequences, split at document boundaries when packed."""
    if spec.cu_seqlens is None:
        return kernels.local_attention(q, k, v, causal=spec.causal, scale=spec.softmax_scale)
    bounds = list(zip(spec.cu_seqlens[:-1], spec.cu_seqlens[1:]))
    return torch.cat(
        [kernels.local_attention(q[:, s:e], k[:, s:e], v[:, s:e], causal=spec.causal, scale=spec.softmax_scale) for s, e in bounds],
        dim=1,
    )


class UlyssesBackend:
    name = "ulysses"

    def check(self, spec: AttnSpec, topo) -> str | None:
        p = topo.sp_size
        if spec.q_heads % p:
            return f"ulysses: q heads ({spec.q_heads}) must divide by the SP degree ({p}); use ring, allgather or hybrid"
        if spec.kv_heads % p and p % spec.kv_heads:
            return (
                f"ulysses: kv heads ({spec.kv_heads}) and the SP degree ({p}) must divide one another "
                "(scatter or replicate KV heads); use ring, allgather or hybrid"
            )
        return None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        p = topo.sp_size
        hkv = kv_heads_sent(spec.kv_heads, p)
        per_head = spec.batch * spec.local_seq_len * spec.head_dim * spec.element_size
        comm_bytes = per_head * (2 * spec.q_heads + 2 * hkv) * (p - 1) // p
        # inputs + their head-sharded copies + output, per rank
        peak = per_head * (2 * spec.q_heads + 2 * spec.kv_heads) + per_head * (2 * spec.q_heads + 2 * hkv)
        flops = 4 * spec.batch * spec.seq_len**2 * spec.head_dim * spec.q_heads / p / (2 if spec.causal else 1)
        seconds = 2 * profile.collective_latency + comm_bytes / profile.all_to_all_bandwidth + flops / profile.attention_flops
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=comm_bytes)

    def forward(self, q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
        p = topo.sp_size
        if p == 1:
            return _attend(q, k, v, spec)
        if spec.kv_heads % p:
            k, v = (t.repeat_interleave(p // spec.kv_heads, dim=2) for t in (k, v))
        table = layout.chunk_table(spec.layout, p)
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], topo.sp_group, table)
        (out,) = comm.heads_to_seq([_attend(q_h, k_h, v_h, spec)], topo.sp_group, table)
        return out
