"""How far `auto` is from the fastest backend, measured: for every cell of a grid,
forward+backward time of every backend on N spawned gloo ranks, the backend
`auto` picks with a given profile, and its regret (its time / the best time).

    sp-bench calibrate --nproc 2 --out benchmarks/results/cpu-profile.json
    python benchmarks/auto_regret.py --profile benchmarks/results/cpu-profile.json \\
        --heads 4,8,16 --kv-heads 1,2,q --seq 4k,8k,16k --window none,1024 --nproc 2,4 --json benchmarks/results/auto-regret.json

Every backend `auto` weighs for a cell is timed (the hybrid at each Ulysses degree, halo on
windowed cells), so the regret is against the best fixed choice for that layer.
"""

from __future__ import annotations

import itertools
import json
import statistics
import time

import click
import torch

import ulysses_sp as usp
from ulysses_sp.cli.plan import parse_tokens
from ulysses_sp.launch import run_ranks
from ulysses_sp.registry import choose_backend

def _cells(heads, kv_heads, seqs, windows):
    for hq, kv, seq, window in itertools.product(heads, kv_heads, seqs, windows):
        hkv = hq if kv == "q" else int(kv)
        if hkv <= hq and hq % hkv == 0:
            yield hq, hkv, seq, window


def _step(backend, q, k, v, dout, topo, window):
    """Seconds of one forward+backward on this rank, started together with the other ranks."""
    import torch.distributed as dist

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    dist.barrier()
    t0 = time.perf_counter()
    usp.sp_attention(*leaves, topo, backend=backend, window=window).backward(dout)
    return time.perf_counter() - t0


def _ulysses_degree(world: int) -> int | None:
    return 2 if world % 2 == 0 and world > 2 else None


