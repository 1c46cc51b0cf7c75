"""Ulysses: head-scatter all-to-all (DeepSpeed-Ulysses).

Sequence-sharded q, k, v go through one fused all-to-all to become
head-sharded full sequences in global token order; each rank runs ordinary
attention on its heads; one all-to-all brings the output back to sequence
shards. Needs the q heads to divide by P. For GQA/MQA the KV heads are
scattered when P divides them, and otherwise each KV head is replicated
P / kv_heads times (the minimum that gives every rank the one KV head its q
heads use); autograd sums the replicas' gradients. ``ulysses-g{G}`` pipelines the
all-to-alls over G head groups (:class:`_Pipelined`) so that transfers run while
attention computes; ``ulysses`` takes G from the profile (1 in the built-in ones).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ulysses_sp import comm, kernels
from ulysses_sp.profile import Profile, profile_for
from ulysses_sp.spec import AttnSpec, Estimate
from ulysses_sp.streams import CommStream

__all__ = ["UlyssesBackend", "head_groups_for"]


def _kernel_options(spec: AttnSpec, topo, device) -> dict:
    """Options of the kernel call over whole sequences: packed documents are the sequences of
    one varlen call, and a window is the kernel's (it is the same band in every document)."""
    varlen = None
    if spec.cu_seqlens is not None and len(spec.cu_seqlens) > 2:
        lens = [e - s for s, e in zip(spec.cu_seqlens, spec.cu_seqlens[1:])]
        key = ("ulysses-varlen", spec.cu_seqlens, spec.batch, str(device))
        varlen = topo.cached(key, lambda: kernels.Varlen.build(lens, lens, spec.batch, device))
    return dict(causal=spec.causal, scale=spec.softmax_scale, varlen=varlen, window=kernels.sliding_band(spec.window, spec.causal),
                softcap=spec.softcap)


