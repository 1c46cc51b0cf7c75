"""Ring attention over a process group: the piece the ring and hybrid backends share.

Each rank keeps its queries; keys and values travel around the ring, one
hop per step, the next hop posted before the current block is computed.
Partial results merge in fp32 through ``(out, lse)``; key chunks a causal
mask hides are never computed. The backward is a custom autograd Function
that recomputes every block from the saved ``(q, k, v, out, lse)`` and sends
the dK/dV accumulators around the ring with the K/V they belong to, so memory
stays O(local tokens) and no graph is kept per step.

Tokens are described by chunk ids (``layout.chunk_table``): ``chunk_lists[r]``
lists, in local order, the equal-length global chunks group rank r holds.
Packed sequences cut each block at document boundaries (``layout.block_segments``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import comm, kernels
from .layout import block_segments

__all__ = ["ring_attention"]

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
    def forward(ctx, q, k, v, group, chunk_lists, causal, scale, cu_seqlens):
        r = dist.get_rank(group)
        c = q.shape[1] // len(chunk_lists[r])
        acc = kernels.accumulator_dtype(q.dtype)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        posted = []
        try:
            for src, k_cur, v_cur in _kv_blocks(k, v, group, posted):
                segments = block_segments(chunk_lists[r], chunk_lists[src], c, causal, cu_seqlens)
                kernels.blocks_forward(q, k_cur, v_cur, segments, scale, out_acc, lse_acc)
        except BaseException:
            comm.drain(posted)
            raise
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.args = (group, chunk_lists, causal, scale, cu_seqlens)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, chunk_lists, causal, scale, cu_seqlens = ctx.args
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        p, r = comm.group_size(group), dist.get_rank(group)
        c = q.shape[1] // len(chunk_lists[r])
        acc = kernels.accumulator_dtype(q.dtype)
        dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        arriving, wait_grads = None, None
        posted = []
        try:
            for src, k_cur, v_cur in _kv_blocks(k, v, group, posted):
                dk_blk = torch.zeros(k.shape, dtype=acc, device=k.device)
                dv_blk = torch.zeros(v.shape, dtype=acc, device=v.device)
                segments = block_segments(chunk_lists[r], chunk_lists[src], c, causal, cu_seqlens)
                kernels.blocks_backward(dout, q, k_cur, v_cur, out, lse, segments, scale, dq_acc, dk_blk, dv_blk)
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
        return dq, dk, dv, None, None, None, None, None


def ring_attention(q_bshd, k_bshd, v_bshd, group, chunk_lists, *, causal: bool, scale: float, cu_seqlens=None) -> torch.Tensor:
    """Attention of this rank's queries to the keys of every rank of ``group``;
    ``cu_seqlens`` (global document boundaries) keeps it inside each document."""
    return _RingAttention.apply(q_bshd, k_bshd, v_bshd, group, chunk_lists, causal, scale, cu_seqlens)
