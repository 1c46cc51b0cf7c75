"""How the tokens of one sequence are laid across the ranks of an SP group.

The layout belongs to the batch, not to a backend: it is decided once
(`Topology.layout`), applied when the batch is sharded, and every backend
accepts every layout.

* ``contiguous``: the sequence is cut into P chunks; rank r holds chunk r.
* ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, so under a causal mask every rank has the same amount of work.
* ``balanced``: for packed rows, where zigzag balances nothing (a rank's causal
  work is the sum over its tokens of their position in their document + 1, and
  one long document dominates the chunks it falls in). The sequence is cut into
  k P equal chunks (k: the largest of 8 .. 2 that divides; `chunks_per_rank`)
  and each rank gets k of them by work, longest processing time first: the chunk
  with the most work goes to the least-loaded rank that still has room. The
  placement is a pure function of the global document boundaries, the same on
  every rank with no collective, so the batch's ``cu_seqlens`` carries it: every
  function here takes them for this layout. Chunks need not align with documents.

Every layout is a chunk table (`chunk_table`: the equal chunks each rank
holds), which is all the backends read. Everything here is pure tensor slicing:
no communication.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

__all__ = [
    "LAYOUTS",
    "check_layout",
    "BALANCED_MAX_CHUNKS",
    "chunks_per_rank",
    "chunk_work",
    "document_bounds",
    "table_imbalance",
    "work_imbalance",
    "required_multiple",
    "chunk_table",
    "positions",
    "owners",
    "check_seq_len",
    "shard",
    "pad_to_multiple",
]

LAYOUTS = ("contiguous", "zigzag", "balanced")
BALANCED_MAX_CHUNKS = 8
"""Chunks per rank under ``balanced`` where the length allows: more balance a long document
finer, and each is a kernel call per chunk pair in the ring and all-gather plans."""


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str, seq_len: int | None = None, sp_size: int | None = None) -> int:
    """How many contiguous chunks of the global sequence one rank holds (``balanced``: the
    largest k <= BALANCED_MAX_CHUNKS that divides ``seq_len`` into k * ``sp_size`` chunks)."""
    if check_layout(layout) != "balanced":
        return 2 if layout == "zigzag" else 1
    if seq_len is None or sp_size is None:
        raise ValueError("the balanced layout's chunks per rank depend on the sequence length and SP size: pass both")
    return next((k for k in range(BALANCED_MAX_CHUNKS, 2, -1) if seq_len % (k * sp_size) == 0), 2)


def required_multiple(layout: str, sp_size: int) -> int:
    """The global sequence length must be a multiple of this."""
    return (1 if check_layout(layout) == "contiguous" else 2) * sp_size


def chunk_table(layout: str, sp_size: int, seq_len: int | None = None, cu_seqlens=None) -> list[list[int]]:
    """``table[r]`` lists, in local order, the global chunk indices rank r holds.

    Chunks are numbered along the global sequence, ``chunks_per_rank * sp_size`` of them.
    ``balanced`` needs ``seq_len`` and the global document boundaries ``cu_seqlens`` (None:
    one document).
    """
    if check_layout(layout) == "contiguous":
        return [[r] for r in range(sp_size)]
    if layout == "zigzag":
        return [[r, 2 * sp_size - 1 - r] for r in range(sp_size)]
    if seq_len is None:
        raise ValueError("the balanced layout's chunk table depends on the sequence length: pass seq_len")
    return [list(row) for row in _balanced_table(seq_len, sp_size, document_bounds(cu_seqlens, seq_len))]


def document_bounds(cu_seqlens, seq_len: int) -> tuple[int, ...]:
    """Global document boundaries as a tuple of ints (one host read for a tensor): ``(0, seq_len)``
    for None, else ``cu_seqlens``, which must run from 0 to ``seq_len``."""
    if cu_seqlens is None:
        return (0, seq_len)
    bounds = tuple(int(b) for b in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens))
    if bounds[0] != 0 or bounds[-1] != seq_len:
        raise ValueError(f"cu_seqlens must run from 0 to the sequence length {seq_len}, got {bounds[0]} .. {bounds[-1]}")
    return bounds


def _keys_seen(n: int, length: int, causal: bool, window: int | None) -> int:
    """Query-key pairs of the first ``n`` queries of a document of ``length`` tokens."""
    if not causal:
        return n * length
    if window is None or n <= window:
        return n * (n + 1) // 2
    return window * (window + 1) // 2 + (n - window) * window


def chunk_work(seq_len: int, chunks: int, cu_seqlens, *, causal: bool = True, window: int | None = None) -> list[int]:
    """Attention work of each of ``chunks`` equal chunks: the query-key pairs of its tokens' queries
    (causal: the sum over its tokens of their position in their document + 1, at most ``window``;
    not causal: their document's length). Linear in chunks + documents."""
    c, bounds, work = seq_len // chunks, list(cu_seqlens), [0] * chunks
    for a, b in zip(bounds, bounds[1:]):
        for i in range(a // c, -(-b // c)):  # the chunks this document overlaps
            lo, hi = max(a, i * c) - a, min(b, (i + 1) * c) - a  # positions in the document, [lo, hi)
            work[i] += _keys_seen(hi, b - a, causal, window) - _keys_seen(lo, b - a, causal, window)
    return work


def table_imbalance(table, seq_len: int, cu_seqlens=None, *, causal: bool = True, window: int | None = None) -> float:
    """The most-loaded row of a chunk table's attention work over the mean (1.0: balanced). A row
    is a rank's chunks, or (hybrid) a ring rank's Ulysses group's."""
    bounds = document_bounds(cu_seqlens, seq_len)
    work = chunk_work(seq_len, sum(len(row) for row in table), bounds, causal=causal, window=window)
    loads = [sum(work[c] for c in row) for row in table]
    return max(loads) * len(loads) / sum(loads) if sum(loads) else 1.0


def work_imbalance(layout: str, seq_len: int, sp_size: int, cu_seqlens=None, *, causal: bool = True, window: int | None = None) -> float:
    """The slowest rank's attention work over the mean under ``layout`` (1.0: balanced), for a row
    of ``seq_len`` tokens with global document boundaries ``cu_seqlens`` (None: one)."""
    bounds = document_bounds(cu_seqlens, seq_len)
    return table_imbalance(chunk_table(layout, sp_size, seq_len, bounds), seq_len, bounds, causal=causal, window=window)


@functools.lru_cache(maxsize=1024)
def _balanced_table(seq_len: int, sp_size: int, cu_seqlens: tuple) -> tuple[tuple[int, ...], ...]:
    k = chunks_per_rank("balanced", seq_len, sp_size)
    work = chunk_work(seq_len, k * sp_size, cu_seqlens)
    load, table = [0] * sp_size, [[] for _ in range(sp_size)]
    for chunk in sorted(range(k * sp_size), key=lambda i: (-work[i], i)):  # longest processing time first
        rank = min((r for r in range(sp_size) if len(table[r]) < k), key=lambda r: (load[r], r))
        table[rank].append(chunk)
        load[rank] += work[chunk]
    return tuple(tuple(sorted(row)) for row in table)


def _needs_documents(layout: str, cu_seqlens) -> None:
    if layout == "balanced" and cu_seqlens is None:
        raise ValueError("the balanced layout places tokens by document: pass cu_seqlens, the global document boundaries "
                         "([0, seq_len] for one document; shard_batch returns them in the local batch)")


def positions(layout: str, seq_len: int, sp_size: int, rank: int, cu_seqlens=None) -> torch.Tensor:
    """Global token positions held by ``rank``, in local order (int64); ``balanced`` needs ``cu_seqlens``."""
    check_seq_len(seq_len, layout, sp_size)
    _needs_documents(layout, cu_seqlens)
    c = seq_len // (chunks_per_rank(layout, seq_len, sp_size) * sp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_table(layout, sp_size, seq_len, cu_seqlens)[rank]])


def owners(layout: str, seq_len: int, sp_size: int, cu_seqlens=None) -> torch.Tensor:
    """The SP rank holding each global token position (int64, ``[seq_len]``)."""
    owner = torch.empty(seq_len, dtype=torch.long)
    for rank in range(sp_size):
        owner[positions(layout, seq_len, sp_size, rank, cu_seqlens)] = rank
    return owner


def check_seq_len(seq_len: int, layout: str, sp_size: int) -> None:
    multiple = required_multiple(layout, sp_size)
    if seq_len <= 0 or seq_len % multiple:
        raise ValueError(
            f"sequence length {seq_len} must be a positive multiple of {multiple} "
            f"(layout {layout!r} over {sp_size} ranks: "
            f"{'sp_size' if layout == 'contiguous' else '2 * sp_size'}); "
            f"pad it with ulysses_sp.pad_to_multiple(x, {multiple}, dim=...)"
        )


def shard(x: torch.Tensor, layout: str, sp_size: int, rank: int, dim: int = 1, cu_seqlens=None) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (differentiable; a view for contiguous);
    ``balanced`` needs the global document boundaries ``cu_seqlens``."""
    seq_len = x.shape[dim]
    check_seq_len(seq_len, layout, sp_size)
    _needs_documents(layout, cu_seqlens)
    c = seq_len // (chunks_per_rank(layout, seq_len, sp_size) * sp_size)
    parts = [x.narrow(dim, i * c, c) for i in chunk_table(layout, sp_size, seq_len, cu_seqlens)[rank]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1, value: float = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to a multiple of ``multiple``.

    Args:
        x: The tensor to pad.
        multiple: The length along ``dim`` must become a multiple of this (``sp_size``, or
            ``2 * sp_size`` for the ``zigzag`` and ``balanced`` layouts).
        dim: The sequence dimension.
        value: The padding value; for labels pass -100 so the loss ignores padded positions.

    Returns:
        ``x`` itself when already a multiple, else a padded copy.

    Raises:
        ValueError: ``multiple`` is not positive.
    """
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    dim = dim % x.dim()
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad, value=value)
