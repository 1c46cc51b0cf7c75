"""The default run's retrieval, as a new user runs it, and the shard-cut control.

For each seed: README's main job (2 CPU ranks, the embedded model and task) with ``--seed S
--export-hf DIR``, timed; its end-of-run eval line (held-out prompts whose key lies on the other
rank than the answer); then the exported model on one process over the same prompts, with
attention whole (it must agree with the job) and cut at the shard boundaries
(``ulysses_sp.testing.shard_cut``: no token sees the other rank's), which must stay at chance.

    python benchmarks/retrieval.py --seeds 0,1,2 [--json benchmarks/results/retrieval.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_EVAL = re.compile(r"passkey retrieved in ([0-9.]+)% of (\d+) held-out prompts.*key symbols right ([0-9.]+)%")


def run(seed: int, export: str) -> dict:
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    cmd = [deepspeed, "--num_gpus", "2", "train.py", "--sp-size", "2", "--sp-backend", "auto", "--seed", str(seed), "--export-hf", export]
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    seconds = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(f"seed {seed}: the job failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    found = _EVAL.findall(out.stdout)
    if not found:
        raise SystemExit(f"seed {seed}: no eval line in the job's output:\n{out.stdout[-2000:]}")
    retrieved, prompts, symbols = found[-1]
    return {"seed": seed, "job_s": seconds, "job_retrieved": float(retrieved) / 100, "job_symbols_right": float(symbols) / 100,
            "prompts": int(prompts)}


def control(export: str, seed: int, prompts: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from ulysses_sp.job.config import TrainConfig
    from ulysses_sp.testing.shard_cut import retrieval

    torch.set_num_threads(os.cpu_count() or 1)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    seq = TrainConfig().seq_len
    whole = retrieval(model, seq, seed=seed, prompts=prompts, sp_size=2, layout="zigzag", cut=False)
    cut = retrieval(model, seq, seed=seed, prompts=prompts, sp_size=2, layout="zigzag", cut=True)
    return {"whole_retrieved": whole["retrieved"], "whole_symbols_right": whole["symbols_right"],
            "cut_retrieved": cut["retrieved"], "cut_symbols_right": cut["symbols_right"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rows = []
    print(f"{'seed':>4} {'job s':>6} {'retrieved':>10} {'symbols':>8} | one process: {'whole':>6} {'cut':>6} {'cut symbols':>12}")
    for seed in (int(s) for s in a.seeds.split(",")):
        export = tempfile.mkdtemp(prefix="retrieval-")
        try:
            row = run(seed, export)
            row.update(control(export, seed, row["prompts"]))
        finally:
            shutil.rmtree(export, ignore_errors=True)
        rows.append(row)
        print(f"{seed:>4} {row['job_s']:>6.0f} {row['job_retrieved']:>10.1%} {row['job_symbols_right']:>8.1%} | "
              f"{row['whole_retrieved']:>19.1%} {row['cut_retrieved']:>6.1%} {row['cut_symbols_right']:>12.1%}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
