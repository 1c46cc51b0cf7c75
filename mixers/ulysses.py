"""Ulysses for token mixers: all-to-all a mixer's per-head tensors from sequence-sharded to
head-sharded after its input projections, run the model's own convolution and recurrence on the
whole sequence for 1/P of the heads, and all-to-all the output back before its output projection.
Exact by construction, 1/P of the mixer's compute per rank, and the bytes of Ulysses attention
over the tensors moved. Inputs shared by a group of heads (Gated DeltaNet's key heads, Mamba2's
B/C groups) are split by group, or replicated when there are fewer groups than ranks, as
Ulysses attention does with KV heads. Each mixer class needs an adapter that splits its forward
at those boundaries (`register_adapter`, called by the model integrations in
``ulysses_sp.integrations``, as backends register with the registry); a mixer without
one, or whose heads P does not divide, is not taken (``auto`` gives it the allgather fallback).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

from ulysses_sp.mixers.common import refuse_unsupported
from ulysses_sp.spec import MixerEstimate

__all__ = ["ADAPTERS", "Adapter", "UlyssesMixer", "rank_groups", "register_adapter"]


@dataclasses.dataclass(frozen=True)
class Adapter:
    heads: Callable
    """``heads(module) -> (heads, groups)``: the heads split across ranks (P must divide them) and
    the groups of heads that share inputs (P and the groups must divide one another)."""
    run: Callable
    """``run(module, hidden_states, topo, cu_seqlens) -> output``: the mixer's forward with the
    all-to-alls at its projection boundaries (``cu_seqlens``: global document boundaries or None)."""
    sent: Callable
    """``sent(module, p, itemsize) -> (in, out)``: bytes per token of what goes head-sharded (groups
    replicated as ``run`` does) and of what comes back."""


ADAPTERS: dict[str, Adapter] = {}
"""Adapters by mixer class name."""


def register_adapter(names, adapter: Adapter) -> None:
    """Register ``adapter`` for the mixer classes named ``names``."""
    for name in names:
        ADAPTERS[name] = adapter


def rank_groups(groups: int, p: int, rank: int) -> range:
    """The head groups rank ``rank`` of ``p`` runs: its share when ``p`` divides ``groups``, else the
    one group its heads belong to (each replicated ``p / groups`` times by ``comm.replicate_kv_for_scatter``)."""
    first, count = rank * groups // p, max(groups // p, 1)
    return range(first, first + count)


class UlyssesMixer:
    name = "ulysses"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        """None if this strategy can run ``module`` on the topology, else why not."""
        adapter = ADAPTERS.get(type(module).__name__)
        if adapter is None:
            return (f"ulysses: no adapter for {type(module).__name__} (there are for {', '.join(sorted(ADAPTERS)) or 'none'}); "
                    "mixer='auto' takes allgather there")
        (heads, groups), p, name = adapter.heads(module), self.topo.sp_size, type(module).__name__
        if heads % p:
            return f"ulysses: {name}'s {heads} heads do not divide by the SP size {p}; mixer='auto' takes allgather there"
        if groups % p and p % groups:
            return (f"ulysses: {name}'s {groups} head groups and the SP size {p} must divide one another; "
                    "mixer='auto' takes allgather there")
        return None

    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """1/P of the mixer's compute; (P-1)/P of the tensors moved each way, again in the backward."""
        p = self.topo.sp_size
        moved = batch * seq_local * sum(ADAPTERS[type(module).__name__].sent(module, p, itemsize)) * (p - 1) // p
        return MixerEstimate(1 / p, moved, moved)

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        refuse_unsupported(module, kwargs, self.name)
        hidden = args[0] if args else kwargs.get("hidden_states")
        return ADAPTERS[type(module).__name__].run(module, hidden, self.topo, cu_seqlens)
