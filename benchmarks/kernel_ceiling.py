"""Where Ulysses' scaling efficiency goes, in paired rounds inside one group of P spawned
ranks (one thread each). Each round runs, the order rotating:

- ``T1``: causal attention fwd+bwd on the whole sequence with all H heads, on rank 0 alone
  (the other ranks wait at the next barrier);
- ``kernel``: every rank at once runs the same attention with H/P of the heads, and nothing
  else: the ceiling, T1 / (P x kernel), that no SP backend can pass on this machine (shared
  caches and memory bandwidth, the other cores no longer idle);
- ``kernel, synced``: the same, with the ranks meeting at a barrier after the forward and
  after the backward, as Ulysses' all-to-alls make them meet: what waiting for the slowest
  rank at each meeting costs;
- ``all-to-alls``: Ulysses' all-to-alls of a step (q, k, v and out forward, their gradients
  backward: the same calls and bytes) around an identity in place of the attention;
- ``transfers``: the same four all-to-all calls on preallocated buffers, nothing else: what
  any Ulysses (DeepSpeed's too, which sends the same bytes) pays on this process group;
- ``ulysses``: the backend itself.

Per round the slowest rank's seconds; reported: medians, and medians of the rounds' ratios.

    python benchmarks/kernel_ceiling.py --nproc 2 --seq 4k --heads 8 --rounds 9 --json FILE
"""

from __future__ import annotations

import json
import statistics
import time

import click
import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp import comm, kernels, layout
from ulysses_sp.cli.calibrate import rotated
from ulysses_sp.cli.plan import parse_tokens
from ulysses_sp.launch import run_ranks

WAYS = ("T1", "kernel", "kernel, synced", "all-to-alls", "transfers", "ulysses")


class _Identity(torch.autograd.Function):
    """out = q; dq = dk = dv = dout: attention's inputs and outputs, with no attention."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q.clone()

    @staticmethod
    def backward(ctx, dout):
        return dout, dout, dout


def _rank(rank, world, seq, heads, rounds):
    topo = usp.init_sequence_parallel(world, layout="zigzag")
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(1, seq, heads, 64, generator=gen) for _ in range(4)]  # q, k, v, dout
    shards = [usp.shard_sequence(t, topo) for t in full]
    mine = slice(rank * heads // world, (rank + 1) * heads // world)
    head_shard = [t[:, :, mine].contiguous() for t in full]
    attention = usp.SequenceParallelAttention(topo, backend="ulysses")

    table = layout.chunk_table("zigzag", world)

    def all_to_alls(q, k, v):  # backends/ulysses.py's calls at G = 1
        q_h, k_h, v_h = comm.seq_to_heads([q, k, v], topo.sp_group, table)
        return comm.heads_to_seq([_Identity.apply(q_h, k_h, v_h)], topo.sp_group, table)[0]

    def attend(q, k, v):
        return kernels.local_attention(q, k, v, causal=True)

    steps = {  # way -> (inputs, dout, fn, meet after forward and backward)
        "T1": (full[:3], full[3], attend, False),
        "kernel": (head_shard[:3], head_shard[3], attend, False),
        "kernel, synced": (head_shard[:3], head_shard[3], attend, True),
        "all-to-alls": (shards[:3], shards[3], all_to_alls, False),
        "ulysses": (shards[:3], shards[3], lambda q, k, v: attention(q, k, v, causal=True), False),
    }
    n = shards[0].numel()
    buffers = [(torch.empty(m * n), torch.empty(m * n)) for m in (3, 1, 1, 3)]  # q, k, v; out; dout; dq, dk, dv

    def run(way):
        if way == "transfers":
            dist.barrier()
            t0 = time.perf_counter()
            for recv, send in buffers:
                dist.all_to_all_single(recv, send)
            return time.perf_counter() - t0
        inputs, dout, fn, synced = steps[way]
        leaves = [t.clone().requires_grad_() for t in inputs]
        dist.barrier()
        if way == "T1" and rank != 0:
            return 0.0
        t0 = time.perf_counter()
        out = fn(*leaves)
        if synced:
            dist.barrier()
        out.backward(dout)
        if synced:
            dist.barrier()
        return time.perf_counter() - t0

    for way in WAYS:  # warmup
        run(way)
    times = {way: [] for way in WAYS}
    for r in range(rounds):
        for way in rotated(list(WAYS), r):
            times[way].append(run(way))
    return times


@click.command()
@click.option("--nproc", default=2, show_default=True)
@click.option("--seq", default="4k", show_default=True, help="comma list")
@click.option("--heads", default=8, show_default=True)
@click.option("--rounds", type=click.IntRange(min=1), default=9, show_default=True)
@click.option("--json", "json_path", type=click.Path(dir_okay=False))
def main(nproc, seq, heads, rounds, json_path):
    results = []
    for s in (parse_tokens(x) for x in seq.split(",")):
        per_rank = run_ranks(_rank, nproc, s, heads, rounds, timeout=3600, threads_per_rank=1)
        slowest = {way: [max(r[way][i] for r in per_rank) for i in range(rounds)] for way in WAYS}
        t1, kernel, synced, comm, transfers, ulysses = (slowest[w] for w in WAYS)

        def paired(f):
            return statistics.median(f(*xs) for xs in zip(t1, kernel, synced, comm, transfers, ulysses))

        figures = {
            "seq": s, "heads": heads, "world": nproc, "rounds": rounds, "seconds": slowest,
            "median_s": {way: statistics.median(v) for way, v in slowest.items()},
            "ceiling": paired(lambda a, k, ks, c, x, u: a / (nproc * k)),
            "efficiency": paired(lambda a, k, ks, c, x, u: a / (nproc * u)),
            "kernel_share": paired(lambda a, k, ks, c, x, u: k / u),
            "synced_kernel_share": paired(lambda a, k, ks, c, x, u: ks / u),
            "synced_kernel_plus_all_to_alls_share": paired(lambda a, k, ks, c, x, u: (ks + c) / u),
            "transfers_share": paired(lambda a, k, ks, c, x, u: x / u),
        }
        results.append(figures)
        ms = ", ".join(f"{way} {v * 1e3:.0f}" for way, v in figures["median_s"].items())
        click.echo(f"S={s} H={heads} P={nproc}, {rounds} rounds, median ms: {ms}\n  paired: ceiling T1 / (P x kernel) "
                   f"{figures['ceiling']:.3f}; efficiency T1 / (P x ulysses) {figures['efficiency']:.3f}; of ulysses: kernel "
                   f"{figures['kernel_share']:.3f}, kernel synced {figures['synced_kernel_share']:.3f}, "
                   f"kernel synced + all-to-alls {figures['synced_kernel_plus_all_to_alls_share']:.3f}, "
                   f"transfers alone {figures['transfers_share']:.3f}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"command": "python benchmarks/kernel_ceiling.py " + f"--nproc {nproc} --seq {seq} --heads {heads} --rounds {rounds}",
                       "torch": torch.__version__, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
