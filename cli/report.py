"""``sp-bench run``'s outputs: a rich table, JSON and CSV with every field, a matplotlib plot."""

from __future__ import annotations

import csv
import json

__all__ = ["render", "write_json", "write_csv", "write_plot", "CSV_COLUMNS"]

CSV_COLUMNS = [
    "entry", "kind", "resolved", "seq", "heads", "kv_heads", "head_dim", "batch", "dtype", "causal", "layout", "window", "sinks", "docs", "work_imbalance",
    "fwd_s_median", "fwd_s_min", "fwd_s_max", "fwd_bwd_s_median", "fwd_bwd_s_min", "fwd_bwd_s_max",
    "t1_s", "efficiency", "peak_mem_bytes", "fwd_bytes_sent", "bwd_bytes_sent", "analytic_fwd_bytes",
    "analytic_bwd_bytes", "bytes_match", "max_error", "skipped",
]


def _label(row: dict) -> str:
    name = row["entry"]
    return f"{name} ({row['resolved']})" if row.get("resolved") else name


def _mib(value) -> str:
    return "" if value is None else f"{value / 2**20:.1f}"


def render(rows: list[dict], title: str) -> None:
    """The measured rows as a table; the skipped ones below it, each with its reason."""
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for column in ("backend", "layout", "work", "S", "H/KV", "D", "B", "W", "fwd ms", "fwd+bwd ms (min-max)", "efficiency", "peak MiB",
                   "sent fwd/bwd MiB", "= analytic", "max error"):
        table.add_column(column, justify="left" if column == "backend" else "right")
    for row in rows:
        shape = (_label(row), row["layout"], f"{row['work_imbalance']:.2f}", str(row["seq"]), f"{row['heads']}/{row['kv_heads']}",
                 str(row["head_dim"]), str(row["batch"]), str(row.get("window") or "-"))
        if "skipped" in row:
            continue
        total = row["fwd_bwd_s"]
        match = row.get("bytes_match")
        table.add_row(
            *shape,
            f"{row['fwd_s']['median'] * 1e3:.1f}",
            f"{total['median'] * 1e3:.1f} ({total['min'] * 1e3:.0f}-{total['max'] * 1e3:.0f})",
            f"{row['efficiency']:.3f}" if "efficiency" in row else "",
            _mib(row["peak_mem_bytes"]),
            "not counted" if row["fwd_bytes_sent"] is None else f"{_mib(row['fwd_bytes_sent'])}/{_mib(row['bwd_bytes_sent'])}",
            "" if match is None else ("yes" if match else "[red]NO[/red]"),
            f"{row['max_error']:.2e}" if "max_error" in row else "",
        )
    console = Console(width=None if sys.stdout.isatty() else 180)
    console.print(table)
    for row in rows:
        if "skipped" in row:
            window = f" W={row['window']}" if row.get("window") else ""
            console.print(f"skipped {row['entry']} ({row['layout']}) at S={row['seq']} H={row['heads']}/{row['kv_heads']}{window}: {row['skipped']}",
                          highlight=False)
    console.print("work: the slowest rank's attention work over the mean under the row's layout (1.00: even; ulysses, which splits by "
                  "heads, is immune)", highlight=False)


def write_json(path: str, rows: list[dict], env: dict) -> None:
    with open(path, "w") as f:
        json.dump({"env": env, "rows": rows}, f, indent=2)


def _flat(row: dict) -> dict:
    flat = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
    for key in ("fwd_s", "fwd_bwd_s"):
        for stat, value in row.get(key, {}).items():
            flat[f"{key}_{stat}"] = value
    return flat


def write_csv(path: str, rows: list[dict], env: dict) -> None:
    with open(path, "w", newline="") as f:
        for key, value in env.items():  # the environment as comment lines above the header
            f.write(f"# {key}: {value}\n")
        writer = csv.DictWriter(f, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow(_flat(row))


def write_plot(path: str, rows: list[dict], title: str) -> None:
    """Forward+backward time and peak memory against sequence length, one line per entry and shape."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = {(r["heads"], r["kv_heads"], r["head_dim"], r["batch"], r["dtype"], r.get("window"), r["layout"]) for r in rows}
    lines: dict[str, list] = {}
    for row in rows:
        if "skipped" in row:
            continue
        label = row["entry"] if len(shapes) == 1 else f"{row['entry']} H{row['heads']}/{row['kv_heads']} D{row['head_dim']} B{row['batch']} {row['dtype']}" + (
            f" W{row['window']}" if row.get("window") else "") + f" {row['layout']}"
        lines.setdefault(label, []).append((row["seq"], row["fwd_bwd_s"]["median"], row["peak_mem_bytes"]))
    fig, (ax_time, ax_mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    for label, points in sorted(lines.items()):
        points.sort()
        seqs = [p[0] for p in points]
        ax_time.plot(seqs, [p[1] for p in points], marker="o", label=label)
        if all(p[2] is not None for p in points):
            ax_mem.plot(seqs, [p[2] / 2**20 for p in points], marker="o", label=label)
    for ax, ylabel in ((ax_time, "forward+backward s (median, slowest rank)"), (ax_mem, "peak memory per rank, MiB")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (tokens, all ranks)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax_time.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
