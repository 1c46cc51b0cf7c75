"""Block-wise attention for the ring, hybrid, all-gather and halo backends: which kernel
calls attend this rank's queries to one set of keys (`plan_blocks`), and running
them into fp32 accumulators (`blocks_forward`, `blocks_backward`).

Queries and keys are described by *segments*: ``(global start, length)`` in local order
(``start`` None for local positions that are never attended). Masks are stated in global
positions (causal: key <= query; window W: key > query - W; packed: same document) and
each call is trimmed to the queries that see a key and the keys some query sees, so its
mask is flash-attn's bottom-right ``causal``/``window`` (see ``ulysses_sp.kernels``).
A plan has at most one kernel call per (query run, key run) of globally consecutive
segments (a key run is cut where the query run starts, so the keys before it and the
square diagonal are separate calls), however many documents are packed: documents that share the same mask become
the sequences of one varlen call (``kernels.Varlen``; a gap becomes a sequence with no
queries or no keys), pairs that see nothing are skipped, and no mask tensor is built.
Unmasked calls that together cover a larger rectangle of *local* rows are then merged
(`_coalesce`): a rank's two zigzag chunks are not adjacent globally but are locally,
so every zigzag ring step after the first is one kernel call, not two, as in torch's
head-tail ring (both plans timed: ``benchmarks/results/block-calls-P4-bf16.json``); and the first, a rank's
own block (two diagonals and the block between them), is one causal call
(`_merge_diagonals`).
Bidirectional blocks (Gemma 3's image tokens: a query sees every key of its own block, and on
sliding layers those within the window) add to that causal plan only the pairs it leaves out,
the strict upper triangle of each block (key > query), as calls of their own (`_after_in_block`):
the causal plan itself is not cut at block edges.
Plans are pure functions of the layout, the window, the packing and the blocks, computed once per call
signature and kept in ``Topology.cache`` with their device tensors.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from .kernels import Varlen, accumulator_dtype, get_kernel, merge_into

__all__ = ["BlockCall", "PlannedKernel", "chunk_segments", "plan_blocks", "sees_any", "cached_plan", "first_writes", "blocks_forward",
           "blocks_backward"]


@dataclass(frozen=True, eq=False)
class BlockCall:
    """One kernel call: local queries ``q0:q1`` attend local keys ``k0:k1`` with the kernel's
    (bottom-right) ``causal`` mask and ``window`` band, within each sequence of ``varlen``."""

    q0: int
    q1: int
    k0: int
    k1: int
    causal: bool
    varlen: Varlen | None = None
    window: tuple[int, int] | None = None


def chunk_segments(chunk_ids, chunk: int) -> tuple[tuple[int, int], ...]:
    """Segments of equal chunks given by global chunk id, in local order."""
    return tuple((c * chunk, chunk) for c in chunk_ids)


def _runs(segments) -> list[tuple[int, int, int]]:
    """``(global start, global end, local start)`` of each run of segments that are
    consecutive both locally and globally."""
    runs, pos = [], 0
    for start, n in segments:
        if start is not None and n:
            if runs and runs[-1][1] == start and runs[-1][2] + runs[-1][1] - runs[-1][0] == pos:
                runs[-1] = (runs[-1][0], start + n, runs[-1][2])
            else:
                runs.append((start, start + n, pos))
        pos += n
    return runs


def _split_at(runs, start):
    """Runs cut at global position ``start``: a causal query run's keys before it (fully
    visible, or a band) and from it (the square diagonal) become separate calls, so no
    kernel needs a causal mask with more keys than queries."""
    if start is None:
        return runs
    out = []
    for a, b, local in runs:
        out += [(a, start, local), (start, b, local + start - a)] if a < start < b else [(a, b, local)]
    return out


def _docs(cu_seqlens, lo: int, hi: int) -> range:
    """Indices of the documents that overlap ``[lo, hi)``."""
    return range(bisect.bisect_right(cu_seqlens, lo) - 1, bisect.bisect_left(cu_seqlens, hi))


def _rows(q_run, k_run, causal: bool, window, cu_seqlens):
    """Per document shared by the runs: its ``(q0, q1, k0, k1)`` (global) trimmed to the
    queries that see a key and the keys some query sees, its exact band ``(left, right)`` in
    the kernel's bottom-right coordinates, and whether each side masks anything."""
    (qa, qb, _), (ka, kb, _) = q_run, k_run
    bounds = [(qa, qb, ka, kb)]
    if cu_seqlens is not None:
        dq, dk = _docs(cu_seqlens, qa, qb), _docs(cu_seqlens, ka, kb)
        bounds = [
            (max(qa, cu_seqlens[d]), min(qb, cu_seqlens[d + 1]), max(ka, cu_seqlens[d]), min(kb, cu_seqlens[d + 1]))
            for d in range(max(dq.start, dk.start), min(dq.stop, dk.stop))
        ]
    rows = []
    for q0, q1, k0, k1 in bounds:
        band, active = (None, None), (False, False)
        if causal:
            reach = window - 1 if window is not None else q1 - k0  # how far back a query sees
            q0, q1, k0, k1 = max(q0, k0), min(q1, k1 + reach), max(k0, q0 - reach), min(k1, q1)
            right = q1 - k1  # key <= query
            band = (window - 1 - right if window is not None else None, right)  # key > query - window
            active = (window is not None and k0 < q1 - window, k1 - 1 > q0)
        if q1 > q0 and k1 > k0:
            rows.append(((q0, q1, k0, k1), band, active))
    return rows


