"""Our ring against torch's ring under different ways of timing a step, the ways and the
harnesses alternating call by call in one group of ranks, so that the machine's drift falls on
all of them alike. Made to find why sp-bench and ``profile_ulysses.py`` disagreed on this
pair at P = 2 16k (1.01-1.09 against 0.86-0.88).

Harnesses (``--variants``):
  bench      sp-bench's own timed call (``cli.bench._run_once``, no memory probe): fresh
             leaves, a barrier, the upstream gradient of the cell, CommCounter around it
  bare-dout  the same leaves every call, no barrier, ``out.backward(dout)``
  bare-sum   the same leaves every call, no barrier, ``out.sum().backward()`` (profile_ulysses.py)
  prof-sum   bare-sum under torch.profiler

    python benchmarks/harness_variants.py --seq 16384 --heads 8 --kv-heads 8 --dtype bfloat16 --rounds 5 \\
        --variants bench,bare-sum,bare-dout,prof-sum --json FILE
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ulysses_sp.launch import run_ranks

VARIANTS = ("bench", "bare-dout", "bare-sum", "prof-sum")


def _rank(rank, world, seq, heads, kv_heads, rounds, variants, dtype):
    import ulysses_sp as usp
    from ulysses_sp.cli.bench import Cell, _inputs, _run_once
    from ulysses_sp.cli.peers import PEERS

    topo = usp.init_sequence_parallel(world, layout="zigzag")
    cell = Cell(seq, heads, kv_heads, 64, 1, dtype, True, "zigzag")
    q, k, v, dout = (usp.shard_sequence(t, topo) for t in _inputs(cell, topo.device))
    ring = usp.SequenceParallelAttention(topo, backend="ring")
    ways = {"ring": lambda *qkv: ring(*qkv, causal=True), "torch-ring": PEERS["torch-ring"].make(cell, topo)}
    reused = {way: [t.clone().requires_grad_() for t in (q, k, v)] for way in ways}

    def bare(way, upstream):
        t0 = time.perf_counter()
        out = ways[way](*reused[way])
        out.sum().backward() if upstream is None else out.backward(upstream)
        return time.perf_counter() - t0

    def step(way, variant):
        if variant == "bench":
            return _run_once(ways[way], (q, k, v), dout, topo.device, topo.sp_group, memory=False)[0][1]
        if variant == "bare-dout":
            return bare(way, dout)
        if variant == "bare-sum":
            return bare(way, None)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            return bare(way, None)

    for way in ways:  # warmup
        for variant in variants:
            step(way, variant)
    times = {}
    for round_ in range(rounds):  # the ways' order alternates between rounds
        for way in list(ways)[:: 1 if round_ % 2 == 0 else -1]:
            for variant in variants:
                times.setdefault(f"{way}|{variant}", []).append(step(way, variant))
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    variants = a.variants.split(",")
    if set(variants) - set(VARIANTS):
        p.error(f"unknown variants {sorted(set(variants) - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    per_rank = run_ranks(_rank, 2, a.seq, a.heads, a.kv_heads, a.rounds, variants, a.dtype, timeout=3000)
    slowest = {key: [max(ts) for ts in zip(*(r[key] for r in per_rank))] for key in per_rank[0]}
    for key, ts in slowest.items():
        print(f"{key:22s} slowest rank, ms: median {1e3 * statistics.median(ts):6.0f}  rounds {', '.join(f'{1e3 * t:.0f}' for t in ts)}")
    for variant in variants:
        ours, torch_s = slowest[f"ring|{variant}"], slowest[f"torch-ring|{variant}"]
        print(f"ring / torch ring, {variant:9s}: median of the rounds' ratios {statistics.median(x / y for x, y in zip(ours, torch_s)):.3f}, "
              f"ratio of medians {statistics.median(ours) / statistics.median(torch_s):.3f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python benchmarks/harness_variants.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "json"),
                       "per_rank": per_rank, "slowest_rank": slowest}, f, indent=1)


if __name__ == "__main__":
    main()
