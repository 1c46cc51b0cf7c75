"""All-gather (Llama 3 context parallelism): gather K/V a chunk of KV heads at a time.

Queries stay local. For each chunk of ``heads_k_stride`` KV heads, K and V
are all-gathered over the SP group (the next chunk's gather posted before the
current one is computed) and left in the order gathered (rank-major); each
local query chunk attends to the key runs it may see, found from the chunk
table's global positions: full blocks before it, the causal diagonal,
nothing after. Under the zigzag layout every rank has the
same work. The backward recomputes from the saved ``(q, k, v, out, lse)``,
re-gathers each K/V chunk and reduce-scatters dK/dV. Only one or two head
chunks of full-length K/V are alive at once.

``heads_k_stride`` may be any value from 1 to kv_heads (a last, smaller chunk
takes the remainder); by default the largest that keeps two chunks of
gathered K and V within ``max_gather_bytes``.

Under a sliding window of W tokens shorter than a chunk, a query sees at most
the W - 1 keys before its own chunk: only those *tails* of every chunk are
gathered (the union of what any rank's windows reach), and each rank attends
its own chunks from its local K/V. Wider windows gather everything, as without one, and so do
windows over bidirectional blocks (a block's queries see its later keys too).
"""

from __future__ import annotations

import torch

from ulysses_sp import comm
from dataclasses import dataclass

from ulysses_sp.blocks import blocks_backward, blocks_forward, cached_plan, chunk_segments, first_writes
from ulysses_sp.kernels import accumulator_dtype, add_sink, sink_grad
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["AllGatherBackend"]


def _head_chunks(kv_heads: int, stride: int) -> list[tuple[int, int]]:
    return [(h, min(h + stride, kv_heads)) for h in range(0, kv_heads, stride)]


def tail_tokens(spec: AttnSpec, chunk: int) -> int:
    """Tokens of each chunk that other ranks need: the last W - 1 under a window W shorter
    than a chunk, else (or where bidirectional blocks reach later keys) all of them."""
    return chunk if spec.window is None or spec.window > chunk or spec.blocks else spec.window - 1


@dataclass(frozen=True, eq=False)
class _Plan:
    tails: torch.Tensor | None
    """Local positions of this rank's tails (None: every token is gathered)."""
    own_calls: tuple
    """Calls against this rank's own K/V (only when tails are gathered)."""
    calls: tuple
    """Calls against the gathered K/V, in the order gathered (rank-major)."""
    first: tuple
    """``blocks.first_writes`` of (own_calls, calls)."""


def _plan(q, spec: AttnSpec, topo) -> _Plan:
    """The tail positions and kernel calls, kept in ``topo.cache`` per mask and packing. The
    gathered K/V stay in the order the all-gather delivers (rank r's chunks, in its local
    order, then rank r+1's); the plan reads each chunk's global position from the chunk
    table, so nothing is reordered (under zigzag a query chunk may need one more call where
    its visible keys are not adjacent in that order)."""
    table = spec.chunk_table(topo.sp_size)
    mine = table[topo.sp_rank]
    c = q.shape[1] // len(mine)
    tail = tail_tokens(spec, c)
    own = chunk_segments(mine, c)
    gathered_order = [n for chunks in table for n in chunks]
    if tail == c:
        calls = cached_plan(topo, own, chunk_segments(gathered_order, c), spec, q.device)
        return _Plan(None, (), calls, tuple(first_writes([(), calls])))
    tails = topo.cached(("allgather-tails", len(mine), c, tail, str(q.device)), lambda: torch.tensor(
        [i * c + c - tail + j for i in range(len(mine)) for j in range(tail)], dtype=torch.long, device=q.device))
    gathered = [((x + 1) * c - tail, tail) if x not in mine else (None, tail) for x in gathered_order]  # own tails: attended locally
    own_calls, calls = cached_plan(topo, own, own, spec, q.device), cached_plan(topo, own, gathered, spec, q.device)
    return _Plan(tails, own_calls, calls, tuple(first_writes([own_calls, calls])))


