"""Block-wise attention for the ring, hybrid and all-gather backends: which kernel calls
attend this rank's queries to one set of keys (:func:`plan_blocks`), and running them
into fp32 accumulators (:func:`blocks_forward`, :func:`blocks_backward`).

A plan has at most one kernel call per (query chunk, run of visible key chunks),
however many documents are packed: the documents a pair shares become the sequences
of one varlen call (``kernels.Varlen``), a pair sharing none is skipped, and no mask
is built. Plans are pure functions of the layout and the packing, computed once per
call signature and kept in ``Topology.cache`` with their device tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from .kernels import Varlen, get_kernel, merge_partials
from .layout import block_runs

__all__ = ["BlockCall", "plan_blocks", "cached_plan", "blocks_forward", "blocks_backward"]


@dataclass(frozen=True, eq=False)
class BlockCall:
    """One kernel call: local queries ``q0:q1`` attend local keys ``k0:k1``; ``causal`` is
    the kernel's (bottom-right) mask, within each sequence of ``varlen`` when packed."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    varlen: Varlen | None = None


def _docs_in(chunk_id: int, chunk: int, cu_seqlens) -> range:
    """Indices of the documents that overlap global chunk ``chunk_id``."""
    lo, hi = chunk_id * chunk, (chunk_id + 1) * chunk
    return range(bisect.bisect_right(cu_seqlens, lo) - 1, bisect.bisect_left(cu_seqlens, hi))


def _overlap(doc: int, chunk_id: int, chunk: int, cu_seqlens) -> int:
    return max(0, min(cu_seqlens[doc + 1], (chunk_id + 1) * chunk) - max(cu_seqlens[doc], chunk_id * chunk))


def _packed_call(q_chunk: int, k_run, chunk: int, causal: bool, cu_seqlens, q_lo: int, k_lo: int, batch: int, device):
    """The call for one query chunk and a run of key chunks (increasing global ids) of a
    packed sequence, or None when they share no document. Every document is an interval,
    so its queries are consecutive in the chunk and its keys consecutive in the run: the
    documents between the first and the last shared one are the call's sequences."""
    docs = sorted(set(_docs_in(q_chunk, chunk, cu_seqlens)).union(*(_docs_in(b, chunk, cu_seqlens) for b in k_run)))
    rows, q_pos, k_pos = [], 0, 0
    for d in docs:
        nq = _overlap(d, q_chunk, chunk, cu_seqlens)
        nk = sum(_overlap(d, b, chunk, cu_seqlens) for b in k_run)
        rows.append((q_pos, nq, k_pos, nk))
        q_pos, k_pos = q_pos + nq, k_pos + nk
    shared = [i for i, (_, nq, _, nk) in enumerate(rows) if nq and nk]
    if not shared:
        return None
    rows = rows[shared[0] : shared[-1] + 1]
    (q_first, _, k_first, _), (q_last, nq_last, k_last, nk_last) = rows[0], rows[-1]
    varlen = None if len(rows) == 1 else Varlen.build([r[1] for r in rows], [r[3] for r in rows], batch, device)
    return BlockCall(q_lo + q_first, q_lo + q_last + nq_last, k_lo + k_first, k_lo + k_last + nk_last, causal, varlen)


def plan_blocks(q_chunks, k_chunks, chunk: int, causal: bool, cu_seqlens=None, batch: int = 1, device=None) -> tuple[BlockCall, ...]:
    """The kernel calls that attend local queries (global chunk ids ``q_chunks``, in local
    order, ``chunk`` tokens each) to local keys (``k_chunks``), given the global document
    boundaries ``cu_seqlens`` of a packed sequence (or None)."""
    calls = []
    for i, j0, j1, diagonal in block_runs(q_chunks, k_chunks, causal):
        q_lo, k_lo = i * chunk, j0 * chunk
        if cu_seqlens is None:
            calls.append(BlockCall(q_lo, q_lo + chunk, k_lo, j1 * chunk, diagonal))
            continue
        call = _packed_call(q_chunks[i], k_chunks[j0:j1], chunk, diagonal, cu_seqlens, q_lo, k_lo, batch, device)
        if call is not None:
            calls.append(call)
    return tuple(calls)


def cached_plan(topo, q_chunks, k_chunks, chunk: int, spec, device) -> tuple[BlockCall, ...]:
    """:func:`plan_blocks` for ``spec``'s causal flag, packing and batch, kept in ``topo.cache``."""
    key = ("blocks", tuple(q_chunks), tuple(k_chunks), chunk, spec.causal, spec.cu_seqlens, spec.batch, str(device))
    return topo.cached(key, lambda: plan_blocks(q_chunks, k_chunks, chunk, spec.causal, spec.cu_seqlens, spec.batch, device))


def blocks_forward(kernel: str, q, k, v, calls, scale: float, out_acc, lse_acc) -> None:
    """Run ``calls`` with the named kernel and merge their results into the fp32
    accumulators ``out_acc`` ``[B, Sq, H, D]`` / ``lse_acc`` ``[B, H, Sq]`` in place.
    q, k and v reach the kernel in their own dtype."""
    run = get_kernel(kernel).block_forward
    for c in calls:
        o, lse = run(q[:, c.q0 : c.q1], k[:, c.k0 : c.k1], v[:, c.k0 : c.k1], causal=c.causal, scale=scale, varlen=c.varlen)
        out_acc[:, c.q0 : c.q1], lse_acc[..., c.q0 : c.q1] = merge_partials(out_acc[:, c.q0 : c.q1], lse_acc[..., c.q0 : c.q1], o, lse)


def blocks_backward(kernel: str, dout, q, k, v, out, lse, calls, scale: float, dq_acc, dk_acc, dv_acc) -> None:
    """Gradients of :func:`blocks_forward` from the final ``out``/``lse`` of every query row,
    added in place to the accumulators ``dq_acc``, ``dk_acc``, ``dv_acc``."""
    run = get_kernel(kernel).block_backward
    for c in calls:
        dq, dk, dv = run(
            dout[:, c.q0 : c.q1], q[:, c.q0 : c.q1], k[:, c.k0 : c.k1], v[:, c.k0 : c.k1], out[:, c.q0 : c.q1],
            lse[..., c.q0 : c.q1], causal=c.causal, scale=scale, varlen=c.varlen,
        )
        dq_acc[:, c.q0 : c.q1] += dq
        dk_acc[:, c.k0 : c.k1] += dk
        dv_acc[:, c.k0 : c.k1] += dv
