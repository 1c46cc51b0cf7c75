"""Ring attention over a process group: the piece the ring and hybrid backends share.

Each rank keeps its queries; keys and values travel around the ring, one
hop per step, the next hop posted before the current block is computed.
Partial results merge in fp32 through ``(out, lse)``; key chunks a causal
mask or a sliding window hides are never computed. The backward is a custom
autograd Function that recomputes every block from the saved
``(q, k, v, out, lse)`` and sends the dK/dV accumulators around the ring with
the K/V they belong to, so memory stays O(local tokens) and no graph is kept
per step.

What a rank computes against the keys of each source rank is a block plan
(``blocks.plan_blocks``: ``ring_plans`` makes them from the chunk ids each rank
holds, ``layout.chunk_table``); the kernel that runs them is named by the caller.
The ring runs only as many hops as the farthest source any rank's queries see
(``RingPlans.hops``; under a sliding window and the contiguous layout, one or two):
K/V go no further, and after the last hop each dK/dV accumulator is sent straight
back to its owner instead of around the rest of the ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .blocks import blocks_backward, blocks_forward, cached_plan, chunk_segments, first_writes, sees_any
from .kernels import accumulator_dtype, add_sink, sink_grad

__all__ = ["RingPlans", "ring_attention", "ring_plans", "ring_hops"]

_KV_TAG, _GRAD_TAG = 0, 1


@dataclass(frozen=True, eq=False)
class RingPlans:
    """This rank's block plan against the keys of each ring rank (``calls[src]``), and the
    hops every rank runs: the farthest ring distance at which any rank's queries see a key."""

    calls: list
    hops: int
    first: list
    """Per source, per call: stored without a merge (``blocks.first_writes`` in ring order)."""


def _kv_blocks(k, v, group, hops: int, posted: list):
    """``(src, K, V)`` for this rank's own block and the next ``hops`` in ring order. The
    next hop is posted before a block is handed out and its wait appended to ``posted``, so
    the caller can ``comm.drain`` it if it raises while the hop is in flight."""
    p, r = comm.group_size(group), dist.get_rank(group)
    k_cur, v_cur = k, v
    for step in range(hops + 1):
        if step < hops:
            (k_next, v_next), wait = comm.ring_send_recv([k_cur, v_cur], group, send_to=(r + 1) % p, recv_from=(r - 1) % p, tag=_KV_TAG)
            posted.append(wait)
        yield (r - step) % p, k_cur, v_cur
        if step < hops:
            wait()
            k_cur, v_cur = k_next, v_next


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, plans, kernel, spec):
        acc = accumulator_dtype(q.dtype)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        posted = []
        try:
            for src, k_cur, v_cur in _kv_blocks(k, v, group, plans.hops, posted):
                blocks_forward(kernel, q, k_cur, v_cur, plans.calls[src], spec, out_acc, lse_acc, plans.first[src])
        except BaseException:
            comm.drain(posted)
            raise
        if sinks is not None:
            out_acc, lse_acc = add_sink(out_acc, lse_acc, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc, sinks)
        ctx.args = (group, plans, kernel, spec)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        group, plans, kernel, spec = ctx.args
        dsinks = sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        p, r = comm.group_size(group), dist.get_rank(group)
        acc = accumulator_dtype(q.dtype)
        dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        arriving, wait_grads = None, None
        posted = []
        try:
            for step, (src, k_cur, v_cur) in enumerate(_kv_blocks(k, v, group, plans.hops, posted)):
                dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
                blocks_backward(kernel, dout, q, k_cur, v_cur, out, lse, plans.calls[src], spec, dq_acc, dk_blk, dv_blk)
                if need_k or need_v:
                    # The accumulators of block `src` travel with it: add what earlier ranks
                    # gave, pass on; the last hop's go straight back to their owner, so each
                    # rank receives its own block's sum.
                    if wait_grads is not None:
                        wait_grads()
                        dk_blk += arriving[0]
                        dv_blk += arriving[1]
                    if plans.hops == 0:
                        arriving = (dk_blk, dv_blk)
                    else:
                        ahead = 1 if step < plans.hops else p - plans.hops
                        arriving, wait_grads = comm.ring_send_recv(
                            [dk_blk, dv_blk], group, send_to=(r + ahead) % p, recv_from=(r - ahead) % p, tag=_GRAD_TAG
                        )
                        posted.append(wait_grads)
        except BaseException:
            comm.drain(posted)
            raise
        dk = dv = None
        if need_k or need_v:
            if wait_grads is not None:
                wait_grads()
            dk = arriving[0].to(k.dtype) if need_k else None
            dv = arriving[1].to(v.dtype) if need_v else None
        dq = dq_acc.to(q.dtype) if need_q else None
        return dq, dk, dv, dsinks, None, None, None, None


def ring_hops(chunk_lists, chunk: int, spec) -> int:
    """The farthest ring distance at which some rank's queries see some key (0: none beyond its own)."""
    p = len(chunk_lists)
    segs = [chunk_segments(c, chunk) for c in chunk_lists]
    mask = dict(causal=spec.causal, window=spec.window, cu_seqlens=spec.cu_seqlens, blocks=spec.blocks)
    return max((d for d in range(1, p) for r in range(p) if sees_any(segs[r], segs[(r - d) % p], **mask)), default=0)


def ring_plans(topo, chunk_lists, rank: int, spec, q) -> RingPlans:
    """This rank's `RingPlans` when ring rank ``src`` holds chunks ``chunk_lists[src]``."""
    chunk = q.shape[1] // len(chunk_lists[rank])
    hops = topo.cached(("ring-hops", tuple(map(tuple, chunk_lists)), chunk, spec.causal, spec.window, spec.cu_seqlens, spec.blocks),
                       lambda: ring_hops(chunk_lists, chunk, spec))
    mine = chunk_segments(chunk_lists[rank], chunk)
    calls = [cached_plan(topo, mine, chunk_segments(c, chunk), spec, q.device) for c in chunk_lists]
    p = len(chunk_lists)
    order = [(rank - step) % p for step in range(hops + 1)]
    first = dict(zip(order, first_writes([calls[src] for src in order])))
    return RingPlans(calls, hops, [first.get(src) for src in range(p)])


def ring_attention(q_bshd, k_bshd, v_bshd, group, plans: RingPlans, *, kernel: str, spec, sinks=None) -> torch.Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group``, computing
    ``plans.calls[src]`` (``ring_plans``) against the keys of ring rank ``src`` with ``kernel``
    (``spec`` gives the scale and soft-cap). ``sinks``: the learned sink of each of ``q_bshd``'s
    heads, folded in once per row after the last hop (`kernels.add_sink`)."""
    return _RingAttention.apply(q_bshd, k_bshd, v_bshd, sinks, group, plans, kernel, spec)
