"""README's support table: each model family of tests/model_families.py under SP on P ranks,
exact (``verify_sequence_parallel``'s worst relative error, fp64, unpacked and packed) or refused
(``apply_sequence_parallel``'s reason).

    python benchmarks/support_table.py --ranks 2,3,4 [--markdown]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank(rank: int, world: int, backend: str) -> dict:
    import ulysses_sp as usp
    from tests.model_families import FAMILIES, config

    topo = usp.init_sequence_parallel(world, timeout=120)
    out = {}
    for name in FAMILIES:
        try:
            report = usp.verify_sequence_parallel(config(name), topo, backend=backend, shrink=False, raise_on_mismatch=False)
            run, param, err = report.worst
            out[name] = ("exact" if report.passed else "MISMATCH", f"{err:.1e} ({param.split('.')[-2] if '.' in param else param}, {run})")
        except ValueError as e:
            first = str(e).splitlines()[1].strip() if "\n" in str(e) else str(e)
            out[name] = ("refused", first.split(": ", 1)[1].split(",")[0] if ": " in first else first)
    return out


def main() -> None:
    from ulysses_sp.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,3")
    p.add_argument("--backend", default="auto")
    a = p.parse_args()
    worlds = [int(w) for w in a.ranks.split(",")]
    results = {w: run_ranks(_rank, w, a.backend, timeout=1200)[0] for w in worlds}
    families = list(results[worlds[0]])
    print("| family | " + " | ".join(f"P={w}" for w in worlds) + " |")
    print("|---|" + "---|" * len(worlds))
    for name in families:
        cells = []
        for w in worlds:
            verdict, detail = results[w][name]
            cells.append(f"{verdict}: {detail}")
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
