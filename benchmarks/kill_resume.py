"""Fault injection: the main job killed with SIGKILL at random moments, then resumed.

An uninterrupted run (2 ranks, --save-every 1, the embedded model) gives the reference losses
and exported weights. Each trial starts the same run in a fresh directory, SIGKILLs both
ranks at a random moment of its training phase (saves included), then runs the same command
with ``--resume latest`` to the end, and checks: exit 0, every step once in the metrics file
with the reference's loss, and exported weights equal to the reference's. Every other trial
aims inside a save instead: it watches the checkpoint directory and kills within 0-20 ms of a
random step's ``.partial-stepN`` directory appearing. Each row records whether the kill
landed inside a save (a ``.partial-step*`` directory left behind) and the checkpoint the
resume took.

    python benchmarks/kill_resume.py --trials 10
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(flags: list[str]) -> tuple[list[subprocess.Popen], list[tuple[float, str]]]:
    """Both ranks as a launcher starts them; rank 0's lines collected with their times."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(_port())}
    ranks = [subprocess.Popen([sys.executable, "train.py", *flags], cwd=ROOT, text=True, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=subprocess.STDOUT) for r in range(2)]
    lines: list[tuple[float, str]] = []
    threading.Thread(target=lambda: lines.extend((time.monotonic(), line) for line in ranks[0].stdout), daemon=True).start()
    return ranks, lines


def _finish(ranks, lines, timeout=600) -> str:
    for rank in ranks:
        rank.wait(timeout=timeout)
    time.sleep(0.2)
    if any(rank.returncode for rank in ranks):
        raise RuntimeError(f"exit codes {[r.returncode for r in ranks]}:\n" + "".join(line for _, line in lines)[-3000:])
    return "".join(line for _, line in lines)


def _flags(root: str, steps: int, seq_len: int) -> list[str]:
    return ["--sp-size", "2", "--seq-len", str(seq_len), "--steps", str(steps), "--eval-samples", "4", "--save", f"{root}/ckpt",
            "--save-every", "1", "--metrics-file", f"{root}/m.jsonl", "--export-hf", f"{root}/export"]


def _losses(root: str) -> list:
    with open(f"{root}/m.jsonl") as f:
        return [(r["step"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


def _weights(root: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{root}/export/model.safetensors")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=10)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as tmp:
        base = f"{tmp}/base"
        t0 = time.monotonic()
        ranks, lines = _launch(_flags(base, a.steps, a.seq_len))
        _finish(ranks, lines)
        start = next(t for t, line in lines if line.startswith("step    1"))
        train_s = lines[-1][0] - start  # the training phase, from step 1's line to the end
        reference, weights = _losses(base), _weights(base)
        print(f"reference: {a.steps} steps, training phase {train_s:.1f} s after {start - t0:.1f} s of start-up; "
              f"each kill U(0, {train_s:.1f}) s after step 1's line\n")
        print("| trial | aimed | killed at (s after step 1) | inside a save | resumed from | steps once, losses equal | weights equal |")
        print("|---|---|---|---|---|---|---|")
        passed = 0
        for trial in range(a.trials):
            root = f"{tmp}/t{trial}"
            ranks, lines = _launch(_flags(root, a.steps, a.seq_len))
            while not any(line.startswith("step    1") for _, line in lines):
                if any(r.poll() is not None for r in ranks):
                    raise RuntimeError("".join(line for _, line in lines)[-3000:])
                time.sleep(0.01)
            t_step1 = time.monotonic()
            if trial % 2:  # aim inside the save of a random step
                partial = f"{root}/ckpt/.partial-step{rng.randint(1, a.steps - 1)}"
                while not os.path.exists(partial) and all(r.poll() is None for r in ranks):
                    time.sleep(0.0005)
                time.sleep(rng.uniform(0, 0.02))
            else:
                time.sleep(rng.uniform(0, train_s))
            delay = time.monotonic() - t_step1
            for rank in ranks:
                rank.send_signal(signal.SIGKILL)
            for rank in ranks:
                rank.wait()
            inside = bool([d for d in os.listdir(f"{root}/ckpt") if d.startswith(".partial")]) if os.path.isdir(f"{root}/ckpt") else False
            ranks, lines = _launch(_flags(root, a.steps, a.seq_len) + ["--resume", "latest"])
            out = _finish(ranks, lines)
            resumed = next((line.split()[2] for line in out.splitlines() if line.startswith("--resume: checkpoint ")), "none (fresh)")
            same = _losses(root) == reference
            equal = all((w == weights[k]).all().item() for k, w in _weights(root).items()) and set(_weights(root)) == set(weights)
            passed += same and equal
            print(f"| {trial + 1} | {'inside a save' if trial % 2 else 'at random'} | {delay:.3f} | {'yes' if inside else 'no'} | {resumed} | {'yes' if same else 'NO'} | {'yes' if equal else 'NO'} |",
                  flush=True)
        print(f"\n{passed} of {a.trials} trials resumed to the reference's losses and weights")
        sys.exit(0 if passed == a.trials else 1)


if __name__ == "__main__":
    main()
