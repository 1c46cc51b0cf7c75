"""State passing for recurrent token mixers (linear attention, delta rules, state-space scans):
traffic that does not grow with the sequence.

Every token step of these mixers is affine in the recurrent state, so a fragment of the sequence
(one chunk of the layout) maps the state it enters with to the state it leaves with as
``S_out = A @ S_in + B``. Each rank summarises its fragments by running the family's own scan once
with the value columns widened by the state's key dimension (values ``[v | 0]``, initial state
``[0 | I]``: the final state is ``[B | A]``), all-gathers the summaries (a fixed size per fragment),
folds its predecessors' maps in global token order into each fragment's entry state, and runs the
family's scan from that state for its outputs. A document start inside a fragment cuts the map
(``A = 0``); the causal convolution before the scan gets the ``kernel - 1`` tokens before each
fragment (`halo_before`), zeroed before the fragment's document start. Autograd runs back through
the all-gathers (their backward reduce-scatters), so the gradient is the one-process one.

Each mixer class needs a state adapter (`register_state`, from ``ulysses_sp.models.adapters``)
that runs its forward on a `Fragments` plan.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from ulysses_sp import comm, layout
from ulysses_sp.mixers.common import parameter_count, refuse_unsupported
from ulysses_sp.mixers.halo import REACH, HaloMixer
from ulysses_sp.spec import MixerEstimate

__all__ = ["NOT_PASSED", "STATE_ADAPTERS", "StateAdapter", "StateMixer", "Fragments", "register_state"]


@dataclasses.dataclass(frozen=True)
class StateAdapter:
    run: Callable
    """``run(module, hidden_states, fragments) -> output``: the mixer's forward on this rank's rows (or
    ``(output, final state)`` for a class whose forward returns both)."""
    summary_bytes: Callable
    """``summary_bytes(module, itemsize) -> int``: one fragment's summary ``[B | A]`` per sequence."""
    halo_bytes: Callable
    """``halo_bytes(module, itemsize) -> int``: the convolution inputs one fragment sends before it, per sequence."""


STATE_ADAPTERS: dict[str, StateAdapter] = {}
"""State adapters by mixer class name."""
NOT_PASSED = {
    "RwkvSelfAttention": "RWKV-4 keeps its WKV state as numerator, denominator and a running maximum exponent, affine only in exp "
                         "space, which a summary [B | A] in the model's dtype cannot hold without overflow (a log-space fold is not built)",
    "RwkvFeedForward": "RWKV's feed-forward mixes only through its one-token shift, which halo or allgather run",
}
"""Why ``state`` refuses these mixer classes."""


def register_state(names, adapter: StateAdapter) -> None:
    """Register ``adapter`` for the mixer classes named ``names``."""
    for name in names:
        STATE_ADAPTERS[name] = adapter


