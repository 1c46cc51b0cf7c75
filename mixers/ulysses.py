"""Ulysses for token mixers: all-to-all a mixer's per-head tensors from sequence-sharded to
head-sharded after its input projections, run the model's own convolution and recurrence on the
whole sequence for 1/P of the heads, and all-to-all the output back before its output projection.
Exact by construction, 1/P of the mixer's compute per rank, and the bytes of Ulysses attention
over the tensors moved. Each mixer class needs an adapter that splits its forward at those
boundaries (:data:`ADAPTERS`, filled by ``ulysses_sp.integrations``); a mixer without one, or whose
heads P does not divide, is not taken (``auto`` gives it the allgather fallback).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

__all__ = ["ADAPTERS", "Adapter", "UlyssesMixer", "adapters"]


@dataclasses.dataclass(frozen=True)
class Adapter:
    heads: Callable
    """``heads(module) -> int``: the head count split across ranks (P must divide it)."""
    run: Callable
    """``run(module, hidden_states, topo, cu_seqlens) -> output``: the mixer's forward with the
    all-to-alls at its projection boundaries (``cu_seqlens``: global document boundaries or None)."""


ADAPTERS: dict[str, Adapter] = {}
"""Adapters by mixer class name (:func:`adapters` registers the built-in ones)."""


def adapters() -> dict[str, Adapter]:
    """Every adapter, the built-in ones (which import nothing beyond torch) registered on first use."""
    import ulysses_sp.integrations.gated_deltanet  # noqa: F401

    return ADAPTERS


class UlyssesMixer:
    name = "ulysses"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        """None if this strategy can run ``module`` on the topology, else why not."""
        adapter = adapters().get(type(module).__name__)
        if adapter is None:
            return (f"ulysses: no adapter for {type(module).__name__} (adapters: {', '.join(sorted(adapters())) or 'none'}); "
                    "mixer='auto' takes allgather there")
        heads = adapter.heads(module)
        if heads % self.topo.sp_size:
            return (f"ulysses: {type(module).__name__}'s {heads} heads do not divide by the SP size {self.topo.sp_size}; "
                    "mixer='auto' takes allgather there")
        return None

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        hidden = args[0] if args else kwargs.get("hidden_states")
        mask = kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError(f"{type(module).__name__}: a padding attention_mask is not supported by the ulysses mixer; pad on the right "
                             "with ulysses_sp.shard_batch and drop attention_mask")
        if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
            raise ValueError(f"{type(module).__name__}: a cache (generation) is not supported under sequence parallelism; "
                             "call remove_sequence_parallel(model) to generate")
        return ADAPTERS[type(module).__name__].run(module, hidden, self.topo, cu_seqlens)
