"""Backends by name, and the ``auto`` choice between them.

A backend is any object with the :class:`Backend` shape. The built-in ones
are registered when this module is imported; ``register_backend`` adds more.
"""

from __future__ import annotations

import dataclasses
from typing import Protocol, runtime_checkable

import torch

from ulysses_sp.backends.allgather import AllGatherBackend
from ulysses_sp.backends.hybrid import HybridBackend
from ulysses_sp.backends.ring import RingBackend
from ulysses_sp.backends.ulysses import UlyssesBackend
from ulysses_sp.profile import Profile, default_profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["Backend", "register_backend", "get_backend", "list_backends", "choose_backend"]


@runtime_checkable
class Backend(Protocol):
    name: str

    def check(self, spec: AttnSpec, topo) -> str | None:
        """None if the backend can run ``spec`` on ``topo``, else the reason it cannot."""

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        """Predicted per-rank cost of one forward."""

    def forward(self, q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
        """Differentiable attention of this rank's shards; returns this rank's output shard."""


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Make ``backend`` selectable by its ``name`` (and by ``auto``)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend needs name, check, estimate and forward; got {backend!r}")
    if backend.name == "auto":
        raise ValueError("'auto' is reserved for the automatic choice")
    if backend.name in _BACKENDS and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
    _BACKENDS[backend.name] = backend
    return backend


def list_backends() -> list[str]:
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown SP backend {name!r}; known: {', '.join(['auto', *_BACKENDS])}") from None


def choose_backend(spec: AttnSpec, topo, profile: Profile | None = None) -> tuple[Backend, dict[str, str | Estimate]]:
    """The cheapest feasible backend for ``spec``, and for every backend either
    its estimate or the reason it was dropped (``check()`` failed, or its peak
    memory exceeds the profile's budget).

    ``profile`` defaults to the topology's, else the built-in one for its device. The memory
    budget is the profile's, else what the CUDA device reports free (``torch.cuda.mem_get_info``).
    """
    profile = profile or getattr(topo, "profile", None) or default_profile(topo.device.type)
    budget = profile.memory_budget_bytes
    if budget is None and topo.device.type == "cuda":
        budget = torch.cuda.mem_get_info(topo.device)[0]
    considered: dict[str, str | Estimate] = {}
    for name, backend in _BACKENDS.items():
        reason = backend.check(spec, topo)
        if reason is None:
            estimate = backend.estimate(spec, topo, profile)
            overhead = profile.overhead_seconds(name, spec)
            if overhead:
                estimate = dataclasses.replace(estimate, seconds=estimate.seconds + overhead)
            if budget is not None and estimate.peak_bytes > budget:
                reason = f"{name}: needs about {estimate.peak_bytes / 2**20:.0f} MiB, over the memory budget of {budget / 2**20:.0f} MiB"
            else:
                reason = estimate
        considered[name] = reason
    feasible = {n: e for n, e in considered.items() if isinstance(e, Estimate)}
    if not feasible:
        reasons = "; ".join(f"{r}" for r in considered.values())
        raise ValueError(f"no SP backend can run this attention: {reasons}")
    best = min(feasible, key=lambda n: feasible[n].seconds)
    return _BACKENDS[best], considered


for _builtin in (UlyssesBackend(), AllGatherBackend(), RingBackend(), HybridBackend()):
    register_backend(_builtin)
