"""The slowest rank's causal attention work over the mean, zigzag against balanced, on packed
128k-token rows at P = 2 to 64: computed from the layouts' placement (``layout.work_imbalance``),
no attention run. Three length mixes, ``--rows`` seeded rows each; median, 90th percentile and
worst row.

    python benchmarks/packed_work.py --seq 128k --ranks 2,4,8,16,64 --rows 50
"""

from __future__ import annotations

import argparse
import random
import statistics

from ulysses_sp.cli.docs import parse_docs
from ulysses_sp.cli.plan import parse_tokens
from ulysses_sp.layout import work_imbalance


def one_long(seq: int, seed: int) -> tuple[int, ...]:
    """One document of 3/8 to 3/4 of the row at a random offset, log-normal ones (median 1k,
    sigma 1) around it."""
    rng = random.Random(seed)
    long = rng.randrange(3 * seq // 8, 3 * seq // 4)
    start = rng.randrange(0, seq - long)
    before = [b for b in parse_docs("lognormal:1k:1", start, seed)[:-1]] if start else [0]
    after = [start + long + b for b in parse_docs("lognormal:1k:1", seq - start - long, seed + 1)[1:]] if seq > start + long else []
    return (*before, start, start + long, *after) if start else (0, long, *after)


MIXES = {
    "log-normal, median 2k, sigma 1.5": lambda seq, seed: parse_docs("lognormal:2k:1.5", seq, seed),
    "log-normal, median 16k, sigma 1": lambda seq, seed: parse_docs("lognormal:16k:1", seq, seed),
    "one long document (3/8 to 3/4 of the row) among 1k ones": one_long,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="128k")
    p.add_argument("--ranks", default="2,4,8,16,64")
    p.add_argument("--rows", type=int, default=50)
    a = p.parse_args()
    seq = parse_tokens(a.seq)
    print(f"{seq} tokens per row, {a.rows} rows per mix; slowest / mean causal work: median, p90, worst row\n")
    print("| mix | documents per row (median) | P | zigzag | balanced |")
    print("|---|---|---|---|---|")
    for name, mix in MIXES.items():
        rows = [mix(seq, seed) for seed in range(a.rows)]
        docs = statistics.median(len(r) - 1 for r in rows)
        for world in [int(w) for w in a.ranks.split(",")]:
            cells = []
            for lay in ("zigzag", "balanced"):
                got = sorted(work_imbalance(lay, seq, world, r) for r in rows)
                cells.append(f"{statistics.median(got):.3f}, {got[int(0.9 * (len(got) - 1))]:.3f}, {got[-1]:.3f}")
            print(f"| {name} | {docs:g} | {world} | {cells[0]} | {cells[1]} |", flush=True)


if __name__ == "__main__":
    main()
