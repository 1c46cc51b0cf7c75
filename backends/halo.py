"""Halo: for sliding-window layers, each rank receives only the keys its windows reach.

A query at position i sees the keys i - W < j <= i. So the only keys a rank lacks are
the W - 1 before each of its chunks, held by the ranks that own the preceding tokens
(several, when W exceeds a chunk; none for a chunk whose predecessor is local, as
under zigzag on the middle rank). Those ranges are fixed by the layout, P, the chunk
size and W (`halo_ranges`), so every rank knows what to send to whom without a
handshake: one point-to-point exchange of K/V forward, and the same tokens' dK/dV (fp32
accumulators) sent back to their owners in the backward. Bytes per rank are O(W),
independent of the sequence length. Under bidirectional blocks (Gemma 3's images) a chunk's
queries also see the rest of a block that starts in it or before it: those keys join its halo.
The received halo is kept for the backward (O(W) memory), so K/V are not sent twice. Documents of a packed sequence are masked
by the block plans; the halo itself is not trimmed to them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ulysses_sp import comm
from ulysses_sp.blocks import blocks_backward, blocks_forward, cached_plan, chunk_segments, first_writes
from ulysses_sp.kernels import accumulator_dtype, add_sink, sink_grad
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["HaloBackend", "halo_ranges", "local_positions"]

_KV_TAG, _GRAD_TAG = 0, 1


def _minus(intervals, holes):
    """``intervals`` with ``holes`` removed (half-open, sorted lists)."""
    out = []
    for a, b in intervals:
        for h0, h1 in holes:
            if h0 < b and h1 > a:
                if h0 > a:
                    out.append((a, h0))
                a = max(a, h1)
        if a < b:
            out.append((a, b))
    return out


def halo_ranges(table: list[list[int]], chunk: int, window: int, blocks=None) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """``ranges[(src, dst)]``: the global token ranges rank ``src`` sends to rank ``dst``
    (sorted), for ranks holding the chunks of ``table``, a window of ``window`` tokens and the
    bidirectional ``blocks`` (global ``(start, end)``)."""
    held = [sorted((c * chunk, (c + 1) * chunk) for c in chunks) for chunks in table]
    ranges = {}
    for dst, chunks in enumerate(held):
        wanted = [(max(0, a - window + 1), a) for a, _ in chunks if a > 0 and window > 1]
        wanted = sorted(wanted + [(b, d) for a, b in chunks for c, d in blocks or () if c < b < d])  # a block's keys after the chunk
        merged = []
        for a, b in wanted:
            if merged and a <= merged[-1][1]:
                merged[-1] = (merged[-1][0], max(b, merged[-1][1]))
            else:
                merged.append((a, b))
        missing = _minus(merged, chunks)
        for src, theirs in enumerate(held):
            if src != dst:
                got = [(max(a, c), min(b, d)) for a, b in missing for c, d in theirs if max(a, c) < min(b, d)]
                if got:
                    ranges[src, dst] = sorted(got)
    return ranges


@dataclass(frozen=True, eq=False)
class _Plan:
    sends: list
    """``(dst, local positions)`` of the tokens this rank sends to each peer."""
    recvs: list
    """``(src, tokens)`` this rank receives from each peer, in the order of the halo tensor."""
    own_calls: tuple
    halo_calls: tuple
    first: tuple
    """``blocks.first_writes`` of (own_calls, halo_calls)."""


def local_positions(table_row, chunk: int, ranges, device) -> torch.Tensor:
    """Local rows, on a rank holding the chunks ``table_row``, of the global token ``ranges``."""
    slot = {c: i for i, c in enumerate(table_row)}
    pos = [slot[g // chunk] * chunk + g % chunk for a, b in ranges for g in range(a, b)]
    return torch.tensor(pos, dtype=torch.long, device=device)


def _plan(q, spec: AttnSpec, topo) -> _Plan:
    table = spec.chunk_table(topo.sp_size)
    r = topo.sp_rank
    chunk = q.shape[1] // len(table[r])

    def make():
        ranges = halo_ranges(table, chunk, spec.window, spec.blocks)
        sends = [(dst, local_positions(table[r], chunk, rs, q.device)) for (src, dst), rs in sorted(ranges.items()) if src == r]
        incoming = sorted((src, rs) for (src, dst), rs in ranges.items() if dst == r)
        halo_segments = [(a, b - a) for _, rs in incoming for a, b in rs]
        own = chunk_segments(table[r], chunk)
        recvs = [(src, sum(b - a for a, b in rs)) for src, rs in incoming]
        own_calls, halo_calls = cached_plan(topo, own, own, spec, q.device), cached_plan(topo, own, halo_segments, spec, q.device)
        return _Plan(sends, recvs, own_calls, halo_calls, tuple(first_writes([own_calls, halo_calls])))

    return topo.cached(("halo", spec.layout, topo.sp_size, r, chunk, spec.causal, spec.window, spec.cu_seqlens, spec.blocks, spec.batch,
                                str(q.device)), make)


def _recv_like(t, n: int, dtype=None):
    return t.new_empty((t.shape[0], n, *t.shape[2:]), dtype=dtype)


class _HaloAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, group, plan, kernel, spec):
        sends = [(dst, t.index_select(1, idx)) for dst, idx in plan.sends for t in (k, v)]
        recvs = [(src, _recv_like(t, n)) for src, n in plan.recvs for t in (k, v)]
        received, wait = comm.exchange(sends, recvs, group, tag=_KV_TAG)
        acc = accumulator_dtype(q.dtype)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        try:
            blocks_forward(kernel, q, k, v, plan.own_calls, spec, out_acc, lse_acc, plan.first[0])  # while the halo is in flight
        finally:
            wait()
        k_halo, v_halo = (torch.cat(received[i::2], dim=1) if received else _recv_like(t, 0) for i, t in enumerate((k, v)))
        blocks_forward(kernel, q, k_halo, v_halo, plan.halo_calls, spec, out_acc, lse_acc, plan.first[1])
        if sinks is not None:
            out_acc, lse_acc = add_sink(out_acc, lse_acc, sinks)
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, k_halo, v_halo, out, lse_acc, sinks)
        ctx.args = (group, plan, kernel, spec)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, k_halo, v_halo, out, lse, sinks = ctx.saved_tensors
        group, plan, kernel, spec = ctx.args
        dsinks = sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        acc = accumulator_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk, dv, dk_halo, dv_halo = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (k, v, k_halo, v_halo))
        blocks_backward(kernel, dout, q, k_halo, v_halo, out, lse, plan.halo_calls, spec, dq, dk_halo, dv_halo)
        wait = None
        if need_k or need_v:  # the halo's gradients go back to the ranks that own those tokens
            sends, start = [], 0
            for src, n in plan.recvs:
                sends += [(src, dk_halo[:, start : start + n]), (src, dv_halo[:, start : start + n])]
                start += n
            recvs = [(dst, _recv_like(k, len(idx), acc)) for dst, idx in plan.sends for _ in range(2)]
            received, wait = comm.exchange(sends, recvs, group, tag=_GRAD_TAG)
        try:
            blocks_backward(kernel, dout, q, k, v, out, lse, plan.own_calls, spec, dq, dk, dv)
        finally:
            if wait is not None:
                wait()
        if wait is not None:
            for (_, idx), dk_part, dv_part in zip(plan.sends, received[0::2], received[1::2]):
                dk.index_add_(1, idx, dk_part)
                dv.index_add_(1, idx, dv_part)
        return (dq.to(q.dtype) if need_q else None), (dk.to(k.dtype) if need_k else None), (dv.to(v.dtype) if need_v else None), dsinks, None, None, None, None


class HaloBackend:
    name = "halo"
    takes_sinks = True

    def check(self, spec: AttnSpec, topo) -> str | None:
        if spec.window is None:
            return "halo: only for sliding-window layers (window=W); full attention uses ulysses, ring, allgather or hybrid"
        return None

    def _tokens(self, spec: AttnSpec, topo) -> tuple[int, int]:
        """(tokens this rank sends, tokens it receives)."""
        table = spec.chunk_table(topo.sp_size)
        ranges = halo_ranges(table, spec.local_seq_len // len(table[0]), spec.window, spec.blocks)
        count = {"sent": 0, "recv": 0}
        for (src, dst), rs in ranges.items():
            n = sum(b - a for a, b in rs)
            count["sent"] += n * (src == topo.sp_rank)
            count["recv"] += n * (dst == topo.sp_rank)
        return count["sent"], count["recv"]

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        sent, recv = self._tokens(spec, topo)
        token_bytes = 2 * spec.batch * spec.kv_heads * spec.head_dim * spec.element_size  # K and V of one token
        acc = spec.accumulator_ratio
        comm_bytes, bwd_bytes = sent * token_bytes, int(recv * token_bytes * acc)
        link = profile.link("p2p", topo.spans_nodes("sp"))
        transfer = link.seconds(max(comm_bytes, recv * token_bytes), 1) + link.seconds(max(bwd_bytes, int(sent * token_bytes * acc)), 1)
        imbalance = spec.work_imbalance(spec.chunk_table(topo.sp_size))
        chunk = spec.local_seq_len // spec.chunks_per_rank(topo.sp_size)
        efficiency = profile.efficiency(self.name, chunk)
        seconds = profile.overlapped(profile.attention_fwd_bwd_seconds(spec, topo.sp_size, efficiency) * imbalance, transfer, "p2p")
        q_bytes = spec.head_bytes * spec.q_heads
        peak = int(q_bytes * (2 + acc) + 2 * spec.head_bytes * spec.kv_heads + recv * token_bytes * (1 + acc))
        peak += spec.kernel_workspace_bytes(spec.q_heads, chunk, min(chunk + spec.window, spec.seq_len))
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=comm_bytes, bwd_comm_bytes=bwd_bytes, work_imbalance=imbalance,
                        kernel_efficiency=efficiency)

    def forward(self, q, k, v, spec: AttnSpec, topo, sinks=None) -> torch.Tensor:
        return _HaloAttention.apply(q, k, v, sinks, topo.sp_group, _plan(q, spec, topo), spec.kernel, spec)
