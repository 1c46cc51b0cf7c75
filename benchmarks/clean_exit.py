"""Do runs end cleanly? Runs a short job N times and counts exit codes other than 0 and abort
traces at exit ("terminate called", "Aborted", "core dumped", leaked semaphores). ``--job``:

- ``zero3``: ZeRO-3 training of the main job under the deepspeed launcher on gloo (DeepSpeed's
  own recipe aborted at exit in 30-40% of such runs on this kind of machine);
- ``distributed-attention``: examples/distributed_attention.py under torchrun, which ends without
  ``dist.destroy_process_group()`` (a plain gloo ``all_reduce`` script ending so aborts in about 3 of 10);
- ``trl-grpo``: examples/trl_grpo.py as the Trainer guide gives it, which ends so too.

    python benchmarks/clean_exit.py --runs 10 --json benchmarks/results/clean-exit-zero3.json
    python benchmarks/clean_exit.py --job distributed-attention --runs 10 --json benchmarks/results/clean-exit-distributed-attention.json
    python benchmarks/clean_exit.py --job trl-grpo --runs 10 --json benchmarks/results/clean-exit-trl-grpo.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import click

ABORT = re.compile(r"terminate called|Aborted|core dumped|Segmentation fault|leaked semaphore|ProcessGroup.*destroyed")


@click.command()
@click.option("--job", type=click.Choice(["zero3", "distributed-attention", "trl-grpo"]), default="zero3", show_default=True)
@click.option("--runs", default=10, show_default=True)
@click.option("--zero-stage", default=3, show_default=True)
@click.option("--steps", default=3, show_default=True)
@click.option("--seq-len", default=512, show_default=True)
@click.option("--json", "json_path", default=None)
def main(job, runs, zero_stage, steps, seq_len, json_path):
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    torchrun = ["torchrun", "--nproc_per_node", "2"]
    command = {
        "zero3": ["deepspeed", "--num_gpus", "2", "train.py", "--sp-size", "2", "--zero-stage", str(zero_stage), "--steps", str(steps),
                  "--seq-len", str(seq_len)],
        "distributed-attention": [*torchrun, "examples/distributed_attention.py"],
        "trl-grpo": [*torchrun, "examples/trl_grpo.py", "--sp_size", "2", "--use_cpu", "--output_dir", os.path.join(tempfile.gettempdir(), "trl-grpo"),
                     "--num_generations", "4"],
    }[job]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    results = []
    for n in range(runs):
        start = time.monotonic()
        proc = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=900)
        text = proc.stdout + proc.stderr
        aborts = sorted(set(ABORT.findall(text)))
        results.append({"run": n, "exit_code": proc.returncode, "aborts": aborts, "seconds": round(time.monotonic() - start, 1)})
        click.echo(f"run {n}: exit {proc.returncode}, {'abort traces: ' + ', '.join(aborts) if aborts else 'clean'}, {results[-1]['seconds']} s")
        if proc.returncode or aborts:
            click.echo(text[-3000:], err=True)
    bad = [r for r in results if r["exit_code"] or r["aborts"]]
    click.echo(f"{runs - len(bad)} of {runs} runs ended cleanly")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"command": " ".join(command), "date": datetime.date.today().isoformat(), "python": sys.version.split()[0],
                       "machine": platform.machine(), "cpus": os.cpu_count(), "runs": results}, f, indent=2)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
