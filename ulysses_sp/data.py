"""Cutting sequences into this rank's shard and putting them back together.

``shard_sequence`` / ``gather_sequence`` follow ``topo.layout``; the batch-level
helpers (labels, position ids, packed documents) build on them.
"""

from __future__ import annotations

import torch

from . import comm
from . import layout as _layout
from .topology import Topology

__all__ = ["shard_sequence", "gather_sequence"]


def shard_sequence(x: torch.Tensor, topo: Topology, dim: int = 1) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim``, in ``topo.layout``.

    Local slicing, no communication; differentiable. The length along ``dim``
    must divide by ``sp_size`` (``2 * sp_size`` for zigzag): pad with
    ``pad_to_multiple`` first.
    """
    return _layout.shard(x, topo.layout, topo.sp_size, topo.sp_rank, dim)


def gather_sequence(x_local: torch.Tensor, topo: Topology, dim: int = 1) -> torch.Tensor:
    """Inverse of :func:`shard_sequence`: the full tensor in global token order, on every rank.

    Differentiable; the backward sums the gradients of every rank's use of the
    result and returns this rank's shard of the sum (a reduce-scatter), i.e. the
    gradient of the sum of the ranks' losses.
    """
    dim = dim % x_local.dim()
    full = comm.all_gather(x_local, topo.sp_group, dim)
    if _layout.chunks_per_rank(topo.layout) == 1:
        return full
    seq_len = full.shape[dim]
    held = torch.cat([_layout.positions(topo.layout, seq_len, topo.sp_size, r) for r in range(topo.sp_size)])
    return full.index_select(dim, torch.argsort(held).to(full.device))
