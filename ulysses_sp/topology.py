"""Process groups for sequence parallelism: world = dp x sp, sp = ulysses x ring.

Each SP group is a block of ``sp_size`` consecutive global ranks (so it stays
inside a node when ranks are numbered node by node). Inside an SP group the
Ulysses sub-groups are runs of ``ulysses_degree`` consecutive ranks and the ring
sub-groups take every ``ulysses_degree``-th rank: the all-to-all stays on the
fast links, the ring crosses the slow ones. The same split is also built for
every other proper divisor of ``sp_size`` (`Topology.hybrid_groups`), so
the hybrid backend can run at any Ulysses degree, chosen per layer.
"""

from __future__ import annotations

import atexit
import datetime
import numbers
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from . import comm
from .eager_ops import EagerCall
from .devices import local_world_size
from . import layout as _layout
from .profile import Profile, load_profile

__all__ = ["Topology", "HybridGroups", "init_sequence_parallel", "DEFAULT_TIMEOUT"]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class HybridGroups:
    """One Ulysses x ring split of the SP group (`Topology.hybrid_groups`); groups are
    None on a planning topology."""

    ulysses_group: dist.ProcessGroup | None
    """This rank's run of ``ulysses_degree`` consecutive SP ranks (head-scatter all-to-all)."""
    ulysses_rank: int
    ulysses_degree: int
    ring_group: dist.ProcessGroup | None
    """The SP ranks equal to this one modulo ``ulysses_degree`` (K/V ring)."""
    ring_rank: int
    ring_degree: int


