"""The performance issue's grid table from ``sp-bench run --peers --json`` files: per cell our
fastest backend, the peers, and the target ratios (taken within the same run), marked
**bold** where met (ratios at most 0.97, efficiency at least 0.90), and what ``auto`` chose:
that backend's own entry over the best (the cost of the choice) and auto's run of it over the
best (the same code timed again: the difference between the two is the spread). The
efficiency is sp-bench's: in files where T1 ran in the rounds, the median of the rounds' ratios.

Where the run interleaved its entries (sp-bench's rounds: run i of every entry of a cell in
round i), a ratio is the median over rounds of the ratio within a round, so that the
machine's drift between rounds cancels; in older files, which ran each entry's repeats one
after the other, it is the ratio of the two medians.

    python benchmarks/grid_table.py benchmarks/results/grid-P4-fp32-H8.json [more.json ...]
"""

from __future__ import annotations

import json
import statistics
import sys

OURS = ("ulysses", "allgather", "ring", "hybrid")
TARGET, EFFICIENCY = 0.97, 0.90


def _ms(row) -> str:
    t = row["fwd_bwd_s"]
    return f"{1e3 * t['median']:.0f} ({1e3 * t['min']:.0f}-{1e3 * t['max']:.0f})"


def _value(a, b, paired: bool) -> float:
    if paired:
        return statistics.median(x / y for x, y in zip(a["fwd_bwd_s_all"], b["fwd_bwd_s_all"], strict=True))
    return a["fwd_bwd_s"]["median"] / b["fwd_bwd_s"]["median"]


def _ratio(a, b, paired: bool) -> str:
    if a is None or b is None:
        return "-"
    r = _value(a, b, paired)
    return f"**{r:.2f}**" if r <= TARGET else f"{r:.2f}"


def table(paths) -> str:
    cells: dict = {}
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        nproc = data["env"].get("world_size") or data["env"].get("nproc")
        paired = "round" in data["env"].get("timing", "")
        mine: dict = {}
        for row in data["rows"]:
            if "fwd_bwd_s" not in row:  # skipped, with its reason
                continue
            mine.setdefault((nproc, row["dtype"], row["seq"], row["heads"], row["kv_heads"]), {})[row["entry"]] = row
        for key, rows in mine.items():  # a cell measured again (another file) gets a row of its own
            cells[key + (sum(k[:5] == key for k in cells),)] = rows, paired
    lines = ["| P | dtype | S | H/KV | ours best | DeepSpeed | torch ring | best / best peer | Ulysses / DeepSpeed | ring / torch ring | best eff. | auto: pick, its entry / best, auto's run / best |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (p, dtype, seq, hq, hkv, again), (rows, paired) in sorted(cells.items()):
        ours = {n: rows[n] for n in OURS if n in rows}
        best = min(ours, key=lambda n: ours[n]["fwd_bwd_s"]["median"])
        ds, tr = rows.get("peer:deepspeed"), rows.get("peer:torch-ring")
        peers = [r for r in (ds, tr) if r is not None]
        best_peer = min(peers, key=lambda r: r["fwd_bwd_s"]["median"]) if peers else None
        auto = next((r for n, r in rows.items() if n.startswith("auto")), None)
        auto_s = "-"
        if auto is not None:  # the choice's cost (its own entry against the best), then auto's own run of it
            pick = auto.get("resolved", "?")
            chosen = f"{_value(rows[pick], ours[best], paired):.2f}" if pick in rows else "?"
            auto_s = f"{pick} {chosen} / {_value(auto, ours[best], paired):.2f}"
        eff = ours[best].get("efficiency")
        eff_s = "-" if eff is None else (f"**{eff:.2f}**" if eff >= EFFICIENCY else f"{eff:.2f}")
        lines.append(f"| {p} | {dtype} | {seq // 1024}k{' (again)' if again else ''} | {hq}/{hkv} | {best} {_ms(ours[best])} | {_ms(ds) if ds else 'cannot run'} | "
                     f"{_ms(tr) if tr else 'cannot run'} | {_ratio(ours[best], best_peer, paired)} | {_ratio(ours.get('ulysses'), ds, paired)} | "
                     f"{_ratio(ours.get('ring'), tr, paired)} | {eff_s} | {auto_s} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(table(sys.argv[1:]))
