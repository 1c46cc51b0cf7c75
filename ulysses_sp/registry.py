"""Backends by name, and the ``auto`` choice between them.

A backend is any object with the `Backend` shape. The built-in ones
are registered when this module is imported; ``register_backend`` adds more.
``hybrid-u{U}`` names the hybrid backend at Ulysses degree U (made on first use,
any U; its ``check`` says whether U fits the topology and the heads); ``hybrid``
is the hybrid at the topology's own ``ulysses_degree``. ``ulysses-g{G}`` is Ulysses
pipelined over G head groups; ``ulysses`` takes G from the profile.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Protocol, runtime_checkable

import torch

from ulysses_sp.backends.allgather import AllGatherBackend
from ulysses_sp.backends.halo import HaloBackend
from ulysses_sp.backends.hybrid import HybridBackend
from ulysses_sp.backends.ring import RingBackend
from ulysses_sp.backends.ulysses import UlyssesBackend
from ulysses_sp.profile import Profile, profile_for
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["Backend", "register_backend", "get_backend", "list_backends", "candidates", "choose_backend", "problem"]


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
_HYBRID_NAME = re.compile(r"hybrid-u([1-9][0-9]*)")
_FAMILIES = {_HYBRID_NAME: HybridBackend, re.compile(r"ulysses-g([1-9][0-9]*)"): UlyssesBackend}
"""Backends named with a parameter, made on first use: name pattern -> class of that parameter."""
_MADE: dict[str, Backend] = {}


def _family_member(name: str) -> Backend | None:
    for pattern, make in _FAMILIES.items():
        match = pattern.fullmatch(name)
        if match:
            if name not in _MADE:
                _MADE[name] = make(int(match.group(1)))
            return _MADE[name]
    return None


def _hybrid(ulysses_degree: int) -> HybridBackend:
    return _family_member(f"hybrid-u{ulysses_degree}")


def register_backend(backend: Backend, *, replace: bool = False) -> Backend:
    """Make ``backend`` selectable by its ``name``, and a candidate of ``auto``.

    A backend is any object with a ``name`` and the methods of the ``Backend`` protocol
    (`ulysses_sp.registry.Backend`): ``check(spec, topo)`` (None, or why it cannot run),
    ``estimate(spec, topo, profile)`` (an `Estimate`) and ``forward(q, k, v, spec, topo)``.

    Args:
        backend: The backend to register.
        replace: Replace a backend registered under the same name.

    Returns:
        ``backend`` itself.

    Raises:
        TypeError: ``backend`` lacks ``name``, ``check``, ``estimate`` or ``forward``.
        ValueError: The name ``auto``, a name reserved for a built-in family (``hybrid-u{U}``,
            ``ulysses-g{G}``), or one already registered without ``replace=True``.
    """
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend needs name, check, estimate and forward; got {backend!r}")
    if backend.name == "auto":
        raise ValueError("'auto' is reserved for the automatic choice")
    if any(pattern.fullmatch(backend.name) for pattern in _FAMILIES):
        raise ValueError(f"{backend.name!r} is reserved for a built-in backend with that parameter")
    if backend.name in _BACKENDS and not replace:
        raise ValueError(f"backend {backend.name!r} is already registered; pass replace=True to override it")
    _BACKENDS[backend.name] = backend
    return backend


def list_backends() -> list[str]:
    """The names of the registered backends, the built-in ones first, in registration order.

    Returns:
        The names (without ``auto`` and the parametrised ``hybrid-u{U}`` and ``ulysses-g{G}``).
    """
    return list(_BACKENDS)


def get_backend(name: str) -> Backend:
    """The backend registered as ``name``, or a member of a built-in family.

    Args:
        name: A registered name, ``hybrid-u{U}`` (the hybrid at Ulysses degree U) or
            ``ulysses-g{G}`` (Ulysses pipelined over G head groups).

    Returns:
        The backend.

    Raises:
        ValueError: An unknown name (the message lists the known ones).
    """
    if name in _BACKENDS:
        return _BACKENDS[name]
    member = _family_member(name) if isinstance(name, str) else None
    if member is not None:
        return member
    raise ValueError(f"unknown SP backend {name!r}; known: {', '.join(['auto', *_BACKENDS])}, hybrid-u{{U}} (U: a Ulysses degree), "
                     "ulysses-g{G} (G: head groups)")


def problem(backend: Backend, spec: AttnSpec, topo) -> str | None:
    """``backend.check``, and for a call with learned sinks, whether the backend takes them
    (``takes_sinks = True``: its ``forward`` accepts ``sinks=``, as every built-in one does)."""
    if spec.sinks and not getattr(backend, "takes_sinks", False):
        return f"{backend.name}: does not take attention sinks (a backend sets takes_sinks = True when its forward accepts sinks=)"
    return backend.check(spec, topo)


def candidates(topo) -> dict[str, Backend]:
    """What ``auto`` weighs: every registered backend, with the built-in ``hybrid`` replaced
    by ``hybrid-u{U}`` for every divisor 1 < U < sp_size. ``hybrid`` runs at the topology's
    degree, which is one of those, or ring's split (U = 1) or Ulysses' (U = P), so it
    would only duplicate an entry."""
    out: dict[str, Backend] = {}
    for name, backend in _BACKENDS.items():
        if isinstance(backend, HybridBackend) and backend.ulysses_degree is None:
            p = topo.sp_size
            out.update((f"hybrid-u{u}", _hybrid(u)) for u in range(2, p) if p % u == 0)
        else:
            out[name] = backend
    return out


def choose_backend(spec: AttnSpec, topo, profile: Profile | None = None) -> tuple[Backend, dict[str, str | Estimate]]:
    """The cheapest feasible backend of `candidates` for ``spec``, and for every
    candidate either its estimate or the reason it was dropped (``check()`` failed, or
    its peak memory exceeds the profile's budget).

    ``profile`` defaults to the topology's, else the built-in one for its device and SP size. The memory
    budget is the profile's, else what the CUDA device reports free (``torch.cuda.mem_get_info``).
    """
    profile = profile_for(topo, profile)
    measured_on = profile.measured.get("world_size")
    if measured_on not in (None, topo.sp_size):
        warnings.warn(f"profile {profile.name!r} was measured on {measured_on} ranks and is used on {topo.sp_size}: its overheads "
                      f"are those of {measured_on} (none for a hybrid it could not run); sp-bench calibrate --nproc {topo.sp_size} "
                      "measures this size", stacklevel=2)
    budget = profile.memory_budget_bytes
    if budget is None and topo.device.type == "cuda":
        budget = torch.cuda.mem_get_info(topo.device)[0]
    considered: dict[str, str | Estimate] = {}
    backends = candidates(topo)
    for name, backend in backends.items():
        reason = problem(backend, spec, topo)
        if reason is None:
            estimate = backend.estimate(spec, topo, profile)
            hybrid_u = _HYBRID_NAME.fullmatch(name) and name not in profile.backend_overhead
            overhead = profile.overhead_seconds("hybrid" if hybrid_u else name, spec)  # an earlier calibrate's one figure
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
    return backends[best], considered


for _builtin in (UlyssesBackend(), AllGatherBackend(), RingBackend(), HybridBackend(), HaloBackend()):
    register_backend(_builtin)
