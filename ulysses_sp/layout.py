"""How the tokens of one sequence are laid across the ranks of an SP group.

The layout belongs to the batch, not to a backend: it is decided once
(`Topology.layout`), applied when the batch is sharded, and every backend
accepts every layout.

* ``contiguous``: the sequence is cut into P chunks; rank r holds chunk r.
* ``zigzag``: the sequence is cut into 2P chunks; rank r holds chunks r and
  2P-1-r, so under a causal mask every rank has the same amount of work.

Everything here is pure tensor slicing: no communication.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "LAYOUTS",
    "check_layout",
    "chunks_per_rank",
    "required_multiple",
    "chunk_table",
    "positions",
    "check_seq_len",
    "shard",
    "pad_to_multiple",
]

LAYOUTS = ("contiguous", "zigzag")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    return layout


def chunks_per_rank(layout: str) -> int:
    """How many contiguous chunks of the global sequence one rank holds."""
    return 2 if check_layout(layout) == "zigzag" else 1


def required_multiple(layout: str, sp_size: int) -> int:
    """The global sequence length must be a multiple of this."""
    return chunks_per_rank(layout) * sp_size


def chunk_table(layout: str, sp_size: int) -> list[list[int]]:
    """``table[r]`` lists, in local order, the global chunk indices rank r holds.

    Chunks are numbered 0 .. required_multiple-1 along the global sequence.
    """
    if chunks_per_rank(layout) == 1:
        return [[r] for r in range(sp_size)]
    return [[r, 2 * sp_size - 1 - r] for r in range(sp_size)]


def positions(layout: str, seq_len: int, sp_size: int, rank: int) -> torch.Tensor:
    """Global token positions held by ``rank``, in local order (int64)."""
    check_seq_len(seq_len, layout, sp_size)
    c = seq_len // required_multiple(layout, sp_size)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in chunk_table(layout, sp_size)[rank]])


def check_seq_len(seq_len: int, layout: str, sp_size: int) -> None:
    multiple = required_multiple(layout, sp_size)
    if seq_len <= 0 or seq_len % multiple:
        raise ValueError(
            f"sequence length {seq_len} must be a positive multiple of {multiple} "
            f"(layout {layout!r} over {sp_size} ranks: "
            f"{'2 * sp_size' if layout == 'zigzag' else 'sp_size'}); "
            f"pad it with ulysses_sp.pad_to_multiple(x, {multiple}, dim=...)"
        )


def shard(x: torch.Tensor, layout: str, sp_size: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's part of ``x`` along ``dim`` (differentiable; a view for contiguous)."""
    seq_len = x.shape[dim]
    check_seq_len(seq_len, layout, sp_size)
    c = seq_len // required_multiple(layout, sp_size)
    parts = [x.narrow(dim, i * c, c) for i in chunk_table(layout, sp_size)[rank]]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def pad_to_multiple(x: torch.Tensor, multiple: int, dim: int = 1, value: float = 0) -> torch.Tensor:
    """Pad ``x`` at the end of ``dim`` with ``value`` up to a multiple of ``multiple``.

    For labels pass ``value=-100`` so padded positions are ignored by the loss.
    """
    if multiple <= 0:
        raise ValueError(f"multiple must be positive, got {multiple}")
    dim = dim % x.dim()
    extra = -x.shape[dim] % multiple
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim) + [0, extra]
    return F.pad(x, pad, value=value)