def _attend(q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
    return kernels.attend(q, k, v, kernel=spec.kernel, **_kernel_options(spec, topo, q.device))


def head_groups_for(requested: int, q_heads: int, kv_heads: int) -> int:
    """The pipeline's head groups for a rank's ``q_heads`` and ``kv_heads``: the largest G up
    to ``requested`` that splits the q heads into groups each of which either has its own
    KV heads (G divides ``kv_heads``) or shares one KV head (a group within one GQA set)."""
    per_kv = q_heads // kv_heads
    return max(g for g in range(1, max(1, min(requested, q_heads)) + 1)
               if q_heads % g == 0 and (kv_heads % g == 0 or per_kv % (q_heads // g) == 0))


@contextmanager
def _drained_on_error(posted: list, sent: list):
    """Wait for every all-to-all still in flight before an exception leaves the pipeline, so
    that the caller's next collective cannot meet one of them (``comm.drain``)."""
    try:
        yield
    except BaseException:
        comm.drain(posted + sent)
        raise


def _finish_all_but_last(sent: list) -> None:
    """Finish the transfers posted before the newest (they ran alongside the computation
    just done), so that at most one group's send and receive buffers are held at a time."""
    while len(sent) > 1:
        sent.pop(0)()


class _Pipelined(torch.autograd.Function):
    """Ulysses over G head groups of each rank's heads, with the all-to-alls of one group in
    flight while another group's attention computes.

    Forward: group g+1's q, k, v all-to-all is posted before group g's attention runs, and
    group g's output all-to-all right after it; the backward runs the same pipeline on dout
    and dq, dk, dv. KV heads travel with their group when a rank's KV heads divide into G
    groups; else every group's q heads share one KV head, and the KV heads travel whole with
    the first group (their gradient with the last one, summed over the groups in fp32).
    The same bytes as one fused all-to-all each way, in G calls. ``into`` and ``back`` (see
    ``streams.CommStream``) carry the transfers to the attention and back from it: on CUDA two
    side streams, so that group g+1's unpacking does not queue behind group g's output, which
    waits for group g's kernel.
    """

    @staticmethod
    def forward(ctx, q, k, v, kernel, options, group, table, groups, into, back):
        p = comm.group_size(group)
        split_kv = (k.shape[2] // p) % groups == 0
        per_kv = q.shape[2] // k.shape[2]  # q heads per KV head

        def stage(g):
            kv = [comm.heads_view(t, p, groups, g) for t in (k, v)] if split_kv else [comm.heads_view(t, p) for t in (k, v) if g == 0]
            with into.side():
                return comm.seq_to_heads_start([comm.heads_view(q, p, groups, g), *kv], group, table)

        out, posted, sent, saved, kv_all = torch.empty_like(q), [stage(0)], [], [], None
        with _drained_on_error(posted, sent):
            for g in range(groups):
                if g + 1 < groups:
                    posted.append(stage(g + 1))
                with into.side():
                    q_h, *kv_h = posted[g]()
                into.join(q_h, *kv_h)
                kv_all = kv_h or kv_all
                if not split_kv:  # the one KV head of this group's q heads
                    j = g * q_h.shape[2] // per_kv
                    kv_h = [t[:, :, j:j + 1] for t in kv_all]
                out_h, lse = kernel.block_forward(q_h, *kv_h, **options)
                with back.side():
                    sent.append(comm.heads_to_seq_start([out_h], group, table, [comm.heads_view(out, p, groups, g)]))
                    _finish_all_but_last(sent)
                saved += [q_h, *kv_h, out_h, lse]
            with back.side():
                sent[-1]()
        back.join()
        ctx.save_for_backward(*saved)
        ctx.args, ctx.kv_shape = (kernel, options, group, table, groups, into, back, split_kv, per_kv), k.shape
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, options, group, table, groups, into, back, split_kv, per_kv = ctx.args
        p, saved = comm.group_size(group), ctx.saved_tensors
        needs = ctx.needs_input_grad[:3]
        dout = dout.contiguous()  # head group views of it are split from its head dim
        grads = [torch.empty(shape, dtype=dout.dtype, device=dout.device) if need else None
                 for shape, need in zip((dout.shape, ctx.kv_shape, ctx.kv_shape), needs)]
        # not split: a rank's dK, dV summed over the groups, sent with the last one
        dkv_sum = [None if split_kv or not need else
                   dout.new_zeros(ctx.kv_shape[0], dout.shape[1] * p, ctx.kv_shape[2] // p, dout.shape[3],
                                  dtype=kernels.accumulator_dtype(dout.dtype)) for need in needs[1:]]

        def stage(g):
            with into.side():
                return comm.seq_to_heads_start([comm.heads_view(dout, p, groups, g)], group, table)

        posted, sent = [stage(0)], []
        with _drained_on_error(posted, sent):
            for g in range(groups):
                if g + 1 < groups:
                    posted.append(stage(g + 1))
                with into.side():
                    (dout_h,) = posted[g]()
                into.join(dout_h)
                d_h = kernel.block_backward(dout_h, *saved[5 * g:5 * g + 5], **options)
                srcs, dests = [], []
                for i, need in enumerate(needs):
                    if not need:
                        continue
                    if i == 0 or split_kv:
                        srcs.append(d_h[i]), dests.append(comm.heads_view(grads[i], p, groups, g))
                        continue
                    j = g * dout_h.shape[2] // per_kv
                    dkv_sum[i - 1][:, :, j:j + 1] += d_h[i]
                    if g == groups - 1:
                        srcs.append(dkv_sum[i - 1].to(dout.dtype)), dests.append(comm.heads_view(grads[i], p))
                with back.side():
                    if srcs:
                        sent.append(comm.heads_to_seq_start(srcs, group, table, dests))
                    _finish_all_but_last(sent)
            with back.side():
                if sent:
                    sent[-1]()
        back.join()
        return (*grads, None, None, None, None, None, None, None)


class UlyssesBackend:
    """``head_groups``: pipeline the all-to-alls over this many head groups (see :class:`_Pipelined`;
    1: one fused all-to-all each way); None: the topology's profile says
    (``Profile.ulysses_head_groups``). Either is cut to what a rank's heads allow (:func:`head_groups_for`)."""

    def __init__(self, head_groups: int | None = None):
        if head_groups is not None and head_groups < 1:
            raise ValueError(f"ulysses head_groups must be at least 1, got {head_groups}")
        self.head_groups = head_groups
        self.name = "ulysses" if head_groups is None else f"ulysses-g{head_groups}"

    def groups(self, spec: AttnSpec, topo, profile: Profile | None = None) -> int:
        requested = self.head_groups or profile_for(topo, profile).ulysses_head_groups
        p = topo.sp_size
        return head_groups_for(requested, spec.q_heads // p, comm.kv_heads_sent(spec.kv_heads, p) // p)

    def check(self, spec: AttnSpec, topo) -> str | None:
        problem = comm.head_scatter_problem(spec.q_heads, spec.kv_heads, topo.sp_size)
        return f"ulysses: {problem}; use ring, allgather or hybrid" if problem else None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        p, groups = topo.sp_size, self.groups(spec, topo, profile)
        comm_bytes = comm.head_scatter_bytes(spec, p)
        # forward and backward: two all-to-alls each per head group, of the same volume in all
        transfer = profile.link("all_to_all", topo.spans_nodes("sp")).seconds(2 * comm_bytes, calls=4 * groups) if p > 1 else 0.0
        efficiency = profile.efficiency(self.name, spec.seq_len)  # one call over the whole sequence
        compute = profile.attention_fwd_bwd_seconds(spec, p, efficiency)
        # pipelined, one group's transfers in and out wait; the rest run alongside the attention
        seconds = transfer / groups + profile.overlapped(compute, transfer * (groups - 1) / groups, "all_to_all")
        hkv = comm.kv_heads_sent(spec.kv_heads, p)
        peak = spec.shard_bytes + spec.head_bytes * (2 * spec.q_heads + 2 * hkv)  # and the head-sharded copies
        peak += spec.kernel_workspace_bytes(spec.q_heads // p, spec.seq_len, spec.seq_len)
        if groups > 1:  # the backward holds every group's head shards until its last send, and sums dK, dV in fp32 unless split
            peak += spec.head_bytes * (2 * spec.q_heads + 2 * hkv)
            peak += int(2 * spec.head_bytes * hkv * spec.accumulator_ratio) if (hkv // p) % groups else 0
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=comm_bytes, bwd_comm_bytes=comm_bytes,  # dout in, dq dk dv out
                        kernel_efficiency=efficiency)

    def forward(self, q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
        p = topo.sp_size
        if p == 1:
            return _attend(q, k, v, spec, topo)
        k, v = comm.replicate_kv_for_scatter(k, v, p)
        table = spec.chunk_table(p)
        groups = self.groups(spec, topo)
        if groups > 1:
            into, back = (topo.cached((f"comm-stream-{way}", str(q.device)), lambda: CommStream(q.device)) for way in ("into", "back"))
            return _Pipelined.apply(q, k, v, kernels.get_kernel(spec.kernel), _kernel_options(spec, topo, q.device), topo.sp_group, table,
                                    groups, into, back)
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], topo.sp_group, table)
        (out,) = comm.heads_to_seq([_attend(q_h, k_h, v_h, spec, topo)], topo.sp_group, table)
        return out
