"""How much `sp-bench calibrate`'s backend overheads spread between runs, by two estimators
on the same raw times: the difference of a backend's median and the leanest backend's
median ("medians", calibrate before 2026-12-01), and the median of their differences within
a round ("paired", `cli.calibrate._over_leanest`, calibrate since).

    sp-bench calibrate --nproc 2 --repeat 9 --out run1.json   # and run2 ... (runs of the same rank count)
    python benchmarks/calibration_spread.py run1.json run2.json run3.json run4.json

Per backend and reference shape: each run's excess over the leanest backend (ms), and its
standard deviation across the runs. Needs runs that stored every round (`runs_s`).
"""

from __future__ import annotations

import json
import statistics

import click

from ulysses_sp.cli.calibrate import REFERENCE_HEADS, _over_leanest


def _excess(times: dict, how: str) -> dict:
    leanest, paired = _over_leanest(times)
    if how == "paired":
        return paired
    excess = {name: r["measured_s"] - r["estimated_s"] for name, r in times.items()}
    return {name: x - excess[leanest] for name, x in excess.items()}


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(exists=True, dir_okay=False))
def main(runs):
    measured = [json.load(open(path))["measured"]["backends"] for path in runs]
    for hq, hkv in REFERENCE_HEADS:
        shape = f"{hq}/{hkv}"
        for how in ("medians", "paired"):
            per_run = [_excess(m[shape], how) for m in measured]
            for name in per_run[0]:
                xs = [1e3 * run[name] for run in per_run]
                click.echo(f"H{shape:5s} {how:8s} {name:10s} " + " ".join(f"{x:7.1f}" for x in xs) + f"   sd {statistics.pstdev(xs):6.1f} ms")


if __name__ == "__main__":
    main()
