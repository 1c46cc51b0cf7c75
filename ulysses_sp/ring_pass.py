"""Ring attention over a process group: the piece the ring and hybrid backends share.

Each rank keeps its queries; keys and values travel around the ring, one
hop per step, the next hop posted before the current block is computed.
Partial results merge in fp32 through ``(out, lse)``; key chunks a causal
mask hides are never computed. The backward is a custom autograd Function
that recomputes every block from the saved ``(q, k, v, out, lse)`` and sends
the dK/dV accumulators around the ring with the K/V they belong to, so memory
stays O(local tokens) and no graph is kept per step.

What a rank computes against the keys of each source rank is a block plan
(``blocks.plan_blocks``: ``ring_plans`` makes them from the chunk ids each rank
holds, ``layout.chunk_table``); the kernel that runs them is named by the caller.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm
from .blocks import blocks_backward, blocks_forward, cached_plan
from .kernels import accumulator_dtype

__all__ = ["ring_attention", "ring_plans"]

_KV_TAG, _GRAD_TAG = 0, 1


def _kv_blocks(k, v, group, posted: list):
    """``(src, K, V)`` for the blocks of every rank, own first, in ring order. The next hop
    is posted before a block is handed out and its wait appended to ``posted``, so the
    caller can ``comm.drain`` it if it raises while the hop is in flight."""
    p, r = comm.group_size(group), dist.get_rank(group)
    k_cur, v_cur = k, v
    for step in range(p):
        if step < p - 1:
            (k_next, v_next), wait = comm.ring_send_recv([k_cur, v_cur], group, send_to=(r + 1) % p, recv_from=(r - 1) % p, tag=_KV_TAG)
            posted.append(wait)
        yield (r - step) % p, k_cur, v_cur
        if step < p - 1:
            wait()
            k_cur, v_cur = k_next, v_next


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plans, kernel, scale):
        acc = accumulator_dtype(q.dtype)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        posted = []
        try:
            for src, k_cur, v_cur in _kv_blocks(k, v, group, posted):
                blocks_forward(kernel, q, k_cur, v_cur, plans[src], scale, out_acc, lse_acc)
        except BaseException:
            comm.drain(posted)
            raise
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.args = (group, plans, kernel, scale)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, plans, kernel, scale = ctx.args
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        p, r = comm.group_size(group), dist.get_rank(group)
        acc = accumulator_dtype(q.dtype)
        dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        arriving, wait_grads = None, None
        posted = []
        try:
            for src, k_cur, v_cur in _kv_blocks(k, v, group, posted):
                dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
                blocks_backward(kernel, dout, q, k_cur, v_cur, out, lse, plans[src], scale, dq_acc, dk_blk, dv_blk)
                if need_k or need_v:
                    # The accumulators of block `src` travel with it: add what earlier ranks
                    # gave, pass on; after the last step each rank receives its own block's sum.
                    if wait_grads is not None:
                        wait_grads()
                        dk_blk += arriving[0]
                        dv_blk += arriving[1]
                    if p == 1:
                        arriving = (dk_blk, dv_blk)
                    else:
                        arriving, wait_grads = comm.ring_send_recv([dk_blk, dv_blk], group, send_to=(r + 1) % p, recv_from=(r - 1) % p, tag=_GRAD_TAG)
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
        return dq, dk, dv, None, None, None, None


def ring_plans(topo, chunk_lists, rank: int, spec, q) -> list:
    """This rank's block plan against each ring rank's keys (``chunk_lists[src]``)."""
    chunk = q.shape[1] // len(chunk_lists[rank])
    return [cached_plan(topo, chunk_lists[rank], chunks, chunk, spec, q.device) for chunks in chunk_lists]


def ring_attention(q_bshd, k_bshd, v_bshd, group, plans, *, kernel: str, scale: float) -> torch.Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group``, computing
    ``plans[src]`` (``ring_plans``) against the keys of ring rank ``src`` with ``kernel``."""
    return _RingAttention.apply(q_bshd, k_bshd, v_bshd, group, plans, kernel, scale)
