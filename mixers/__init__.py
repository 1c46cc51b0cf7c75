"""Sequence-parallel strategies for token mixers other than softmax attention (the Gated
DeltaNet, Mamba2 and short-convolution layers of hybrid models), one file per strategy, the
way `ulysses_sp.backends` holds attention's. A strategy runs one mixer call: it gets the
mixer's own forward and the call's arguments as this rank holds them (``[B, S_local, ...]``)
and returns this rank's rows of what one process would compute on the whole sequence.

``halo`` sends each chunk the few tokens before it, for short convolutions used alone;
``ulysses`` splits the mixer's heads across ranks where an adapter for its class exists;
``allgather`` is the universal fallback: exact for any mixer, at P times the mixer's compute;
``state`` passes the recurrent state between fragments (fixed-size traffic) where a state adapter
exists, and is taken only when named.
``auto`` takes the first of these that can run the mixer, in that order (by what each moves and
computes: O(kernel) tokens, (P-1)/P of the mixer's inner tensors at 1/P of its compute, (P-1) x
its input at P x its compute; each strategy's ``estimate()`` gives the figures, which
``sp-bench plan`` shows).
"""

from __future__ import annotations

from ulysses_sp.mixers.allgather import AllGatherMixer
from ulysses_sp.mixers.halo import HaloMixer
from ulysses_sp.mixers.state import StateMixer
from ulysses_sp.mixers.ulysses import UlyssesMixer

__all__ = ["AUTO_ORDER", "BUILT_IN", "MIXERS", "MIXER_CHOICES", "AllGatherMixer", "HaloMixer", "StateMixer", "UlyssesMixer", "get_mixer"]

MIXERS = {"halo": HaloMixer, "ulysses": UlyssesMixer, "allgather": AllGatherMixer, "state": StateMixer}
"""Mixer strategies by name."""
BUILT_IN = tuple(MIXERS)
"""The library's own strategies (what ``sp-bench mixers`` times), whatever is registered beside them."""
AUTO_ORDER = ("halo", "ulysses", "allgather")
"""What ``auto`` considers, first that can run the mixer wins: each moves fewer bytes than the
next at no more compute, or (ulysses against allgather) does 1/P of its compute."""
MIXER_CHOICES = ("auto", *MIXERS, "none")
"""What ``apply_sequence_parallel(mixer=...)``, ``--sp-mixer`` and ``sp_mixer`` take; ``none`` refuses hybrid models."""


def get_mixer(name: str, topo, module=None):
    """The strategy ``name`` for ``topo``; ``auto``: the first of `AUTO_ORDER` that can run
    ``module``. A named strategy that cannot run ``module`` raises ``ValueError`` with the reason."""
    if name not in MIXERS and name != "auto":
        raise ValueError(f"mixer must be 'auto', 'none' or one of {sorted(MIXERS)}, got {name!r}")
    if name == "auto":
        if module is None:
            return AllGatherMixer(topo)
        return next(s for s in (MIXERS[n](topo) for n in AUTO_ORDER) if s.check(module) is None)
    strategy = MIXERS[name](topo)
    why = strategy.check(module) if module is not None and hasattr(strategy, "check") else None
    if why:
        raise ValueError(why)
    return strategy
