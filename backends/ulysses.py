"""Ulysses: head-scatter all-to-all (DeepSpeed-Ulysses).

Sequence-sharded q, k, v go through one fused all-to-all to become
head-sharded full sequences in global token order; each rank runs ordinary
attention on its heads; one all-to-all brings the output back to sequence
shards. Needs the q heads to divide by P. For GQA/MQA the KV heads are
scattered when P divides them, and otherwise each KV head is replicated
P / kv_heads times (the minimum that gives every rank the one KV head its q
heads use); autograd sums the replicas' gradients. ``ulysses-g{G}`` runs G head
groups one after another (`_Pipelined`), each group's head shards alive only while
it runs, so that the attention's transient memory falls with G; ``ulysses`` takes G
from the profile (1 in the built-in ones).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from ulysses_sp import comm, kernels
from ulysses_sp.blocks import PlannedKernel, cached_plan
from ulysses_sp.profile import Profile, profile_for
from ulysses_sp.spec import AttnSpec, Estimate
from ulysses_sp.streams import CommStream

__all__ = ["UlyssesBackend", "head_groups_for"]


def _kernel(spec: AttnSpec, topo, device):
    """The kernel of the call over whole sequences: the named one, or where the mask has
    bidirectional blocks, which no kernel's own mask states, one that runs the block plan of the
    whole sequence (`blocks.PlannedKernel`)."""
    if spec.blocks is None:
        return kernels.get_kernel(spec.kernel)
    whole = ((0, spec.seq_len),)
    return topo.cached(("ulysses-planned", spec, str(device)), lambda: PlannedKernel(spec.kernel, cached_plan(topo, whole, whole, spec, device), spec))


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


def _attend(q, k, v, spec: AttnSpec, topo, sinks=None) -> torch.Tensor:
    return kernels.attend(q, k, v, kernel=_kernel(spec, topo, q.device), sinks=sinks, **_kernel_options(spec, topo, q.device))


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
    """Ulysses over G head groups of each rank's heads, each group's head shards alive only while
    it runs (UPipe's schedule): the attention's transient memory falls with G.

    Forward: group g+1's q, k, v all-to-all is posted before group g's attention runs, and group
    g's output all-to-all right after it; a group's head shards are dropped once its output is
    sent. Kept for the backward: copies of q (and of K and V when they split) as sequence shards,
    which the backward overwrites with the gradients group by group. Backward, one group after
    another (no transfer beside another's buffers): q and dout (and the group's K/V heads) go to
    head layout, the group's output is recomputed, the kernel's backward runs, and dq (dk, dv) go
    back. The backward so moves q once more and runs the attention's forward once more than plain
    Ulysses; it holds no group's head shards beyond its turn, nor the output, which the output
    projection would otherwise free before this backward.

    KV heads travel with their group when a rank's KV heads divide into G groups (kept as
    sequence shards); else every group's q heads share one KV head, and the KV heads travel whole
    with the first group and are kept as head shards; their gradient is summed over the groups in
    fp32 and sent once the groups are done. ``into`` and ``back`` (see ``streams.CommStream``)
    carry the transfers to the attention and back from it: on CUDA two side streams, so that
    group g+1's unpacking does not queue behind group g's output, which waits for group g's kernel.
    """

    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel, options, group, table, groups, into, back):
        p = comm.group_size(group)
        split_kv = (k.shape[2] // p) % groups == 0
        per_kv = q.shape[2] // k.shape[2]  # q heads per KV head

        def stage(g):
            kv = [comm.heads_view(t, p, groups, g) for t in (k, v)] if split_kv else [comm.heads_view(t, p) for t in (k, v) if g == 0]
            with into.side():
                return comm.seq_to_heads_start([comm.heads_view(q, p, groups, g), *kv], group, table)

        out, posted, sent, kv_all = torch.empty_like(q), [stage(0)], [], (k, v)
        with _drained_on_error(posted, sent):
            for g in range(groups):
                if g + 1 < groups:
                    posted.append(stage(g + 1))
                with into.side():
                    q_h, *kv_h = posted.pop(0)()
                into.join(q_h, *kv_h)
                if not split_kv:  # the one KV head of this group's q heads
                    kv_all = kv_h or kv_all
                    j = g * q_h.shape[2] // per_kv
                    kv_h = [t[:, :, j:j + 1] for t in kv_all]
                out_h, lse = kernel.block_forward(q_h, *kv_h, **options)
                if sinks is not None:
                    out_h, lse = kernels.add_sink(out_h, lse, sinks.view(groups, -1)[g])
                with back.side():
                    sent.append(comm.heads_to_seq_start([out_h], group, table, [comm.heads_view(out, p, groups, g)]))
                    _finish_all_but_last(sent)
                del q_h, kv_h, out_h, lse
            with back.side():
                sent.pop()()
        back.join()
        # copies of q (and of K, V kept as sequence shards): the backward writes each group's gradient over the group's
        # slice once it is sent, so the gradients take no memory of their own; the caller's q, k, v are freed as usual
        ctx.save_for_backward(*(t.clone(memory_format=torch.contiguous_format) for t in (q, *kv_all[: 2 * split_kv])), *kv_all[2 * split_kv:],
                              sinks)
        ctx.args, ctx.done = (kernel, options, group, table, groups, into, back, split_kv, per_kv), False
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, options, group, table, groups, into, back, split_kv, per_kv = ctx.args
        if ctx.done:
            raise RuntimeError("ulysses-g{G}'s backward runs once (its gradients take the saved q's memory): backward with "
                               "retain_graph=True through it is not supported; use backend='ulysses'")
        ctx.done = True
        p = comm.group_size(group)
        q, k, v, sinks = ctx.saved_tensors  # k, v: sequence shards if split, else the rank's whole KV head shards
        dsinks = torch.zeros_like(sinks) if ctx.needs_input_grad[3] else None
        needs = ctx.needs_input_grad[:3]
        dout = dout.contiguous()  # head group views of it are split from its head dim
        dq = q if needs[0] else None  # group g's slice written once group g's q is sent
        dkv = [t if need and split_kv else None for t, need in zip((k, v), needs[1:])]
        dkv_sum = [torch.zeros_like(t, dtype=kernels.accumulator_dtype(dout.dtype)) if need and not split_kv else None
                   for t, need in zip((k, v), needs[1:])]

        def stage(g):
            kv = [comm.heads_view(t, p, groups, g) for t in (k, v)] if split_kv else []
            with into.side():
                return comm.seq_to_heads_start([comm.heads_view(t, p, groups, g) for t in (q, dout)] + kv, group, table)

        posted, sent = [], []
        with _drained_on_error(posted, sent):
            for g in range(groups):
                with back.side():  # group g-1's gradients, before group g's inputs take their buffers
                    while sent:
                        sent.pop(0)()
                posted.append(stage(g))
                with into.side():
                    q_h, dout_h, *kv_h = posted.pop(0)()
                into.join(q_h, dout_h, *kv_h)
                j = g * q_h.shape[2] // per_kv
                if not split_kv:
                    kv_h = [t[:, :, j:j + 1] for t in (k, v)]
                out_h, lse = kernel.block_forward(q_h, *kv_h, **options)  # recomputed: the output is not kept
                if sinks is not None:
                    out_h, lse = kernels.add_sink(out_h, lse, sinks.view(groups, -1)[g])
                if dsinks is not None:
                    dsinks.view(groups, -1)[g] = kernels.sink_grad(dout_h, out_h, lse, sinks.view(groups, -1)[g])
                d_h = kernel.block_backward(dout_h, q_h, *kv_h, out_h, lse, **options)
                del q_h, out_h, lse, dout_h, kv_h
                srcs, dests = [], []
                for d, whole, acc in zip(d_h, (dq, *dkv), (None, *dkv_sum)):
                    if whole is not None:
                        srcs.append(d), dests.append(comm.heads_view(whole, p, groups, g))
                    elif acc is not None:
                        acc[:, :, j:j + 1] += d
                del d_h, d
                if srcs:
                    with back.side():
                        sent.append(comm.heads_to_seq_start(srcs, group, table, dests))
                del srcs
            with back.side():
                if sent:
                    sent.pop()()
                if any(acc is not None for acc in dkv_sum):  # the shared KV heads' gradients, summed over the groups
                    srcs = []
                    for i, acc in enumerate(dkv_sum):
                        if acc is not None:
                            dkv_sum[i] = None  # its fp32 buffer freed before the next one is cast
                            srcs.append(acc.to(dout.dtype))
                    del acc
                    got = iter(comm.heads_to_seq_start(srcs, group, table)())
                    dkv = [next(got).flatten(2, 3) if need else None for need in needs[1:]]
        back.join()
        return (dq, *dkv, dsinks, None, None, None, None, None, None, None)


class UlyssesBackend:
    """``head_groups``: run this many head groups one after another (see `_Pipelined`; 1: one fused
    all-to-all each way); None: the topology's profile says (``Profile.ulysses_head_groups``).
    Either is cut to what a rank's heads allow (`head_groups_for`)."""

    takes_sinks = True

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
        hkv = comm.kv_heads_sent(spec.kv_heads, p)
        split_kv = (hkv // p) % groups == 0
        bwd_bytes = comm_bytes  # dout in, dq dk dv out; over head groups q (and K/V when split) in again
        if groups > 1:
            bwd_bytes += spec.head_bytes * (spec.q_heads + 2 * hkv * split_kv) * (p - 1) // p
        link = profile.link("all_to_all", topo.spans_nodes("sp"))
        fwd_transfer, bwd_transfer = (link.seconds(b, calls=2 * groups) if p > 1 else 0.0 for b in (comm_bytes, bwd_bytes))
        efficiency = profile.efficiency(self.name, spec.seq_len)  # one call over the whole sequence
        flops = spec.attention_flops(p)
        fwd, bwd = (profile.attention_seconds(flops, spec.dtype, backward=b) / efficiency for b in (False, True))
        # forward: one group's transfers in and out wait, the rest run alongside the attention; backward: one group after
        # another, each output recomputed (with G = 1: both exposed, no recompute)
        seconds = fwd_transfer / groups + profile.overlapped(fwd, fwd_transfer * (groups - 1) / groups, "all_to_all")
        seconds += bwd_transfer + bwd + (fwd if groups > 1 else 0.0)
        # the head-sharded copies: all at once, or a group's (and the next one's in flight) and unsplit K/V whole
        peak = spec.shard_bytes + (spec.head_bytes * (2 * spec.q_heads + 2 * hkv) if groups == 1 else
                                   2 * spec.head_bytes * (2 * spec.q_heads + 2 * hkv * split_kv) // groups + 2 * spec.head_bytes * hkv * (not split_kv))
        peak += spec.kernel_workspace_bytes(spec.q_heads // p // groups, spec.seq_len, spec.seq_len)
        if not split_kv:  # dK, dV summed over the groups in fp32
            peak += int(2 * spec.head_bytes * hkv * spec.accumulator_ratio)
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=comm_bytes, bwd_comm_bytes=bwd_bytes, kernel_efficiency=efficiency)

    def forward(self, q, k, v, spec: AttnSpec, topo, sinks=None) -> torch.Tensor:
        p = topo.sp_size
        if p == 1:
            return _attend(q, k, v, spec, topo, sinks)
        if sinks is not None:  # rank j runs q heads [j H/P, (j+1) H/P): their sinks
            sinks = sinks.view(p, -1)[topo.sp_rank]
        k, v = comm.replicate_kv_for_scatter(k, v, p)
        table = spec.chunk_table(p)
        groups = self.groups(spec, topo)
        if groups > 1:
            into, back = (topo.cached((f"comm-stream-{way}", str(q.device)), lambda: CommStream(q.device)) for way in ("into", "back"))
            return _Pipelined.apply(q, k, v, sinks, _kernel(spec, topo, q.device), _kernel_options(spec, topo, q.device), topo.sp_group, table,
                                    groups, into, back)
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], topo.sp_group, table)
        (out,) = comm.heads_to_seq([_attend(q_h, k_h, v_h, spec, topo, sinks)], topo.sp_group, table)
        return out
