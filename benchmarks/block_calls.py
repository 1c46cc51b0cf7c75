"""Merged block calls against one call per (query run, key run), paired: every round runs the
block-wise backends once with ``blocks.plan_blocks`` merging unmasked calls and a rank's own
diagonals (the default) and once without, in turn (which goes first alternates), on the same
inputs; the ratio is taken per round, then its median.
Under zigzag every ring step is one kernel call merged; split, the first is three, the others two.

    python benchmarks/block_calls.py [--nproc 4] [--seq 8192] [--heads 8/8] [--backends ring,allgather]
                                     [--rounds 7] [--dtype bfloat16] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from unittest import mock

import torch

from ulysses_sp.cli.calibrate import slowest_seconds
from ulysses_sp.launch import run_ranks

VARIANTS = ("merged", "split")


def _rank(rank, world, seqs, heads, backends, rounds, dtype):
    import ulysses_sp as usp
    from ulysses_sp import blocks

    torch.set_num_threads(1)
    topo = usp.init_sequence_parallel(world)
    caches = {v: {} for v in VARIANTS}  # each variant's plans, kept apart
    split = mock.patch.multiple(blocks, _coalesce=lambda calls, max_keys: list(calls), _merge_diagonals=list)
    out = {}
    for seq in seqs:
        for hq, hkv in heads:
            gen = torch.Generator().manual_seed(seq + hq)
            q, k, v, dout = (usp.shard_sequence(torch.randn(1, seq, h, 64, generator=gen, dtype=dtype), topo) for h in (hq, hkv, hkv, hq))
            for name in backends:
                attn = usp.SequenceParallelAttention(topo, backend=name)
                times = {v: [] for v in VARIANTS}
                for r in range(rounds + 1):  # round 0 warms up (handshake, plans)
                    for variant in VARIANTS[r % 2 :] + VARIANTS[: r % 2]:  # alternate which goes first
                        topo.cache = caches[variant]
                        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                        with split if variant == "split" else contextlib.nullcontext():
                            took = slowest_seconds(lambda: attn(*leaves).backward(dout), 1, q.device)
                        if r:
                            times[variant].append(took)
                out[f"{name} S{seq} H{hq}/{hkv}"] = times
    return out if rank == 0 else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=4)
    ap.add_argument("--seq", default="8192")
    ap.add_argument("--heads", default="8/8", help="q/kv heads, comma list")
    ap.add_argument("--backends", default="ring,allgather")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    seqs = [int(s) for s in args.seq.split(",")]
    heads = [tuple(int(x) for x in h.split("/")) for h in args.heads.split(",")]
    result = run_ranks(_rank, args.nproc, seqs, heads, args.backends.split(","), args.rounds, getattr(torch, args.dtype), timeout=3600)[0]
    rows = []
    for cell, times in result.items():
        ratios = [t / b for t, b in zip(times["merged"], times["split"])]
        row = {"cell": cell, "paired_ratio_median": statistics.median(ratios)}
        for v, ts in times.items():
            row[v] = {"median_ms": 1e3 * statistics.median(ts), "min_ms": 1e3 * min(ts), "max_ms": 1e3 * max(ts)}
        rows.append(row)
        print(f"{cell:28s} " + ", ".join(f"{v} {row[v]['median_ms']:7.1f} ms ({row[v]['min_ms']:.0f}-{row[v]['max_ms']:.0f})" for v in VARIANTS)
              + f"; merged / split, paired: {row['paired_ratio_median']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": " ".join(["python benchmarks/block_calls.py", *(sys.argv[1:] if argv is None else argv)]), "nproc": args.nproc,
                       "dtype": args.dtype, "rounds": args.rounds, "rows": rows, "times_s": result}, f, indent=1)


if __name__ == "__main__":
    main()