def _gathered_head_chunks(k, v, group, stride: int, plan: _Plan):
    """Yield ``(h0, h1, k_full, v_full)``: KV heads h0..h1-1 of every rank's gathered tokens
    (rank-major); the next chunk's all-gather is posted before this one is used."""
    chunks = _head_chunks(k.shape[2], stride)
    if plan.tails is not None and not len(plan.tails):  # a window of 1: nothing to gather
        yield from ((h0, h1, None, None) for h0, h1 in chunks)
        return
    pending = _gather(k, v, chunks[0], group, plan.tails)
    try:
        for n, (h0, h1) in enumerate(chunks):
            k_full, v_full = (wait() for wait in pending)
            if n + 1 < len(chunks):
                pending = _gather(k, v, chunks[n + 1], group, plan.tails)
            yield h0, h1, k_full, v_full
    except BaseException:  # the consumer raised (GeneratorExit here): no prefetch may stay in flight
        comm.drain(pending)
        raise


def _gather(k, v, heads: tuple[int, int], group, tails):
    """Posted all-gathers of K and V heads h0..h1-1 (``group`` None: one rank, which holds them all)."""
    h0, h1 = heads
    parts = [t[:, :, h0:h1] if tails is None else t[:, tails, h0:h1] for t in (k, v)]
    if group is None:
        return [lambda t=t: t for t in parts]
    return [comm.all_gather_start(t, group, dim=1) for t in parts]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, plan, kernel, spec, stride):
        groups = q.shape[2] // k.shape[2]
        acc = accumulator_dtype(q.dtype)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        for h0, h1, k_full, v_full in _gathered_head_chunks(k, v, group, stride, plan):
            qh, kh = slice(h0 * groups, h1 * groups), slice(h0, h1)
            blocks_forward(kernel, q[:, :, qh], k[:, :, kh], v[:, :, kh], plan.own_calls, spec, out_acc[:, :, qh], lse_acc[:, qh], plan.first[0])
            if k_full is not None:
                blocks_forward(kernel, q[:, :, qh], k_full, v_full, plan.calls, spec, out_acc[:, :, qh], lse_acc[:, qh], plan.first[1])
        if sinks is not None:
            out_acc, lse_acc = add_sink(out_acc, lse_acc, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc, sinks)
        ctx.args = (group, plan, kernel, spec, stride)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, plan, kernel, spec, stride = ctx.args
        dsinks = sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        groups = q.shape[2] // k.shape[2]
        acc = accumulator_dtype(q.dtype)
        dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_k else None
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_v else None
        for h0, h1, k_full, v_full in _gathered_head_chunks(k, v, group, stride, plan):
            qh, kh = slice(h0 * groups, h1 * groups), slice(h0, h1)
            per_q = (dout[:, :, qh], q[:, :, qh])
            own = (None, None)
            if plan.tails is not None:  # own chunks from the local K/V
                own = tuple(torch.zeros(t[:, :, kh].shape, dtype=acc, device=t.device) for t in (k, v))
                blocks_backward(kernel, *per_q, k[:, :, kh], v[:, :, kh], out[:, :, qh], lse[:, qh], plan.own_calls, spec, dq_acc[:, :, qh], *own)
            gathered = (None, None)
            if k_full is not None:
                gathered = tuple(torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k_full, v_full))
                blocks_backward(kernel, *per_q, k_full, v_full, out[:, :, qh], lse[:, qh], plan.calls, spec, dq_acc[:, :, qh], *gathered)
            for mine, grad_full, dest in zip(own, gathered, (dk, dv)):
                if dest is None:
                    continue
                if grad_full is not None:  # rank-major, as gathered: each rank keeps the sum for its own tokens
                    summed = grad_full if group is None else comm.reduce_scatter_sum(grad_full, group, dim=1)
                    if mine is None:
                        mine = summed
                    else:
                        mine[:, plan.tails] += summed
                dest[:, :, kh] = mine
        return (dq_acc.to(q.dtype) if need_q else None), dk, dv, dsinks, None, None, None, None, None