def _call(rows, q_run, k_run, batch: int, device) -> BlockCall:
    """One call for consecutive documents with the same band; gaps between their query
    (key) ranges become sequences without keys (queries)."""
    lens_q, lens_k = [], []
    (q_first, _, k_first, _), _, _ = rows[0]
    q_end, k_end = q_first, k_first
    for (q0, q1, k0, k1), _, _ in rows:
        if q0 > q_end:
            lens_q, lens_k = lens_q + [q0 - q_end], lens_k + [0]
        if k0 > k_end:
            lens_q, lens_k = lens_q + [0], lens_k + [k0 - k_end]
        lens_q, lens_k = lens_q + [q1 - q0], lens_k + [k1 - k0]
        q_end, k_end = q1, k1
    varlen = Varlen.build(lens_q, lens_k, batch, device) if len(lens_q) > 1 else None
    # a side no document needs is left unbounded (-1)
    left, right = (side if any(r[2][i] for r in rows) else -1 for i, side in enumerate(rows[0][1]))
    window = None if left == -1 and right in (-1, 0) else (left, right)
    q_local, k_local = q_run[2] - q_run[0], k_run[2] - k_run[0]
    return BlockCall(q_local + q_first, q_local + q_end, k_local + k_first, k_local + k_end, right == 0, varlen, window)


def _unmasked(c: BlockCall) -> bool:
    return not c.causal and c.varlen is None and c.window is None


def _coalesce(calls, max_keys: int) -> list[BlockCall]:
    """Merge unmasked calls with the same keys and adjacent query rows, or the same queries
    and adjacent key rows (local) up to ``max_keys`` of them, until no two merge; each merged
    call is as exact as the two it replaces (every query row sees every key row of both).
    The cap keeps a call's dK/dV the size of a shard where the keys are many more (the
    all-gather's: uncapped, its backward held 15% more at 128k tokens on 8 ranks)."""
    calls = list(calls)
    for i, a in enumerate(calls):
        if not _unmasked(a):
            continue
        for j in range(i + 1, len(calls)):
            b = calls[j]
            if _unmasked(b) and (
                (a.k0, a.k1) == (b.k0, b.k1) and (a.q1 == b.q0 or b.q1 == a.q0)
                or (a.q0, a.q1) == (b.q0, b.q1) and (a.k1 == b.k0 or b.k1 == a.k0) and a.k1 - a.k0 + b.k1 - b.k0 <= max_keys
            ):
                merged = BlockCall(min(a.q0, b.q0), max(a.q1, b.q1), min(a.k0, b.k0), max(a.k1, b.k1), False)
                return _coalesce(calls[:i] + [merged] + calls[i + 1 : j] + calls[j + 1 :], max_keys)
    return calls


def _diagonal(c: BlockCall) -> bool:
    """A causal call of queries on the keys of the same local rows: the square diagonal."""
    return c.causal and c.varlen is None and c.window is None and (c.q0, c.q1) == (c.k0, c.k1)


