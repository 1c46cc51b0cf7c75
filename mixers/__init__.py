"""Sequence-parallel strategies for token mixers other than softmax attention (the Gated
DeltaNet, Mamba2 and short-convolution layers of hybrid models), one file per strategy, the
way :mod:`ulysses_sp.backends` holds attention's. A strategy runs one mixer call: it gets the
mixer's own forward and the call's arguments as this rank holds them (``[B, S_local, ...]``)
and returns this rank's rows of what one process would compute on the whole sequence.

``ulysses`` splits the mixer's heads across ranks where an adapter for its class exists;
``allgather`` is the universal fallback: exact for any mixer, at P times the mixer's compute.
``auto`` takes ulysses where it can, else allgather, per mixer.
"""

from __future__ import annotations

from ulysses_sp.mixers.allgather import AllGatherMixer
from ulysses_sp.mixers.ulysses import UlyssesMixer

__all__ = ["MIXERS", "MIXER_CHOICES", "AllGatherMixer", "UlyssesMixer", "get_mixer"]

MIXERS = {"allgather": AllGatherMixer, "ulysses": UlyssesMixer}
"""Mixer strategies by name."""
MIXER_CHOICES = ("auto", *MIXERS, "none")
"""What ``apply_sequence_parallel(mixer=...)``, ``--sp-mixer`` and ``sp_mixer`` take; ``none`` refuses hybrid models."""


def get_mixer(name: str, topo, module=None):
    """The strategy ``name`` for ``topo``; ``auto``: ulysses if it can run ``module``, else allgather.
    A named strategy that cannot run ``module`` raises ``ValueError`` with the reason."""
    if name not in MIXERS and name != "auto":
        raise ValueError(f"mixer must be 'auto', 'none' or one of {sorted(MIXERS)}, got {name!r}")
    if name == "auto":
        ulysses = UlyssesMixer(topo)
        return ulysses if module is not None and ulysses.check(module) is None else AllGatherMixer(topo)
    strategy = MIXERS[name](topo)
    why = strategy.check(module) if module is not None and hasattr(strategy, "check") else None
    if why:
        raise ValueError(why)
    return strategy
