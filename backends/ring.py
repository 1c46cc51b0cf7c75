"""Ring: K/V pass around the SP group, one hop per step, overlapped with compute.

Queries stay put; P-1 hops of K and V; blocks a causal mask or a sliding window
hides are skipped (under the zigzag layout every rank then does the same work at
every step), and so are the hops no rank's window reaches (``ring_pass.ring_hops``).
Any head count works: nothing is split by heads. See ``ulysses_sp.ring_pass``.
"""

from __future__ import annotations

import torch

from ulysses_sp.ring_pass import ring_attention, ring_hops, ring_plans
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["RingBackend"]


class RingBackend:
    name = "ring"
    takes_sinks = True

    def check(self, spec: AttnSpec, topo) -> str | None:
        return None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        p = topo.sp_size
        table = spec.chunk_table(p)
        hops = ring_hops(table, spec.local_seq_len // len(table[0]), spec)
        kv_bytes = 2 * spec.head_bytes * spec.kv_heads
        acc = spec.accumulator_ratio
        comm_bytes = kv_bytes * hops
        link = profile.link("p2p", topo.spans_nodes("sp"))
        # forward: `hops` (P-1 without a window) of K/V; backward: those and hops + 1 of the fp32 dK/dV accumulators
        bwd_bytes = comm_bytes + int(kv_bytes * acc * (hops + 1)) if hops else 0
        transfer = link.seconds(comm_bytes, hops) + link.seconds(bwd_bytes, 2 * hops + 1) if hops else 0.0
        q_bytes = spec.head_bytes * spec.q_heads
        peak = int(q_bytes * (2 + acc) + 3 * kv_bytes)  # q, out, fp32 accumulator; own, in-flight and next K/V
        peak += spec.kernel_workspace_bytes(spec.q_heads, spec.local_seq_len, spec.local_seq_len)  # a query chunk, a key run
        imbalance = spec.work_imbalance(table)
        efficiency = profile.efficiency(self.name, spec.query_run_tokens(table))
        seconds = profile.overlapped(profile.attention_fwd_bwd_seconds(spec, p, efficiency) * imbalance, transfer, "p2p")
        return Estimate(seconds=seconds, peak_bytes=peak, comm_bytes=comm_bytes, bwd_comm_bytes=bwd_bytes, work_imbalance=imbalance,
                        kernel_efficiency=efficiency)

    def forward(self, q, k, v, spec: AttnSpec, topo, sinks=None) -> torch.Tensor:
        plans = ring_plans(topo, spec.chunk_table(topo.sp_size), topo.sp_rank, spec, q)
        return ring_attention(q, k, v, topo.sp_group, plans, kernel=spec.kernel, spec=spec, sinks=sinks)
