"""What a backend is asked to do (:class:`AttnSpec`), what it costs (:class:`Estimate`),
and the machine figures costs are computed from (:class:`Profile`).

Kept below both the registry and the backends so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["AttnSpec", "Estimate", "Profile", "DEFAULT_PROFILE"]


@dataclass(frozen=True)
class AttnSpec:
    """One attention call, identical on every rank of the SP group."""

    batch: int
    seq_len: int
    """Global sequence length (all ranks together)."""
    local_seq_len: int
    """Tokens this rank holds: ``seq_len / sp_size``."""
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    softmax_scale: float
    layout: str
    cu_seqlens: tuple[int, ...] | None = None
    """Global document boundaries of a packed sequence (0, ..., seq_len), or None."""

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class Estimate:
    """A backend's predicted cost for one forward of one layer, per rank."""

    seconds: float
    peak_bytes: int
    """Activation memory the backend holds at its peak (inputs and output included)."""
    comm_bytes: int
    """Bytes this rank sends in the forward (what ``CommCounter.bytes_sent`` reports)."""


@dataclass(frozen=True)
class Profile:
    """Machine figures for cost estimates. ``sp-bench calibrate`` will measure one;
    the default is a rough CPU/gloo figure."""

    all_to_all_bandwidth: float = 2e9
    """Bytes per second a rank sends in an all-to-all."""
    collective_latency: float = 50e-6
    """Seconds of fixed cost per collective call."""
    attention_flops: float = 2e10
    """Attention FLOP/s of the local kernel."""


DEFAULT_PROFILE = Profile()
