"""What the balanced layout buys on packed rows: one attention layer (forward + backward) on P
gloo ranks under the zigzag and the balanced layout, for each backend, on a packed row whose
documents make zigzag unbalanced (one long document first, then short ones), and on one document
(where zigzag is already balanced). Slowest rank's median of ``--repeat`` after one warm-up, and
the slowest rank's causal work over the mean, computed from the placement.

    python benchmarks/packed_balance.py --seq 16384 --ranks 2,4 --backends ring,allgather,ulysses
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HEADS, HEAD_DIM = 8, 64


def rows(seq: int) -> dict:
    long = 3 * seq // 4
    return {"one 3/4 document, then 512-token ones": [0, long, *range(long + 512, seq + 1, 512)], "one document": [0, seq]}


def _rank(rank: int, world: int, seq: int, backends, repeat: int) -> dict:
    import torch.distributed as dist

    import ulysses_sp as usp

    torch.set_num_threads(1)
    out = {}
    for lay in ("zigzag", "balanced"):
        topo = usp.init_sequence_parallel(world, layout=lay, timeout=600)
        for name, cu in rows(seq).items():
            g = torch.Generator().manual_seed(0)
            full = [torch.randn(1, seq, HEADS, HEAD_DIM, generator=g) for _ in range(4)]
            shards = [usp.shard_sequence(t, topo, cu_seqlens=cu) for t in full]
            packed = None if len(cu) == 2 else torch.tensor(cu, dtype=torch.int32)
            for backend in backends:
                q, k, v = (t.clone().requires_grad_() for t in shards[:3])

                def run():
                    usp.sp_attention(q, k, v, topo, backend=backend, cu_seqlens=packed).backward(shards[3])

                run()
                times = []
                for _ in range(repeat):
                    dist.barrier(group=topo.sp_group)
                    t0 = time.perf_counter()
                    run()
                    times.append(time.perf_counter() - t0)
                slowest = torch.tensor([statistics.median(times)], dtype=torch.float64)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                out[(name, backend, lay)] = slowest.item()
    return out


def main() -> None:
    from ulysses_sp.launch import run_ranks
    from ulysses_sp.layout import work_imbalance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--backends", default="ring,allgather,ulysses")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    backends = a.backends.split(",")
    print(f"B1 H{HEADS} D{HEAD_DIM} fp32 causal, {a.seq} tokens, forward + backward, slowest rank's median of {a.repeat}\n")
    print("| row | P | backend | zigzag | balanced | slowest / mean work: zigzag, balanced |")
    print("|---|---|---|---|---|---|")
    for world in [int(w) for w in a.ranks.split(",")]:
        r = run_ranks(_rank, world, a.seq, backends, a.repeat, timeout=3600)[0]
        for name, cu in rows(a.seq).items():
            work = f"{work_imbalance('zigzag', a.seq, world, cu):.2f}, {work_imbalance('balanced', a.seq, world, cu):.3f}"
            for backend in backends:
                print(f"| {name} | {world} | {backend} | {r[(name, backend, 'zigzag')] * 1e3:.0f} ms | "
                      f"{r[(name, backend, 'balanced')] * 1e3:.0f} ms | {work} |", flush=True)


if __name__ == "__main__":
    main()
