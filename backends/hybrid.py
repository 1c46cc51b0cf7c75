"""Hybrid (USP / 2-D): Ulysses all-to-all inside each Ulysses sub-group, ring across them.

The SP group splits into ``ulysses_degree x ring_degree`` (``topo.hybrid_groups``:
``hybrid`` runs at the topology's degree, ``hybrid-u{U}`` at U): the
all-to-all turns the sequence shards of one Ulysses group into head shards of
that group's tokens, the ring passes K/V between Ulysses groups, and a second
all-to-all brings the output back. Heads need only divide by the Ulysses
degree, so it runs where P exceeds the head count. A degree of 1 on either
side reduces to the pure backend. Composed from ``comm`` and ``ring_pass``.
"""

from __future__ import annotations

import torch

from ulysses_sp import comm
from ulysses_sp.ring_pass import ring_attention, ring_hops, ring_plans
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["HybridBackend"]


def _group_chunks(spec: AttnSpec, topo, split) -> tuple[list[list[int]], list[list[int]]]:
    """(chunk tables of this rank's Ulysses group, sorted chunks of every ring rank's Ulysses group)."""
    table = spec.chunk_table(topo.sp_size)
    u = split.ulysses_degree
    groups = [table[j * u : (j + 1) * u] for j in range(split.ring_degree)]
    return groups[split.ring_rank], [sorted(c for rank in g for c in rank) for g in groups]


class HybridBackend:
    """``ulysses_degree``: None for the topology's (registered as ``hybrid``), else U
    (``hybrid-u{U}``, which ``get_backend`` makes for any U; ``check`` says whether it fits)."""

    takes_sinks = True

    def __init__(self, ulysses_degree: int | None = None):
        if ulysses_degree is not None and (isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1):
            raise ValueError(f"ulysses_degree must be a positive integer or None, got {ulysses_degree!r}")
        self.ulysses_degree = ulysses_degree
        self.name = "hybrid" if ulysses_degree is None else f"hybrid-u{ulysses_degree}"

    def groups(self, topo):
        """``topo.hybrid_groups`` at this backend's degree."""
        return topo.hybrid_groups(self.ulysses_degree or topo.ulysses_degree)

    def check(self, spec: AttnSpec, topo) -> str | None:
        try:
            u = self.groups(topo).ulysses_degree
        except ValueError as e:
            return f"{self.name}: {e}"
        problem = comm.head_scatter_problem(spec.q_heads, spec.kv_heads, u)
        if problem is None:
            return None
        p = topo.sp_size
        fits = [f"hybrid-u{d}" for d in range(2, p) if p % d == 0 and not comm.head_scatter_problem(spec.q_heads, spec.kv_heads, d)]
        return f"{self.name}: {problem}; " + (f"{' or '.join(fits)} fits these heads" if fits else "no hybrid degree fits these heads: ring or allgather")

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        split = self.groups(topo)
        u = split.ulysses_degree
        hkv = comm.kv_heads_sent(spec.kv_heads, u)
        a2a = comm.head_scatter_bytes(spec, u)
        kv_bytes = 2 * spec.head_bytes * hkv  # K/V of u ranks' tokens and hkv/u heads
        ring_chunks = _group_chunks(spec, topo, split)[1]
        hops = ring_hops(ring_chunks, spec.local_seq_len * u // len(ring_chunks[0]), spec)  # R - 1 without a window
        ring = kv_bytes * hops
        acc = spec.accumulator_ratio
        a2a_s = profile.link("all_to_all", topo.spans_nodes("ulysses", u)).seconds(2 * a2a, calls=4) if u > 1 else 0.0
        link = profile.link("p2p", topo.spans_nodes("ring", u))
        ring_bwd = ring + int(kv_bytes * acc * (hops + 1)) if hops else 0  # K/V again, and the dK/dV accumulators one hop more
        ring_s = link.seconds(ring, hops) + link.seconds(ring_bwd, 2 * hops + 1) if hops else 0.0
        peak = int(spec.head_bytes * (spec.q_heads * (3 + acc) + 2 * spec.kv_heads + 6 * hkv))
        group_len = spec.local_seq_len * u
        peak += spec.kernel_workspace_bytes(spec.q_heads // u, group_len, group_len)
        imbalance = spec.work_imbalance(ring_chunks)  # a ring rank does its Ulysses group's chunks' work
        efficiency = profile.efficiency(self.name, spec.query_run_tokens(ring_chunks))  # its group's chunks, joined where adjacent
        seconds = a2a_s + profile.overlapped(profile.attention_fwd_bwd_seconds(spec, topo.sp_size, efficiency) * imbalance, ring_s, "p2p")
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=a2a + ring, bwd_comm_bytes=a2a + ring_bwd, work_imbalance=imbalance,
                        kernel_efficiency=efficiency)

    def forward(self, q, k, v, spec: AttnSpec, topo, sinks=None) -> torch.Tensor:
        split = self.groups(topo)
        if sinks is not None:  # the q heads this rank's place in its Ulysses group receives
            sinks = sinks.view(split.ulysses_degree, -1)[split.ulysses_rank]
        mine, ring_chunks = _group_chunks(spec, topo, split)
        k, v = comm.replicate_kv_for_scatter(k, v, split.ulysses_degree)
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], split.ulysses_group, mine)
        plans = ring_plans(topo, ring_chunks, split.ring_rank, spec, q_h)
        out_h = ring_attention(q_h, k_h, v_h, split.ring_group, plans, kernel=spec.kernel, spec=spec, sinks=sinks)
        (out,) = comm.heads_to_seq([out_h], split.ulysses_group, mine)
        return out
