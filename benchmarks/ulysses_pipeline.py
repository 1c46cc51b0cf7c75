"""Ulysses pipelined over head groups against one fused all-to-all, paired: every round runs
each head-group count once, in turn, on the same inputs, so that the machine's drift hits
them alike; the ratio to G=1 is taken per round, then its median.

    python benchmarks/ulysses_pipeline.py [--nproc 2] [--seq 4096,8192] [--heads 8/8,8/2] [--groups 1,2,4]
                                          [--rounds 9] [--dtype float32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch

from ulysses_sp.cli.calibrate import slowest_seconds
from ulysses_sp.launch import run_ranks


def _rank(rank, world, seqs, heads, groups, rounds, dtype):
    import ulysses_sp as usp

    torch.set_num_threads(1)
    topo = usp.init_sequence_parallel(world)
    out = {}
    for seq in seqs:
        for hq, hkv in heads:
            gen = torch.Generator().manual_seed(seq + hq)
            q, k, v, dout = (usp.shard_sequence(torch.randn(1, seq, h, 64, generator=gen, dtype=dtype), topo) for h in (hq, hkv, hkv, hq))
            attns = {g: usp.SequenceParallelAttention(topo, backend=f"ulysses-g{g}") for g in groups}
            times = {g: [] for g in groups}
            for r in range(rounds + 1):  # round 0 warms up (handshake, caches)
                for g, attn in attns.items():
                    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                    took = slowest_seconds(lambda: attn(*leaves).backward(dout), 1, q.device)
                    if r:
                        times[g].append(took)
            out[f"S{seq} H{hq}/{hkv}"] = times
    return out if rank == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--seq", default="4096,8192")
    ap.add_argument("--heads", default="8/8,8/2", help="q/kv heads, comma list")
    ap.add_argument("--groups", default="1,2,4")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seq.split(",")]
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    groups = [int(g) for g in args.groups.split(",")]
    result = run_ranks(_rank, args.nproc, seqs, heads, groups, args.rounds, getattr(torch, args.dtype), timeout=3600)[0]
    rows = []
    for cell, times in result.items():
        base = times[groups[0]]
        for g, ts in times.items():
            ratios = [t / b for t, b in zip(ts, base)]
            rows.append({"cell": cell, "groups": g, "median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts),
                         "paired_ratio_median": statistics.median(ratios)})
            print(f"{cell:14s} G={g}: {rows[-1]['median_ms']:7.1f} ms ({rows[-1]['min_ms']:.0f}-{rows[-1]['max_ms']:.0f}), "
                  f"paired ratio to G={groups[0]} {rows[-1]['paired_ratio_median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python benchmarks/ulysses_pipeline.py", *(sys.argv[1:] if argv is None else argv)]), "nproc": args.nproc,
                       "dtype": args.dtype, "rounds": args.rounds, "rows": rows, "times_s": result}, f, indent=1)


if __name__ == "__main__":
    main()
