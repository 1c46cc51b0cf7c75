"""``auto`` for a token mixer that more than one of ulysses, state and allgather can run: per call,
the strategy of least estimated time at the call's shape (batch, tokens, dtype), since which wins
depends on the length: ulysses moves bytes that grow with the sequence at 1/P of the compute; state
moves a fixed summary per fragment and runs the scan once more (widened); allgather moves
(P-1) x the input and runs the whole sequence.

A strategy's time is its share of the mixer's compute, counted as 6 FLOPs per parameter and token
(forward and backward) at the profile's kernel rate, plus its forward and backward transfers over
the profile's link for their collective (`ulysses_sp.profile`). Every rank computes the same
choice from the same figures; it is cached per shape.
"""

from __future__ import annotations

from ulysses_sp.mixers.common import parameter_count
from ulysses_sp.profile import profile_for
from ulysses_sp.spec import MixerEstimate

__all__ = ["AutoMixer", "seconds"]

_COLLECTIVES = {"halo": ("p2p", "p2p"), "ulysses": ("all_to_all", "all_to_all"), "state": ("all_gather", "reduce_scatter"),
                "allgather": ("all_gather", "reduce_scatter")}
"""Each strategy's collective forward and backward."""


def seconds(name: str, estimate: MixerEstimate, module, batch: int, seq_local: int, dtype, topo, profile=None) -> float:
    """Estimated forward and backward seconds of one call of ``module`` under strategy ``name``."""
    profile = profile_for(topo, profile)
    flops = 6 * parameter_count(module) * batch * seq_local * topo.sp_size
    spans = topo.spans_nodes("sp")
    transfers = zip(_COLLECTIVES.get(name, ("all_gather", "reduce_scatter")), (estimate.comm_bytes, estimate.bwd_comm_bytes))
    return estimate.compute * profile.attention_seconds(flops, dtype) + sum(profile.link(c, spans).seconds(b) for c, b in transfers if b)


class AutoMixer:
    """The cheapest of ``strategies`` (each able to run the module) per call; ``name`` is the last
    call's choice (``auto`` before the first)."""

    def __init__(self, topo, strategies: list):
        self.topo, self.strategies, self.name, self._chosen = topo, strategies, "auto", {}

    def costs(self, module, batch: int, seq_local: int, hidden: int, dtype, profile=None) -> dict:
        """``{strategy: (seconds, MixerEstimate)}`` at this shape."""
        out = {}
        for s in self.strategies:
            e = s.estimate(module, batch, seq_local, hidden, dtype.itemsize)
            out[s.name] = (seconds(s.name, e, module, batch, seq_local, dtype, self.topo, profile), e)
        return out

    def choose(self, module, batch: int, seq_local: int, hidden: int, dtype, profile=None):
        """The strategy of least estimated seconds (the first in `AUTO_ORDER` on a tie)."""
        key = (batch, seq_local, hidden, dtype, id(profile))
        if key not in self._chosen:
            costs = self.costs(module, batch, seq_local, hidden, dtype, profile)
            self._chosen[key] = min(self.strategies, key=lambda s: costs[s.name][0])
        return self._chosen[key]

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        x = args[0] if args else kwargs.get("hidden_states")
        strategy = self.choose(module, batch, seq_local, x.shape[-1], x.dtype)
        self.name = strategy.name
        return strategy(module, forward, args, kwargs, batch, seq_local, cu_seqlens)