def _merge_diagonals(calls) -> list[BlockCall]:
    """Two diagonal calls on adjacent local rows A, B with the unmasked call of B's queries on
    A's keys are one causal call on A + B: that unmasked call means every key of A is at or
    before every query of B, so local order is global order over A + B and key <= query is
    the local causal mask. A rank's own zigzag block becomes one call, as in torch's ring."""
    for a in calls:
        for b in calls:
            if _diagonal(a) and _diagonal(b) and b.q0 == a.q1:
                below = next((c for c in calls if _unmasked(c) and (c.q0, c.q1, c.k0, c.k1) == (b.q0, b.q1, a.k0, a.k1)), None)
                if below is not None:
                    merged = BlockCall(a.q0, b.q1, a.k0, b.k1, True)
                    return _merge_diagonals([merged if c is a else c for c in calls if c is not b and c is not below])
    return list(calls)


def _after_in_block(q_run, k_run, blocks):
    """Per block that both runs overlap: its pairs with key > query, which a bidirectional block adds
    to the causal mask (on sliding layers too: a later key is always within the window), as
    ``(q0, q1, k0, k1, left)`` in global positions, trimmed to the queries that see a key and the
    keys some query sees; query i sees key j iff ``j >= i + 1``, the kernel's band ``(left, -1)``
    (None: every pair)."""
    (qa, qb, _), (ka, kb, _) = q_run, k_run
    first = max(0, bisect.bisect_right(blocks, (max(qa, ka), float("inf"))) - 1)  # blocks before it end before both runs
    for a, b in blocks[first:]:
        if a >= min(qb, kb):
            break
        q0, q1, k0, k1 = max(qa, a), min(qb, b), max(ka, a), min(kb, b)
        q1, k0 = min(q1, k1 - 1), max(k0, q0 + 1)
        if q1 > q0 and k1 > k0:
            yield q0, q1, k0, k1, (None if q1 - 1 < k0 else k1 - q1 - 1)


def plan_blocks(q_segments, k_segments, *, causal: bool, window: int | None = None, cu_seqlens=None, batch: int = 1,
                device=None, blocks=None) -> tuple[BlockCall, ...]:
    """The kernel calls that attend the local queries (``q_segments``) to the local keys
    (``k_segments``) under a causal mask, a sliding ``window`` (Hugging Face's W: key >
    query - W; needs ``causal``), the documents of ``cu_seqlens`` (global boundaries) and the
    bidirectional ``blocks`` (sorted global ``(start, end)``, each within a document: a query of
    a block also sees the block's later keys)."""
    calls = []
    for q_run in _runs(q_segments):
        for k_run in _split_at(_runs(k_segments), q_run[0] if causal else None):
            rows = _rows(q_run, k_run, causal, window, cu_seqlens)
            start = 0
            for i in range(1, len(rows) + 1):
                if i == len(rows) or rows[i][1] != rows[start][1]:
                    calls.append(_call(rows[start:i], q_run, k_run, batch, device))
                    start = i
    calls = _merge_diagonals(calls)
    for q_run in _runs(q_segments) if blocks else ():
        for k_run in _runs(k_segments):
            q_shift, k_shift = q_run[2] - q_run[0], k_run[2] - k_run[0]
            calls += [BlockCall(q0 + q_shift, q1 + q_shift, k0 + k_shift, k1 + k_shift, False, None, None if left is None else (left, -1))
                      for q0, q1, k0, k1, left in _after_in_block(q_run, k_run, blocks)]
    return tuple(_coalesce(calls, max_keys=sum(n for _, n in q_segments)))


def sees_any(q_segments, k_segments, *, causal: bool, window: int | None = None, cu_seqlens=None, blocks=None) -> bool:
    """Whether any query of ``q_segments`` sees any key of ``k_segments`` (no tensors built)."""
    runs = [(q, k) for q in _runs(q_segments) for k in _runs(k_segments)]
    return any(_rows(q, k, causal, window, cu_seqlens) or blocks and next(_after_in_block(q, k, blocks), None) for q, k in runs)