def _rank(rank, world, cells, repeat, profile_path, other_path=None):
    """Per cell, ``repeat`` rounds in which every feasible backend runs once, the order
    rotating between rounds: drift on a shared machine then falls on every backend alike
    instead of on whichever ran last. A run's time is its slowest rank's; a backend's time
    is the median of its rounds. ``other_path``: a second profile whose pick is scored on the
    same measurements."""
    import torch.distributed as dist

    profile = usp.load_profile(profile_path)
    other_profile = usp.load_profile(other_path) if other_path else None
    topo = usp.init_sequence_parallel(world, ulysses_degree=_ulysses_degree(world), profile=profile)
    out = []
    for index, (hq, hkv, seq, window) in enumerate(cells):
        gen = torch.Generator().manual_seed(rank)
        s = seq // world
        q, dout = (torch.randn(1, s, hq, 64, generator=gen) for _ in range(2))
        k, v = (torch.randn(1, s, hkv, 64, generator=gen) for _ in range(2))
        spec = usp.attention.make_spec(q, k, v, topo, window=window)
        chosen, considered = choose_backend(spec, topo)
        other = choose_backend(spec, topo, other_profile)[0].name if other_profile else None
        feasible = [name for name, estimate in considered.items() if not isinstance(estimate, str)]
        if index == 0:  # warm up the process (thread pools, allocator) once
            for backend in feasible:
                _step(backend, q, k, v, dout, topo, window)
        runs = {b: [] for b in feasible}
        for round_ in range(repeat):
            shift = (round_ + index) % len(feasible)
            for backend in feasible[shift:] + feasible[:shift]:
                runs[backend].append(_step(backend, q, k, v, dout, topo, window))
        slowest = torch.tensor([runs[b] for b in feasible], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        runs = dict(zip(feasible, slowest.tolist()))
        times = {b: statistics.median(r) for b, r in runs.items()}
        estimates = {n: e.seconds for n, e in considered.items() if not isinstance(e, str)}
        out.append({"heads": hq, "kv_heads": hkv, "seq": seq, "window": window, "ranks": world, "auto": chosen.name, "measured_s": times,
                    "runs_s": runs, "estimated_s": estimates, "regret": times[chosen.name] / min(times.values())})
        if other:
            out[-1].update(other_auto=other, other_regret=times[other] / min(times.values()))
    return out


def _rescore(path: str, profile_path: str, other_path: str | None) -> list[dict]:
    """The cells of an earlier run (``--json``), auto's pick and regret recomputed with
    ``profile_path`` (and ``other_path``) on their measured times. The runs were float32 (their
    inputs are ``torch.randn``'s), head dim 64, causal, zigzag."""
    from ulysses_sp.spec import AttnSpec
    from ulysses_sp.topology import Topology

    profiles = [usp.load_profile(p) for p in (profile_path, other_path) if p]
    rows = []
    for cell in json.load(open(path))["cells"]:
        world = cell["ranks"]
        topo = Topology.for_planning(world, ulysses_degree=_ulysses_degree(world))
        spec = AttnSpec(batch=1, seq_len=cell["seq"], local_seq_len=cell["seq"] // world, q_heads=cell["heads"], kv_heads=cell["kv_heads"],
                        head_dim=64, dtype=torch.float32, causal=True, softmax_scale=64**-0.5, layout="zigzag", window=cell["window"])
        times = cell["measured_s"]
        picks = [choose_backend(spec, topo, p)[0].name for p in profiles]
        row = {k: v for k, v in cell.items() if k not in ("other_auto", "other_regret")}
        row.update(auto=picks[0], regret=times[picks[0]] / min(times.values()))
        if other_path:
            row.update(other_auto=picks[1], other_regret=times[picks[1]] / min(times.values()))
        rows.append(row)
    return rows


def _summary(rows: list[dict], other_path: str | None) -> None:
    for r in rows:
        best = min(r["measured_s"], key=r["measured_s"].get)
        click.echo(f"P{r['ranks']} H{r['heads']}/{r['kv_heads']} S{r['seq']} W{r['window']}: auto {r['auto']} "
                   f"{r['measured_s'][r['auto']]:.3f}s, best {best} {r['measured_s'][best]:.3f}s, regret {r['regret']:.3f}"
                   + (f"; {other_path}: {r['other_auto']}, regret {r['other_regret']:.3f}" if other_path else ""))
    for world in sorted({r["ranks"] for r in rows}):
        cells = [r for r in rows if r["ranks"] == world]
        for key, name in (("regret", "profile"), ("other_regret", other_path)):
            if key in cells[0]:
                regrets = [r[key] for r in cells]
                click.echo(f"P{world} {name}: worst regret {max(regrets):.3f}, mean {statistics.mean(regrets):.3f}, "
                           f"{sum(x <= 1.05 for x in regrets)}/{len(regrets)} cells within 1.05")


@click.command()
@click.option("--profile", "profile_path", required=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--heads", default="4,8,16", show_default=True)
@click.option("--kv-heads", default="1,2,q", show_default=True, help="'q': as many as q heads")
@click.option("--seq", default="4k,8k,16k", show_default=True)
@click.option("--window", "windows", default="none", show_default=True, help="sliding windows, comma list; none: full attention")
@click.option("--nproc", default="2,4", show_default=True)
@click.option("--repeat", default=3, show_default=True, help="rounds per cell; every backend runs once a round")
@click.option("--json", "json_path", default=None)
@click.option("--compare-profile", "other_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="also score this profile's pick on the same measurements")
@click.option("--rescore", "rescore_path", default=None, type=click.Path(exists=True, dir_okay=False),
              help="measure nothing: score the profiles on this earlier run's --json")
def main(profile_path, heads, kv_heads, seq, windows, nproc, repeat, json_path, other_path, rescore_path):
    if rescore_path:
        return _summary(_rescore(rescore_path, profile_path, other_path), other_path)
    windows = [None if w == "none" else parse_tokens(w) for w in windows.split(",")]
    cells = list(_cells([int(h) for h in heads.split(",")], kv_heads.split(","), [parse_tokens(s) for s in seq.split(",")], windows))
    rows = []
    for world in (int(n) for n in nproc.split(",")):
        rows += run_ranks(_rank, world, cells, repeat, profile_path, other_path, timeout=7200, collective_timeout=3600)[0]
        _summary(rows[-len(cells):], other_path)
    worst = max(rows, key=lambda r: r["regret"])
    click.echo(f"worst regret {worst['regret']:.3f} at P{worst['ranks']} H{worst['heads']}/{worst['kv_heads']} S{worst['seq']} W{worst['window']}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"profile": profile_path, "compare_profile": other_path, "repeat": repeat, "torch": torch.__version__, "cells": rows}, f, indent=2)


if __name__ == "__main__":
    main()
