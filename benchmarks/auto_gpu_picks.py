"""``auto``'s picks on the built-in GPU profile, with and without its efficiency terms.

For each model shape, sequence length and GPU count (8 per node): the backend ``auto`` picks and
its margin (how much slower the runner-up is estimated), first on the profile without
``kernel_efficiency`` and ``kernel_half_rate_tokens`` (what it estimated before they existed),
then on ``NVLINK_PROFILE`` as built in. Estimates only: nothing runs on a GPU.

    python benchmarks/auto_gpu_picks.py [--json benchmarks/results/auto-gpu-picks.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from ulysses_sp.cli.plan import LayerShape, plan_rows
from ulysses_sp.profile import NVLINK_PROFILE
from ulysses_sp.spec import Estimate

MODELS = {"Llama-3-8B (32/8)": LayerShape(32, 8, 128), "Llama-3-70B (64/8)": LayerShape(64, 8, 128),
          "Qwen2.5-7B (28/4)": LayerShape(28, 4, 128)}
TOKENS = (32 * 1024, 128 * 1024, 512 * 1024, 1024 * 1024)
GPUS = (8, 16, 32, 64)
BEFORE = dataclasses.replace(NVLINK_PROFILE, kernel_efficiency={}, kernel_half_rate_tokens=0.0)


def pick(shape: LayerShape, tokens: int, gpus: int, profile) -> dict:
    (_, _, _, chosen, considered), = plan_rows([shape], seq_len=tokens, sp_size=gpus, ranks_per_node=8, profile=profile)
    seconds = sorted((e.seconds, name) for name, e in considered.items() if isinstance(e, Estimate))
    runner_up = seconds[1] if len(seconds) > 1 else (float("nan"), "-")
    return {"pick": chosen, "ms": seconds[0][0] * 1e3, "runner_up": runner_up[1], "margin": runner_up[0] / seconds[0][0] - 1,
            "ulysses_ms": considered["ulysses"].seconds * 1e3 if isinstance(considered["ulysses"], Estimate) else None,
            "ring_ms": considered["ring"].seconds * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    print("| model | tokens | GPUs | before: pick (margin over runner-up) | after: pick (margin over runner-up) |")
    print("|---|---|---|---|---|")
    for model, shape in MODELS.items():
        for tokens in TOKENS:
            for gpus in GPUS:
                before, after = pick(shape, tokens, gpus, BEFORE), pick(shape, tokens, gpus, NVLINK_PROFILE)
                rows.append({"model": model, "tokens": tokens, "gpus": gpus, "before": before, "after": after})
                cell = lambda r: f"{r['pick']} ({r['margin']:+.1%} {r['runner_up']})"  # noqa: E731
                print(f"| {model} | {tokens // 1024}k | {gpus} | {cell(before)} | {cell(after)} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