def cached_plan(topo, q_segments, k_segments, spec, device) -> tuple[BlockCall, ...]:
    """`plan_blocks` for ``spec``'s mask, window, packing, blocks and batch, kept in ``topo.cache``."""
    q_segments, k_segments = tuple(q_segments), tuple(k_segments)
    key = ("blocks", q_segments, k_segments, spec.causal, spec.window, spec.cu_seqlens, spec.blocks, spec.batch, str(device))
    return topo.cached(key, lambda: plan_blocks(
        q_segments, k_segments, causal=spec.causal, window=spec.window, cu_seqlens=spec.cu_seqlens, batch=spec.batch, device=device,
        blocks=spec.blocks,
    ))


def first_writes(call_lists) -> list[tuple[bool, ...]]:
    """For plans run in this order into the same accumulators: per call, whether none of its
    query rows was written by an earlier call, so its result can be stored without a merge."""
    touched, out = [], []
    for calls in call_lists:
        flags = []
        for c in calls:
            flags.append(all(c.q1 <= a or c.q0 >= b for a, b in touched))
            touched.append((c.q0, c.q1))
        out.append(tuple(flags))
    return out


def blocks_forward(kernel: str, q, k, v, calls, spec, out_acc, lse_acc, first=None) -> None:
    """Run ``calls`` with the named kernel and merge their results into the fp32
    accumulators ``out_acc`` ``[B, Sq, H, D]`` / ``lse_acc`` ``[B, H, Sq]`` in place; a call
    flagged in ``first`` (`first_writes`) is stored without merging.
    q, k and v reach the kernel in their own dtype."""
    run = get_kernel(kernel).block_forward
    for i, c in enumerate(calls):
        o, lse = run(q[:, c.q0 : c.q1], k[:, c.k0 : c.k1], v[:, c.k0 : c.k1], causal=c.causal, scale=spec.softmax_scale,
                     varlen=c.varlen, window=c.window, softcap=spec.softcap)
        if first is not None and first[i]:
            out_acc[:, c.q0 : c.q1], lse_acc[..., c.q0 : c.q1] = o, lse
        else:
            merge_into(out_acc[:, c.q0 : c.q1], lse_acc[..., c.q0 : c.q1], o, lse)


def blocks_backward(kernel: str, dout, q, k, v, out, lse, calls, spec, dq_acc, dk_acc, dv_acc) -> None:
    """Gradients of `blocks_forward` from the final ``out``/``lse`` of every query row,
    added in place to the accumulators ``dq_acc``, ``dk_acc``, ``dv_acc``."""
    run = get_kernel(kernel).block_backward
    for c in calls:
        dq, dk, dv = run(
            dout[:, c.q0 : c.q1], q[:, c.q0 : c.q1], k[:, c.k0 : c.k1], v[:, c.k0 : c.k1], out[:, c.q0 : c.q1],
            lse[..., c.q0 : c.q1], causal=c.causal, scale=spec.softmax_scale, varlen=c.varlen, window=c.window, softcap=spec.softcap,
        )
        dq_acc[:, c.q0 : c.q1] += dq
        dk_acc[:, c.k0 : c.k1] += dk
        dv_acc[:, c.k0 : c.k1] += dv


class PlannedKernel:
    """A kernel whose one call over whole sequences runs a plan (`plan_blocks` on ``[(0, S)]``):
    what the Ulysses backend computes with when the mask has bidirectional blocks, which no
    kernel's own mask states. ``block_forward`` / ``block_backward`` keep the kernel contract
    (`ulysses_sp.kernels`) for the sequences the plan was made for; their mask options are the plan's."""

    def __init__(self, kernel: str, calls, spec):
        self.kernel, self.calls, self.spec, self.first = kernel, calls, spec, first_writes([calls])[0]

    def block_forward(self, q, k, v, **_options):
        acc = accumulator_dtype(q.dtype)
        out = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        blocks_forward(self.kernel, q, k, v, self.calls, self.spec, out, lse, self.first)
        return out.to(q.dtype), lse

    def block_backward(self, dout, q, k, v, out, lse, **_options):
        acc = accumulator_dtype(q.dtype)
        grads = [torch.zeros(t.shape, dtype=acc, device=t.device) for t in (q, k, v)]
        blocks_backward(self.kernel, dout, q, k, v, out, lse, self.calls, self.spec, *grads)
        return tuple(g.to(t.dtype) for g, t in zip(grads, (q, k, v)))
