"""README's support table: each model family of tests/model_families.py under SP on P ranks,
exact (``verify_sequence_parallel``'s worst relative error over the loss and every gradient, fp64,
unpacked and packed, and the parameter where it is) or refused (the coverage check's findings).

    python benchmarks/support_table.py --ranks 2,3,4 [--families zamba2,minimax]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _short(reason: str) -> str:
    if reason.startswith("computes attention in its own code"):
        return "attention in its own code" + (", ALiBi" if "ALiBi" in reason else "")
    kinds = reason.split(": ", 1)[-1].split("; each rank")[0].split("; ")
    return "; ".join(k.split(" (")[0].split(" at ")[0] for k in kinds)


def _rank(rank: int, world: int, backend: str, names: list) -> dict:
    import transformers

    import ulysses_sp as usp
    from tests.model_families import FAMILIES, config
    from ulysses_sp.integrations.coverage import find_uncovered
    from ulysses_sp.integrations.mixers import install_mixers

    topo = usp.init_sequence_parallel(world, timeout=120)
    out = {}
    for name in names or FAMILIES:
        model = transformers.AutoModelForCausalLM.from_config(config(name))
        install_mixers(model, topo)  # what apply_sequence_parallel does first
        findings = find_uncovered(model)
        if findings:
            out[name] = "refused: " + "; ".join(sorted({f"{f.cls} ({_short(f.reason)})" for f in findings}))
            continue
        try:
            report = usp.verify_sequence_parallel(config(name), topo, backend=backend, shrink=False, raise_on_mismatch=False)
        except ValueError as e:  # what only the first forward shows
            out[name] = "refused: " + str(e).split(": ", 1)[0] + " (" + str(e).split(": ", 1)[1].split(" is not supported")[0] + ")"
            continue
        run, param, err = report.worst
        where = param.split(".")[-2] if "." in param else param
        n = len(report.mixers)
        mixers = f", {n} mixer{'s' if n > 1 else ''} {'/'.join(sorted(set(report.mixers.values())))}" if n else ""
        out[name] = f"{'exact' if report.passed else 'MISMATCH'} {err:.0e} ({where}){mixers}"
    return out


def main() -> None:
    from ulysses_sp.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--backend", default="auto")
    p.add_argument("--families", default="", help="comma-separated names of tests/model_families.py (default: all)")
    a = p.parse_args()
    worlds = [int(w) for w in a.ranks.split(",")]
    names = [n for n in a.families.split(",") if n]
    results = {w: run_ranks(_rank, w, a.backend, names, timeout=1200)[0] for w in worlds}
    families = list(results[worlds[0]])
    print("| family | " + " | ".join(f"P={w}" for w in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for name in families:
        cells = [results[w][name] for w in worlds]
        if all(c == cells[0] for c in cells) and cells[0].startswith("refused"):
            cells = [cells[0]] + [""] * (len(cells) - 1)
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
