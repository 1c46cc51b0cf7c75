"""What the balanced layout buys on packed rows: one attention layer (forward + backward) on P
gloo ranks under the zigzag and the balanced layout, on rows packed with one long document (3/4
of the row, first) and 512-token ones, where zigzag leaves the ranks' work uneven.

Paired rounds: each round runs every backend under both layouts back to back (the order rotating
between rounds), so a drift of the machine's speed falls on both; a round's ratio is zigzag's time
over balanced's. Two figures per call, each the slowest rank's:

* wall seconds, from a barrier;
* CPU seconds of the rank's process (``time.process_time``), which is what the wall time would be
  with a core per rank: with more ranks than cores (P=4 on 2 cores) the ranks share the cores, and
  the wall time is the total work whatever its split.

    python benchmarks/packed_balance.py --seq 8k,16k --ranks 2,4 --backends ring --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HEADS, HEAD_DIM = 8, 64
LAYOUTS = ("zigzag", "balanced")


def row(seq: int) -> list[int]:
    long = 3 * seq // 4
    return [0, long, *range(long + 512, seq + 1, 512)]


def _rank(rank: int, world: int, seqs, backends, rounds: int) -> dict:
    import torch.distributed as dist

    import ulysses_sp as usp
    from ulysses_sp.cli.calibrate import rotated

    torch.set_num_threads(1)
    topos = {lay: usp.init_sequence_parallel(world, layout=lay, timeout=600) for lay in LAYOUTS}
    out = {}
    for seq in seqs:
        cu = row(seq)
        packed = torch.tensor(cu, dtype=torch.int32)
        g = torch.Generator().manual_seed(0)
        full = [torch.randn(1, seq, HEADS, HEAD_DIM, generator=g) for _ in range(4)]
        shards = {lay: [usp.shard_sequence(t, topos[lay], cu_seqlens=cu) for t in full] for lay in LAYOUTS}
        runs = [(backend, lay) for backend in backends for lay in LAYOUTS]

        def run(backend, lay):
            q, k, v, dout = shards[lay]
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            dist.barrier(group=topos[lay].sp_group)
            t0, c0 = time.perf_counter(), time.process_time()
            usp.sp_attention(q, k, v, topos[lay], backend=backend, cu_seqlens=packed).backward(dout)
            took = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX)  # each figure's slowest rank
            return took.tolist()

        for key in runs:  # warm-up
            run(*key)
        for r in range(rounds):
            for key in rotated(runs, r):
                out.setdefault((seq, *key), []).append(run(*key))
    return out


def main() -> None:
    from ulysses_sp.cli.plan import parse_tokens
    from ulysses_sp.launch import run_ranks
    from ulysses_sp.layout import work_imbalance

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="8k,16k")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--backends", default="ring")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    seqs, backends = [parse_tokens(s) for s in a.seq.split(",")], a.backends.split(",")
    print(f"B1 H{HEADS} D{HEAD_DIM} fp32 causal, forward + backward, one 3/4 document then 512-token ones; "
          f"{a.rounds} paired rounds after a warm-up; medians of the slowest rank, ratio: median of the rounds' zigzag / balanced (min-max)\n")
    print("| tokens | P | backend | work slowest/mean: zigzag, balanced | wall: zigzag | balanced | ratio | CPU: zigzag | balanced | ratio |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for world in [int(w) for w in a.ranks.split(",")]:
        r = run_ranks(_rank, world, seqs, backends, a.rounds, timeout=3600)[0]
        for seq in seqs:
            work = f"{work_imbalance('zigzag', seq, world, row(seq)):.2f}, {work_imbalance('balanced', seq, world, row(seq)):.3f}"
            for backend in backends:
                cells = []
                for i in (0, 1):  # wall, CPU
                    zig, bal = ([run[i] for run in r[(seq, backend, lay)]] for lay in LAYOUTS)
                    ratios = [z / b for z, b in zip(zig, bal)]
                    cells += [f"{statistics.median(zig) * 1e3:.0f} ms", f"{statistics.median(bal) * 1e3:.0f} ms",
                              f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"]
                print(f"| {seq} | {world} | {backend} | {work} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
