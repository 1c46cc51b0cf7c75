"""Sequence-parallel strategies for token mixers other than softmax attention (the Gated
DeltaNet, Mamba2 and short-convolution layers of hybrid models), one file per strategy, the
way `ulysses_sp.backends` holds attention's. A strategy runs one mixer call: it gets the
mixer's own forward and the call's arguments as this rank holds them (``[B, S_local, ...]``)
and returns this rank's rows of what one process would compute on the whole sequence.

``halo`` sends each chunk the few tokens before it, for short convolutions used alone;
``ulysses`` splits the mixer's heads across ranks where an adapter for its class exists;
``allgather`` is the universal fallback: exact for any mixer, at P times the mixer's compute;
``state`` passes the recurrent state between fragments (fixed-size traffic) where a state adapter
exists.
``auto`` takes halo where it can run the mixer (O(kernel) tokens at 1/P of the compute); else,
where more than one of ulysses, state and allgather can, the one of least estimated time at each
call's shape (`ulysses_sp.mixers.auto`: the crossover between ulysses and state moves with the
length); each strategy's ``estimate()`` gives the figures, which ``sp-bench plan`` shows.
"""

from __future__ import annotations

from ulysses_sp.mixers.allgather import AllGatherMixer
from ulysses_sp.mixers.auto import AutoMixer
from ulysses_sp.mixers.halo import HaloMixer
from ulysses_sp.mixers.state import StateMixer
from ulysses_sp.mixers.ulysses import UlyssesMixer

__all__ = ["AUTO_ORDER", "BUILT_IN", "MIXERS", "MIXER_CHOICES", "AllGatherMixer", "AutoMixer", "HaloMixer", "StateMixer", "UlyssesMixer", "get_mixer"]

MIXERS = {"halo": HaloMixer, "ulysses": UlyssesMixer, "allgather": AllGatherMixer, "state": StateMixer}
"""Mixer strategies by name."""
BUILT_IN = tuple(MIXERS)
"""The library's own strategies (what ``sp-bench mixers`` times), whatever is registered beside them."""
AUTO_ORDER = ("halo", "ulysses", "state", "allgather")
"""What ``auto`` considers: halo where it can run; else the cheapest of the rest that can (on a tie,
the first)."""
MIXER_CHOICES = ("auto", *MIXERS, "none")
"""What ``apply_sequence_parallel(mixer=...)``, ``--sp-mixer`` and ``sp_mixer`` take; ``none`` refuses hybrid models."""


def get_mixer(name: str, topo, module=None):
    """The strategy ``name`` for ``topo``; ``auto``: halo, or the one strategy that can run ``module``,
    or an `AutoMixer` over those that can. A named strategy that cannot run ``module`` raises
    ``ValueError`` with the reason."""
    if name not in MIXERS and name != "auto":
        raise ValueError(f"mixer must be 'auto', 'none' or one of {sorted(MIXERS)}, got {name!r}")
    if name == "auto":
        if module is None:
            return AllGatherMixer(topo)
        able = [s for s in (MIXERS[n](topo) for n in AUTO_ORDER) if s.check(module) is None]
        return able[0] if able[0].name == "halo" or len(able) == 1 else AutoMixer(topo, able)
    strategy = MIXERS[name](topo)
    why = strategy.check(module) if module is not None and hasattr(strategy, "check") else None
    if why:
        raise ValueError(why)
    return strategy