class AllGatherBackend:
    name = "allgather"
    takes_sinks = True

    def __init__(self, heads_k_stride: int | None = None, max_gather_bytes: int = 1 << 30):
        if heads_k_stride is not None and (isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or heads_k_stride < 1):
            raise ValueError(f"heads_k_stride must be a positive integer or None, got {heads_k_stride!r}")
        self.heads_k_stride, self.max_gather_bytes = heads_k_stride, max_gather_bytes

    def stride(self, spec: AttnSpec) -> int:
        """KV heads gathered at once."""
        if self.heads_k_stride is not None:
            return min(self.heads_k_stride, spec.kv_heads)
        per_head = 4 * spec.batch * spec.seq_len * spec.head_dim * spec.element_size  # K and V, two chunks alive
        return max(1, min(spec.kv_heads, self.max_gather_bytes // per_head))

    def check(self, spec: AttnSpec, topo) -> str | None:
        if self.heads_k_stride is not None and self.heads_k_stride > spec.kv_heads:
            return f"{self.name}: heads_k_stride ({self.heads_k_stride}) exceeds the kv heads ({spec.kv_heads})"
        return None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        p = topo.sp_size
        chunk = spec.local_seq_len // spec.chunks_per_rank(topo.sp_size)
        gathered_tokens = tail_tokens(spec, chunk) * spec.chunks_per_rank(p) * p
        kv_local = 2 * spec.head_bytes * spec.kv_heads
        sent = kv_local * gathered_tokens // spec.seq_len  # this rank's tails (every token without a window)
        acc = spec.accumulator_ratio
        comm_bytes = sent * (p - 1)
        chunks = -(-spec.kv_heads // self.stride(spec))
        spans = topo.spans_nodes("sp")
        # forward and backward each gather K and V per head chunk; the backward reduce-scatters dK, dV (fp32)
        transfer = 0.0
        if comm_bytes:
            transfer = profile.link("all_gather", spans).seconds(2 * comm_bytes, calls=4 * chunks)
            transfer += profile.link("reduce_scatter", spans).seconds(comm_bytes * acc, calls=2 * chunks)
        gathered = 4 * spec.batch * gathered_tokens * self.stride(spec) * spec.head_dim * spec.element_size
        q_bytes = spec.head_bytes * spec.q_heads
        # the first chunk's gather is exposed; the rest overlaps the previous chunk's compute
        imbalance = spec.work_imbalance(spec.chunk_table(p))
        efficiency = profile.efficiency(self.name, chunk)  # one varlen call per chunk of queries
        seconds = transfer / chunks + profile.overlapped(profile.attention_fwd_bwd_seconds(spec, p, efficiency) * imbalance,
                                                         transfer * (1 - 1 / chunks), "all_gather")
        groups = spec.q_heads // spec.kv_heads
        seen = spec.seq_len if spec.window is None else min(spec.seq_len, chunk + spec.window)  # a query chunk's keys
        workspace = spec.kernel_workspace_bytes(self.stride(spec) * groups, chunk, seen)
        return Estimate(seconds=seconds, peak_bytes=int(q_bytes * (2 + acc) + kv_local + gathered + workspace), comm_bytes=comm_bytes,
                        bwd_comm_bytes=int(comm_bytes * (1 + acc)), work_imbalance=imbalance,  # re-gather K/V, reduce-scatter dK/dV
                        kernel_efficiency=efficiency)

    def forward(self, q, k, v, spec: AttnSpec, topo, sinks=None) -> torch.Tensor:
        group = topo.sp_group if topo.sp_size > 1 else None  # one rank: no collectives
        return _AllGatherAttention.apply(q, k, v, sinks, group, _plan(q, spec, topo), spec.kernel, spec, self.stride(spec))