@dataclasses.dataclass(frozen=True)
class Fragments:
    """This rank's chunks of the layout as fragments of the global row, and their documents."""

    topo: object
    chunk: int
    """Tokens per chunk."""
    table: list
    """The layout's chunk table: ``table[r]`` the global chunk ids rank r holds, in local order."""
    mine: tuple
    """This rank's chunk ids, in local order (chunk ``mine[i]`` is local rows ``[i chunk, (i+1) chunk)``)."""
    bounds: tuple
    """Global document boundaries ``(0, ..., S)``."""
    gathered: list = dataclasses.field(default_factory=list)
    """What this call all-gathered (`joined` ties each into the output)."""

    @classmethod
    def of(cls, topo, seq_local: int, cu_seqlens) -> Fragments:
        seq = seq_local * topo.sp_size
        bounds = layout.document_bounds(cu_seqlens, seq)
        table = layout.chunk_table(topo.layout, topo.sp_size, seq, bounds)
        mine = tuple(table[topo.sp_rank])
        return cls(topo, seq_local // len(mine), table, mine, bounds)

    def segments(self, i: int) -> list[tuple[int, int, bool]]:
        """Local fragment ``i``'s document segments as local rows ``(start, end, continues)``:
        ``continues`` for a first segment whose document began before the fragment."""
        start = self.mine[i] * self.chunk
        cuts = sorted({start, start + self.chunk, *(b for b in self.bounds if start < b < start + self.chunk)})
        return [(a - start + i * self.chunk, b - start + i * self.chunk, a == start and a not in self.bounds)
                for a, b in zip(cuts, cuts[1:])]

    def document_start(self, i: int) -> int:
        """The global start of the document local fragment ``i`` begins in."""
        start = self.mine[i] * self.chunk
        return max(b for b in self.bounds if b <= start)

    def halo_before(self, x_bsc: torch.Tensor, reach: int) -> list[torch.Tensor]:
        """For each local fragment, the ``reach`` tokens of ``x_bsc`` (``[B, S_local, C]``, this rank's
        rows) just before it in the global row, zeros before its document's start or the row's. One
        all-gather of every fragment's last ``min(chunk, reach)`` rows; differentiable."""
        tail = min(self.chunk, reach)
        n = len(self.mine)
        tails = torch.cat([x_bsc[:, (i + 1) * self.chunk - tail:(i + 1) * self.chunk] for i in range(n)], dim=1)
        every = self._gathered(tails, dim=1)
        by_chunk = {c: every[:, (r * n + i) * tail:(r * n + i + 1) * tail] for r, ids in enumerate(self.table) for i, c in enumerate(ids)}
        zeros = x_bsc.new_zeros(x_bsc.shape[0], tail, x_bsc.shape[2])
        out = []
        for i, c in enumerate(self.mine):
            before = [by_chunk.get(c - j, zeros) for j in range(math.ceil(reach / tail), 0, -1)]
            halo = torch.cat(before, dim=1)[:, -reach:]
            cut = reach - min(reach, c * self.chunk - self.document_start(i))  # the halo's rows before the document start
            out.append(torch.cat([torch.zeros_like(halo[:, :cut]), halo[:, cut:]], dim=1) if cut else halo)
        return out

    def entry_states(self, summaries: list[torch.Tensor], value_dim: int) -> list[torch.Tensor]:
        """Each local fragment's entry state ``[B, H, K, V]`` from every fragment's summary
        ``[B, H, K, V + K]`` (``[B | A]``; this rank's in ``summaries``, local order): one all-gather,
        then the maps folded in global token order, ``S = A @ S + B``."""
        mine = torch.stack(summaries)
        every = self._gathered(mine, dim=0)
        n = len(self.mine)
        by_chunk = {c: every[r * n + i] for r, ids in enumerate(self.table) for i, c in enumerate(ids)}
        state = torch.zeros_like(mine[0][..., :value_dim])
        entries = {}
        for c in range(len(by_chunk)):
            entries[c] = state
            bias, transition = by_chunk[c][..., :value_dim], by_chunk[c][..., value_dim:]
            state = transition @ state + bias
        return [entries[c] for c in self.mine]

    def run(self, mixed: torch.Tensor, reach: int, conv: Callable, scan: Callable, heads: int, key_dim: int, value_dim: int) -> torch.Tensor:
        """A convolution-then-delta-rule mixer on this rank's fragments: ``mixed`` ``[B, S_local, C]``
        (the convolution's input), ``conv(x)`` the causal convolution of ``[B, L, C]`` rows (None:
        none, ``mixed`` goes to the scan as it is),
        ``scan(x, start, end, initial_state, widen)`` the family's scan of the convolved rows
        ``x`` = local rows ``start:end`` of one document (``widen``: values ``[v | 0]``, returning the
        final state ``[B, heads, key_dim, value_dim + key_dim]``; else the output). Returns the
        scan's output on every local row."""
        halos = self.halo_before(mixed, reach) if conv is not None else None
        convolved = []
        for i in range(len(self.mine)):
            segments = []
            for start, end, continues in self.segments(i):  # a document's convolution, with the rows before the fragment where it began there
                if conv is None:
                    segments.append((start, end, continues, mixed[:, start:end]))
                    continue
                x = torch.cat([halos[i], mixed[:, start:end]], dim=1) if continues else mixed[:, start:end]
                segments.append((start, end, continues, conv(x)[:, -(end - start):]))
            convolved.append(segments)
        eye = torch.eye(key_dim, dtype=mixed.dtype, device=mixed.device).expand(mixed.shape[0], heads, key_dim, key_dim)
        summaries = []
        for segments in convolved:  # the fragment's map of its entry state: through it, or from its last document's start (A = 0)
            start, end, continues, x = segments[-1]
            through = eye if continues and len(segments) == 1 else torch.zeros_like(eye)
            summaries.append(scan(x, start, end, torch.cat([eye.new_zeros(*eye.shape[:3], value_dim), through], dim=-1), True))
        entries = self.entry_states(summaries, value_dim)
        return torch.cat([scan(x, start, end, entry if continues else None, False)
                          for entry, segments in zip(entries, convolved) for start, end, continues, x in segments], dim=1)

    def _gathered(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        if self.topo.sp_size == 1:
            return x
        every = comm.all_gather(x, self.topo.sp_group, dim=dim)
        self.gathered.append(every)
        return every

    def joined(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` tied to every all-gather of the call, so each rank's backward runs each gather's
        reduce-scatter: a rank whose fragments need no predecessor (the first under the contiguous
        layout) would otherwise skip them while the others wait in them."""
        return _Tie.apply(out, *self.gathered) if self.gathered else out


class _Tie(torch.autograd.Function):
    """``out`` unchanged; its backward gives ``out`` its gradient and each tied tensor zeros, which
    makes autograd run the tied tensors' backward on every rank."""

    @staticmethod
    def forward(ctx, out, *tied):
        ctx.tied = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, *(torch.zeros(shape, dtype=dtype, device=device) for shape, dtype, device in ctx.tied)


class StateMixer:
    """State passing; a short convolution used alone (LFM2's), whose state is its last ``kernel - 1``
    inputs, runs as the halo strategy runs it (`ulysses_sp.mixers.halo`)."""

    name = "state"

    def __init__(self, topo):
        self.topo = topo

    def _halo(self, module):
        name = type(module).__name__
        return HaloMixer(self.topo) if name not in STATE_ADAPTERS and name in REACH else None

    def check(self, module) -> str | None:
        """None if a state adapter (or a halo reach) exists for ``module``'s class, else why not."""
        if type(module).__name__ in NOT_PASSED:
            return f"state: not for {type(module).__name__}: {NOT_PASSED[type(module).__name__]}; mixer='auto' takes another strategy there"
        if type(module).__name__ not in STATE_ADAPTERS and self._halo(module) is None:
            return (f"state: no state adapter for {type(module).__name__} (there are for {', '.join(sorted(STATE_ADAPTERS)) or 'none'}, "
                    "and the short convolutions with a halo reach); mixer='auto' takes another strategy there")
        return None

    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """Its share of the compute: 1/P of the mixer's, and the scan again, widened, for the summaries
        (counted as 4 FLOPs per summary element and token, against 2 per parameter and token for the
        rest); the summaries and convolution halos of every fragment, gathered, each way."""
        if halo := self._halo(module):
            return halo.estimate(module, batch, seq_local, hidden, itemsize)
        adapter, p = STATE_ADAPTERS[type(module).__name__], self.topo.sp_size
        fragments = len(layout.chunk_table(self.topo.layout, p, seq_local * p)[0])
        per_fragment = adapter.summary_bytes(module, itemsize) + adapter.halo_bytes(module, itemsize)
        moved = (p - 1) * fragments * batch * per_fragment
        elements = adapter.summary_bytes(module, 4) // 4
        return MixerEstimate((1 + 4 * elements / (2 * parameter_count(module))) / p, moved, moved)

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        if halo := self._halo(module):
            return halo(module, forward, args, kwargs, batch, seq_local, cu_seqlens)
        refuse_unsupported(module, kwargs, self.name)
        hidden = args[0] if args else kwargs.get("hidden_states")
        fragments = Fragments.of(self.topo, seq_local, cu_seqlens)
        out = STATE_ADAPTERS[type(module).__name__].run(module, hidden, fragments)
        if isinstance(out, tuple):  # (output, final state): MiniMax's
            return (fragments.joined(out[0]), *out[1:])
        return fragments.joined(out)