@dataclass
class Topology:
    """Who talks to whom: this rank's place in the DP x SP grid and the process groups of each role.

    Built by `init_sequence_parallel` (or, without process groups, by `Topology.for_planning`).
    Every ``new_group`` call is made on every rank of the
    world in the same order: ``dp_size`` SP groups, ``sp_size`` DP groups and, for
    ``ulysses_degree`` and every other divisor 1 < U < P of P = ``sp_size``, ``dp_size x (P/U + U)``
    Ulysses and ring sub-groups. gloo connects each group's members when it is created (U - 1 +
    P/U - 1 peers per rank and degree: P = 8 adds 12 groups per SP group and 8 peers per rank,
    P = 64 adds 124 groups and 114 peers); NCCL creates a communicator at a group's first
    collective, so an unused degree costs only a Python object. On gloo, roles with the same
    ranks share one group (at the default degree the Ulysses group is the SP group).

    Attributes:
        rank: Global rank.
        world_size: Ranks in the default process group.
        sp_group: The ranks that share one sequence.
        sp_rank: This rank's index in ``sp_group``.
        sp_size: Ranks per SP group (P).
        dp_group: The ranks with the same ``sp_rank`` in every SP group: they see different data.
        dp_rank: Index of this rank's SP group among the DP groups.
        dp_size: Number of SP groups (``world_size / sp_size``).
        ulysses_group: Sub-group of the SP group doing the head-scatter all-to-all (hybrid backend).
        ulysses_rank: This rank's index in ``ulysses_group``.
        ulysses_degree: Ranks per Ulysses sub-group (U).
        ring_group: Sub-group of the SP group passing K/V around a ring (hybrid backend).
        ring_rank: This rank's index in ``ring_group``.
        ring_degree: Ranks per ring sub-group (``sp_size / ulysses_degree``).
        layout: Token layout of every sharded sequence: ``contiguous``, ``zigzag`` or ``balanced``
            (`ulysses_sp.layout`).
        device: Where tensors must live for this process group backend.
        timeout: Every collective on these groups fails after this long instead of hanging.
        ranks_per_node: Ranks on one machine (0: all of them); groups larger than this cross the
            slow links.
        shape_check: ``once``: ranks compare each call signature the first time they see it (one
            tiny all-gather per new shape). ``always``: compare on every call, which also catches
            a rank falling back to a shape it has already seen while the others have not.
        hybrid: The `HybridGroups` of every proper divisor of ``sp_size`` other than
            ``ulysses_degree`` (read them through `hybrid_groups`).
        verified_signatures: Call signatures already checked to agree across the SP group.
        profile: The `Profile` that ``auto`` estimates with (None: the
            built-in one for the device).
        cache: What is derived once per call signature and reused by every layer: block plans
            with their device tensors, all-gather index tensors, the last ``cu_seqlens`` read back.
        eager_attention: What a graph compiled around `sp_attention`
            calls (`ulysses_sp.eager_ops`); made here because torch.compile cannot make it
            inside the graph.
    """

    rank: int
    world_size: int
    sp_group: dist.ProcessGroup
    sp_rank: int
    sp_size: int
    dp_group: dist.ProcessGroup
    dp_rank: int
    dp_size: int
    ulysses_group: dist.ProcessGroup
    ulysses_rank: int
    ulysses_degree: int
    ring_group: dist.ProcessGroup
    ring_rank: int
    ring_degree: int
    layout: str
    device: torch.device
    timeout: datetime.timedelta
    ranks_per_node: int = 0
    shape_check: str = "once"
    hybrid: dict = field(default_factory=dict, repr=False, compare=False)
    verified_signatures: set = field(default_factory=set, repr=False, compare=False)
    profile: object = field(default=None, repr=False, compare=False)
    cache: dict = field(default_factory=dict, repr=False, compare=False)
    eager_attention: object = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        self.eager_attention = EagerCall(self._sp_attention)

    def _sp_attention(self, q, k, v, **options):
        return _ATTENTION["sp_attention"](q, k, v, self, **options)

    def cached(self, key, make):
        """``cache[key]``, made by ``make()`` the first time (the cache is cleared past 4096 entries)."""
        if key not in self.cache:
            if len(self.cache) > 4096:
                self.cache.clear()
            self.cache[key] = make()
        return self.cache[key]

    def hybrid_groups(self, ulysses_degree: int) -> HybridGroups:
        """The Ulysses and ring sub-groups of this rank at Ulysses degree ``ulysses_degree``.

        The topology's own groups at ``self.ulysses_degree``, else those built at init for every
        divisor 1 < U < ``sp_size``.

        Args:
            ulysses_degree: Ranks per Ulysses sub-group; must divide ``sp_size``.

        Returns:
            The sub-groups and this rank's place in them.

        Raises:
            ValueError: ``ulysses_degree`` does not divide ``sp_size``, or is 1 or ``sp_size`` (the
                ring and Ulysses backends) without being the topology's degree.
        """
        u = _check_degree("ulysses_degree", ulysses_degree, self.sp_size, "sp_size")
        if u == self.ulysses_degree:
            return HybridGroups(self.ulysses_group, self.ulysses_rank, u, self.ring_group, self.ring_rank, self.ring_degree)
        if u not in self.hybrid:
            raise ValueError(
                f"no hybrid groups at ulysses_degree {u} of sp_size {self.sp_size}: that split is the "
                f"{'ring' if u == 1 else 'ulysses'} backend; use it, or init_sequence_parallel(ulysses_degree={u})"
            )
        return self.hybrid[u]

    def spans_nodes(self, group: str, ulysses_degree: int | None = None) -> bool:
        """Whether a group crosses machines (blocks of ``ranks_per_node`` consecutive ranks).

        Args:
            group: ``sp``, ``ulysses`` or ``ring``.
            ulysses_degree: The degree of the ``ulysses`` and ``ring`` groups asked about
                (default: the topology's).

        Returns:
            True when the group holds ranks of more than one machine.
        """
        per_node = self.ranks_per_node or self.world_size
        u = self.ulysses_degree if ulysses_degree is None else ulysses_degree
        if group == "ulysses":
            return u > per_node
        if group == "ring":
            return self.sp_size // u > 1 and self.sp_size > per_node
        return self.sp_size > per_node

    @classmethod
    def for_planning(cls, sp_size: int, *, ulysses_degree: int | None = None, ranks_per_node: int = 0, layout: str = "zigzag",
                     profile: Profile | None = None) -> Topology:
        """A topology without process groups, for estimating and choosing backends offline.

        What ``sp-bench plan`` uses: everything but communication works (rank 0 of one SP group).

        Args:
            sp_size: Ranks sharing one sequence.
            ulysses_degree: The Ulysses degree (default: ``sp_size``); must divide ``sp_size``.
            ranks_per_node: Ranks on one machine (0: all of them).
            layout: ``contiguous``, ``zigzag`` or ``balanced``.
            profile: What ``auto`` estimates with (None: the built-in one).

        Returns:
            The planning topology, on the CPU.

        Raises:
            ValueError: A degree that is not a positive integer dividing ``sp_size``, or an
                unknown layout.
        """
        sp_size = _check_degree("sp_size", sp_size, sp_size, "sp_size")
        ulysses_degree = _check_degree("ulysses_degree", sp_size if ulysses_degree is None else ulysses_degree, sp_size, "sp_size")
        hybrid = {u: HybridGroups(None, 0, u, None, 0, sp_size // u) for u in _other_degrees(sp_size, ulysses_degree)}
        return cls(
            rank=0, world_size=sp_size, sp_group=None, sp_rank=0, sp_size=sp_size, dp_group=None, dp_rank=0, dp_size=1,
            ulysses_group=None, ulysses_rank=0, ulysses_degree=ulysses_degree, ring_group=None, ring_rank=0,
            ring_degree=sp_size // ulysses_degree, hybrid=hybrid, layout=_layout.check_layout(layout), device=torch.device("cpu"),
            timeout=DEFAULT_TIMEOUT, ranks_per_node=ranks_per_node, profile=profile,
        )


def _other_degrees(sp_size: int, ulysses_degree: int) -> list[int]:
    """The divisors 1 < U < sp_size other than ``ulysses_degree``, increasing."""
    return [u for u in range(2, sp_size) if sp_size % u == 0 and u != ulysses_degree]


def _split_lists(sp_lists: list[list[int]], u: int) -> tuple[list[list[int]], list[list[int]]]:
    """(Ulysses groups: runs of ``u`` consecutive ranks, ring groups: every ``u``-th rank) of every SP group."""
    sp_size = len(sp_lists[0])
    return ([block[i : i + u] for block in sp_lists for i in range(0, sp_size, u)],
            [block[j::u] for block in sp_lists for j in range(u)])


def _check_degree(name: str, value, total: int, total_name: str) -> int:
    if value is None or isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a positive integer dividing {total_name} ({total}), got {value!r}")
    value = int(value)
    if value <= 0 or total % value:
        divisors = [d for d in range(1, total + 1) if total % d == 0]
        raise ValueError(f"{name} must be a positive integer dividing {total_name} ({total}), got {value}; valid values: {divisors}")
    return value


def _as_timedelta(timeout) -> datetime.timedelta:
    if timeout is None:
        return DEFAULT_TIMEOUT
    if isinstance(timeout, datetime.timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, numbers.Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ValueError(f"timeout must be seconds or a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds} s")
    return datetime.timedelta(seconds=seconds)


def _device_for_backend() -> torch.device:
    backend = str(dist.get_backend()).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _my_group(rank_lists: list[list[int]], rank: int, timeout: datetime.timedelta, made: dict | None = None):
    """Create every group of ``rank_lists`` (collectively) and return this rank's one. ``made``
    (gloo) maps the rank lists already created to their groups, which are reused: gloo connects a
    group's members at creation and gives each group a thread that wakes every 10 ms, so the
    roles that coincide (the Ulysses group at ``ulysses_degree = sp_size`` is the SP group, the
    one-rank groups of each rank are one) share a group. NCCL creates communicators when first
    used, so there each role keeps its own group, and its own stream."""
    mine = None
    for ranks in rank_lists:
        key = tuple(ranks)
        if made is not None and key in made:
            group = made[key]
        else:
            group = dist.new_group(ranks, timeout=timeout)
            if made is not None:
                made[key] = group
        if rank in ranks:
            mine = group
    return mine


SHAPE_CHECKS = ("once", "always")


def _destroy_after_a_clean_exit() -> None:
    if dist.is_initialized() and getattr(sys, "last_exc", getattr(sys, "last_value", None)) is None:
        dist.destroy_process_group()


_ATTENTION: dict = {}
"""What `Topology.eager_attention` calls: `ulysses_sp.attention.sp_attention`, registered there on
import (the attention sits above the topology, which does not import it)."""


def register_attention(sp_attention) -> None:
    """Set the function `Topology.eager_attention` calls (``ulysses_sp.attention`` does, on import)."""
    _ATTENTION["sp_attention"] = sp_attention


def destroy_gloo_groups_at_exit() -> None:
    """Destroy every process group when the interpreter exits, unless it exits on an uncaught
    exception (other ranks may be in a collective) or they are destroyed already. Scripts that end
    without ``dist.destroy_process_group()``, as the Trainer, TRL and many DeepSpeed scripts do,
    otherwise leave gloo's worker threads to the interpreter's teardown, which aborts some runs
    after their work is done ("terminate called without an active exception": torch issue 190489,
    in a plain gloo ``all_reduce`` script too): a worker freeing a finished collective's tensors
    asks for the GIL while Python finalizes, Python ends that thread, and the unwinding through the
    C++ destructor terminates the process. Registered once however often it is called."""
    atexit.unregister(_destroy_after_a_clean_exit)
    atexit.register(_destroy_after_a_clean_exit)


def init_sequence_parallel(
    sp_size: int, *, ulysses_degree: int | None = None, layout: str = "zigzag", timeout: float | datetime.timedelta | None = None,
    shape_check: str = "once", profile: Profile | str | None = None, ranks_per_node: int | None = None,
) -> Topology:
    """Split the initialised default process group into DP x SP groups.

    Call on every rank, after ``torch.distributed.init_process_group`` (gloo or nccl), with the
    same arguments. Consecutive global ranks form an SP group, so it stays inside a node when
    ranks are numbered node by node. All arguments are checked, and compared across ranks (one
    small all-gather), before any group is created.

    Args:
        sp_size: Ranks that share one sequence; must divide the world size. The rest of the world
            is data parallel. 1 gives single-rank SP groups where attention runs locally.
        ulysses_degree: Ranks per Ulysses sub-group for the hybrid backend (default: ``sp_size``);
            must divide ``sp_size``. The ring degree is ``sp_size / ulysses_degree``.
        layout: How a sequence's tokens are laid across the SP ranks: ``zigzag`` (default),
            ``contiguous`` or ``balanced`` (`ulysses_sp.layout`).
        timeout: Seconds, or a ``datetime.timedelta``, after which a collective on these groups
            fails instead of hanging (default: 10 minutes).
        shape_check: ``once`` or ``always``: how often the SP ranks compare each attention call's
            shapes and options (see `Topology.shape_check`).
        profile: A `Profile` or the path of one written by
            ``sp-bench calibrate``, for ``auto`` (default: the built-in one for the device).
        ranks_per_node: Ranks on one machine (default: the launcher's ``LOCAL_WORLD_SIZE`` or
            ``LOCAL_SIZE``; 0: all of them).

    Returns:
        This rank's topology.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: On every rank, before any group is created: an ``sp_size`` that is not a
            positive integer dividing the world size, an ``ulysses_degree`` that does not divide
            ``sp_size``, an unknown layout or shape check, a timeout that is not positive, or
            arguments that differ between ranks.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "init_sequence_parallel needs torch.distributed to be initialised first: "
            "call torch.distributed.init_process_group('nccl' or 'gloo') (torchrun and deepspeed set the environment)"
        )
    world_size, rank = dist.get_world_size(), dist.get_rank()
    sp_size = _check_degree("sp_size", sp_size, world_size, "the world size")
    ulysses_degree = _check_degree("ulysses_degree", sp_size if ulysses_degree is None else ulysses_degree, sp_size, "sp_size")
    _layout.check_layout(layout)
    timeout = _as_timedelta(timeout)
    if shape_check not in SHAPE_CHECKS:
        raise ValueError(f"shape_check must be one of {SHAPE_CHECKS}, got {shape_check!r}")

    # Mismatched arguments would create mismatched groups and hang: compare first.
    args = (sp_size, ulysses_degree, _layout.LAYOUTS.index(layout), SHAPE_CHECKS.index(shape_check))
    everyone = comm.all_gather_ints(args, None, _device_for_backend())
    if any(a != args for a in everyone):
        shown = [(s, u, _layout.LAYOUTS[i], SHAPE_CHECKS[c]) for s, u, i, c in everyone]
        raise ValueError(
            f"init_sequence_parallel was called with different (sp_size, ulysses_degree, layout, shape_check) per rank: {shown}"
        )

    dp_size = world_size // sp_size
    ring_degree = sp_size // ulysses_degree
    sp_lists = [list(range(g * sp_size, (g + 1) * sp_size)) for g in range(dp_size)]
    dp_lists = [list(range(s, world_size, sp_size)) for s in range(sp_size)]
    ulysses_lists, ring_lists = _split_lists(sp_lists, ulysses_degree)

    sp_rank = rank % sp_size
    made = {} if "gloo" in str(dist.get_backend()).lower() else None
    if made is not None:
        destroy_gloo_groups_at_exit()
    sp_group = _my_group(sp_lists, rank, timeout, made)
    dp_group = _my_group(dp_lists, rank, timeout, made)
    ulysses_group = _my_group(ulysses_lists, rank, timeout, made)
    ring_group = _my_group(ring_lists, rank, timeout, made)
    hybrid = {}
    for u in _other_degrees(sp_size, ulysses_degree):  # the same order on every rank: new_group is collective
        u_lists, r_lists = _split_lists(sp_lists, u)
        hybrid[u] = HybridGroups(_my_group(u_lists, rank, timeout, made), sp_rank % u, u, _my_group(r_lists, rank, timeout, made),
                                 sp_rank // u, sp_size // u)
    return Topology(
        rank=rank,
        world_size=world_size,
        sp_group=sp_group,
        sp_rank=sp_rank,
        sp_size=sp_size,
        dp_group=dp_group,
        dp_rank=rank // sp_size,
        dp_size=dp_size,
        ulysses_group=ulysses_group,
        ulysses_rank=sp_rank % ulysses_degree,
        ulysses_degree=ulysses_degree,
        ring_group=ring_group,
        ring_rank=sp_rank // ulysses_degree,
        ring_degree=ring_degree,
        hybrid=hybrid,
        layout=layout,
        device=_device_for_backend(),
        timeout=timeout,
        shape_check=shape_check,
        ranks_per_node=int(ranks_per_node or local_world_size(default=0)),
        profile=load_profile(profile) if isinstance(profile, str) else profile,
    )
