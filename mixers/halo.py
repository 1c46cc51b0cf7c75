"""Halo for short convolutions used alone (LFM2's conv layers): a mixer whose output at a token
depends only on that token and the ``reach`` tokens before it (per-token projections around a
causal convolution of kernel ``reach + 1``) needs, for each of this rank's chunks, only the
``reach`` tokens before the chunk. Those are fixed by the layout (zigzag chunks have two
neighbours; a predecessor already held here is not sent), so every rank knows what to send to
whom: one point-to-point exchange of the mixer's input forward, its gradient sent back in the
backward. The mixer's own forward then runs on each chunk with its halo in front, document by
document when the batch is packed (no window crosses a document boundary), and the halo's rows
are dropped. Bytes per rank: O(reach), independent of the sequence length; compute: the chunk
plus ``reach`` rows. Each mixer class needs its reach registered (`register_reach`, called
by the model integrations in ``ulysses_sp.integrations``), since only its code says how far it looks back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from ulysses_sp import comm, layout
from ulysses_sp.backends.halo import halo_ranges, local_positions
from ulysses_sp.mixers.common import refuse_unsupported
from ulysses_sp.spec import MixerEstimate

__all__ = ["REACH", "HaloMixer", "halo_plan", "register_reach"]

REACH: dict[str, Callable] = {}
"""``reach(module) -> int`` by mixer class name: how many tokens before its own each output sees."""

_INPUT_TAG, _GRAD_TAG = 2, 3


def register_reach(names, reach: Callable) -> None:
    """Register ``reach(module) -> int`` for the mixer classes named ``names``."""
    for name in names:
        REACH[name] = reach


@dataclass(frozen=True, eq=False)
class _Plan:
    sends: list
    """``(dst, local rows)`` this rank sends to each peer."""
    recvs: list
    """``(src, tokens)`` this rank receives from each peer, in the order of the received tensor."""
    chunks: list
    """Per local chunk: ``(rows, lo, start)``: rows of cat(local, received) holding global tokens
    ``[lo, end)`` in order, where ``[start, end)`` is the chunk itself."""


def _plan(table: list[list[int]], rank: int, chunk: int, reach: int, device) -> _Plan:
    ranges = halo_ranges(table, chunk, reach + 1)
    slot = {c: i for i, c in enumerate(table[rank])}
    sends = [(dst, local_positions(table[rank], chunk, rs, device)) for (src, dst), rs in sorted(ranges.items()) if src == rank]
    incoming = sorted((src, rs) for (src, dst), rs in ranges.items() if dst == rank)
    where = {}  # global token -> row of cat(local, received)
    for c in table[rank]:
        where.update((g, slot[c] * chunk + g % chunk) for g in range(c * chunk, (c + 1) * chunk))
    row = len(table[rank]) * chunk
    for _, rs in incoming:
        for a, b in rs:
            for g in range(a, b):
                where[g], row = row, row + 1
    chunks = []
    for c in table[rank]:
        start, end = c * chunk, (c + 1) * chunk
        lo = max(0, start - reach)
        chunks.append((torch.tensor([where[g] for g in range(lo, end)], dtype=torch.long, device=device), lo, start))
    return _Plan(sends, [(src, sum(b - a for a, b in rs)) for src, rs in incoming], chunks)


class _Exchange(torch.autograd.Function):
    """The halo rows in, their gradients back to the ranks that own them."""

    @staticmethod
    def forward(ctx, x, group, plan):
        sends = [(dst, x.index_select(1, rows)) for dst, rows in plan.sends]
        recvs = [(src, x.new_empty(x.shape[0], n, *x.shape[2:])) for src, n in plan.recvs]
        received, wait = comm.exchange(sends, recvs, group, tag=_INPUT_TAG)
        wait()
        ctx.group, ctx.plan, ctx.shape = group, plan, x.shape
        return torch.cat(received, dim=1) if received else x.new_empty(x.shape[0], 0, *x.shape[2:])

    @staticmethod
    def backward(ctx, grad):
        plan, start, sends = ctx.plan, 0, []
        for src, n in plan.recvs:
            sends.append((src, grad[:, start : start + n]))
            start += n
        recvs = [(dst, grad.new_empty(grad.shape[0], len(rows), *grad.shape[2:])) for dst, rows in plan.sends]
        received, wait = comm.exchange(sends, recvs, ctx.group, tag=_GRAD_TAG)
        wait()
        dx = grad.new_zeros(ctx.shape)
        for (_, rows), part in zip(plan.sends, received):
            dx.index_add_(1, rows, part)
        return dx, None, None


class HaloMixer:
    name = "halo"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        """None if this strategy can run ``module``, else why not."""
        if module is not None and type(module).__name__ not in REACH:
            return (f"halo: no reach registered for {type(module).__name__} (there are for {', '.join(sorted(REACH)) or 'none'}); "
                    "mixer='auto' takes another strategy there")
        return None


    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """The slowest rank's: its rows plus the halos its chunks run with; the halo rows of
        ``[batch, seq_local, hidden]`` it sends forward, and the gradients it sends back."""
        p, reach = self.topo.sp_size, REACH[type(module).__name__](module)
        table = layout.chunk_table(self.topo.layout, p, seq_local * p)
        plans = [_plan(table, r, seq_local // len(table[r]), reach, "cpu") for r in range(p)]
        per_token = batch * hidden * itemsize
        return MixerEstimate(max(sum(len(rows) for rows, _, _ in plan.chunks) for plan in plans) / (p * seq_local),
                             max(sum(len(rows) for _, rows in plan.sends) for plan in plans) * per_token,
                             max(sum(n for _, n in plan.recvs) for plan in plans) * per_token)

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        refuse_unsupported(module, kwargs, self.name)
        x = args[0] if args else kwargs["hidden_states"]
        kwargs = {k: v for k, v in kwargs.items() if k != "hidden_states" and not isinstance(v, torch.Tensor)}  # mask, packing: handled here
        bounds = layout.document_bounds(cu_seqlens, seq_local * self.topo.sp_size)
        plan = halo_plan(self.topo, seq_local, bounds, REACH[type(module).__name__](module), x.device)
        source = torch.cat([x, _Exchange.apply(x, self.topo.sp_group, plan)], dim=1) if self.topo.sp_size > 1 else x
        outs = []
        for rows, lo, start in plan.chunks:
            ext = source.index_select(1, rows)
            for s0, s1 in _runs(lo, start, lo + len(rows), bounds):
                out = forward(ext[:, s0 - lo : s1 - lo], **kwargs)
                outs.append(out[:, max(s0, start) - s0 :])
        out = torch.cat(outs, dim=1)
        # as many calls on every rank, whatever its documents: ZeRO-3 gathers the mixer's weights at each call (a
        # collective, forward and backward); the extra ones run on one token and join the output times 0
        for _ in range(self._most_runs(module, seq_local, bounds) - len(outs)):
            out = out + forward(source[:, :1], **kwargs).sum() * 0
        return out

    def _most_runs(self, module, seq_local: int, bounds) -> int:
        """The most calls any rank makes of the mixer (one a document piece of each of its chunks)."""
        p, reach = self.topo.sp_size, REACH[type(module).__name__](module)
        table = layout.chunk_table(self.topo.layout, p, seq_local * p, bounds)
        chunk = seq_local // len(table[0])
        return self.topo.cached(("halo-most-runs", tuple(map(tuple, table)), chunk, reach, tuple(bounds)), lambda: max(
            sum(len(_runs(max(0, c * chunk - reach), c * chunk, (c + 1) * chunk, bounds)) for c in row) for row in table))


def halo_plan(topo, seq_local: int, bounds, reach: int, device) -> _Plan:
    """This rank's exchange and chunks for a mixer reaching ``reach`` tokens back (cached on ``topo``)."""
    p, rank = topo.sp_size, topo.sp_rank
    table = layout.chunk_table(topo.layout, p, seq_local * p, bounds)
    chunk = seq_local // len(table[rank])
    return topo.cached(("halo-mixer", tuple(map(tuple, table)), rank, chunk, reach, str(device)), lambda: _plan(table, rank, chunk, reach, device))


def _runs(lo: int, start: int, end: int, bounds) -> list[tuple[int, int]]:
    """The pieces ``[s0, s1)`` of a chunk ``[start, end)`` after its halo from ``lo``, one a document (no window crosses a
    boundary), that hold some of the chunk."""
    cuts = sorted({lo, end, *(b for b in bounds if lo < b < end)})
    return [(s0, s1) for s0, s1 in zip(cuts, cuts[1:]) if s1 > start]
