"""Sequence-parallel strategies for token mixers other than softmax attention (the Gated
DeltaNet, Mamba2 and short-convolution layers of hybrid models), one file per strategy, the
way :mod:`ulysses_sp.backends` holds attention's. A strategy runs one mixer call: it gets the
mixer's own forward and the call's arguments as this rank holds them (``[B, S_local, ...]``)
and returns this rank's rows of what one process would compute on the whole sequence.

``allgather`` is the universal fallback: exact for any mixer, at P times the mixer's compute.
"""

from __future__ import annotations

from ulysses_sp.mixers.allgather import AllGatherMixer

__all__ = ["MIXERS", "MIXER_CHOICES", "AllGatherMixer", "get_mixer"]

MIXERS = {"allgather": AllGatherMixer}
"""Mixer strategies by name; ``auto`` picks among them (only ``allgather`` so far)."""
MIXER_CHOICES = ("auto", *MIXERS, "none")
"""What ``apply_sequence_parallel(mixer=...)``, ``--sp-mixer`` and ``sp_mixer`` take; ``none`` refuses hybrid models."""


def get_mixer(name: str, topo):
    """The strategy ``name`` (or ``auto``) for ``topo``."""
    if name == "auto":
        name = "allgather"
    if name not in MIXERS:
        raise ValueError(f"mixer must be 'auto', 'none' or one of {sorted(MIXERS)}, got {name!r}")
    return MIXERS[name](topo)
