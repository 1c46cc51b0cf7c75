"""Hybrid (USP / 2-D): Ulysses all-to-all inside each Ulysses sub-group, ring across them.

The topology splits the SP group into ``ulysses_degree x ring_degree``: the
all-to-all turns the sequence shards of one Ulysses group into head shards of
that group's tokens, the ring passes K/V between Ulysses groups, and a second
all-to-all brings the output back. Heads need only divide by the Ulysses
degree, so it runs where P exceeds the head count. A degree of 1 on either
side reduces to the pure backend. Composed from ``comm`` and ``ring_pass``.
"""

from __future__ import annotations

import torch

from ulysses_sp import comm, layout
from ulysses_sp.ring_pass import ring_attention, ring_plans
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["HybridBackend"]


def _group_chunks(spec: AttnSpec, topo) -> tuple[list[list[int]], list[list[int]]]:
    """(chunk tables of this rank's Ulysses group, sorted chunks of every ring rank's Ulysses group)."""
    table = layout.chunk_table(spec.layout, topo.sp_size)
    u = topo.ulysses_degree
    groups = [table[j * u : (j + 1) * u] for j in range(topo.ring_degree)]
    return groups[topo.ring_rank], [sorted(c for rank in g for c in rank) for g in groups]


class HybridBackend:
    name = "hybrid"

    def check(self, spec: AttnSpec, topo) -> str | None:
        problem = comm.head_scatter_problem(spec.q_heads, spec.kv_heads, topo.ulysses_degree)
        return f"hybrid: {problem}; pick another ulysses_degree in init_sequence_parallel" if problem else None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        u, r = topo.ulysses_degree, topo.ring_degree
        hkv = comm.kv_heads_sent(spec.kv_heads, u)
        a2a = comm.head_scatter_bytes(spec, u)
        kv_bytes = 2 * spec.head_bytes * hkv  # K/V of u ranks' tokens and hkv/u heads
        ring = kv_bytes * (r - 1)
        acc = spec.accumulator_ratio
        a2a_s = profile.link("all_to_all", topo.spans_nodes("ulysses")).seconds(2 * a2a, calls=4) if u > 1 else 0.0
        link = profile.link("p2p", topo.spans_nodes("ring"))
        ring_bwd = ring + int(kv_bytes * acc * r) if r > 1 else 0  # K/V again, and the dK/dV accumulators R hops
        ring_s = link.seconds(ring, r - 1) + link.seconds(ring_bwd, 2 * r - 1) if r > 1 else 0.0
        peak = int(spec.head_bytes * (spec.q_heads * (3 + acc) + 2 * spec.kv_heads + 6 * hkv))
        group_len = spec.local_seq_len * u
        peak += spec.kernel_workspace_bytes(spec.q_heads // u, group_len, group_len)
        seconds = a2a_s + profile.overlapped(profile.attention_fwd_bwd_seconds(spec, topo.sp_size), ring_s)
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=a2a + ring, bwd_comm_bytes=a2a + ring_bwd)

    def forward(self, q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
        mine, ring_chunks = _group_chunks(spec, topo)
        k, v = comm.replicate_kv_for_scatter(k, v, topo.ulysses_degree)
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], topo.ulysses_group, mine)
        plans = ring_plans(topo, ring_chunks, topo.ring_rank, spec, q_h)
        out_h = ring_attention(q_h, k_h, v_h, topo.ring_group, plans, kernel=spec.kernel, scale=spec.softmax_scale)
        (out,) = comm.heads_to_seq([out_h], topo.ulysses_group, mine)
        return out
