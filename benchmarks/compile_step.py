"""Step time of the main job with ``--compile`` against eager, on CPU ranks.

For each length and form: the job (the embedded model and task, ``--sp-size`` ranks, fp32) runs
2 x ``--steps`` optimizer steps, each timed on every rank after a barrier (the slowest rank's
time counts). The first step holds the compilation; the timed ones are the second half, where
the task's documents fill whole rows (its schedule grows them until half the steps), so every
timed step does the same work. The table gives the first step, the median of the timed ones and
the eager median over the compiled one. The forms alternate for ``--rounds`` rounds (this VM
drifts between runs), each round's ratio from its own pair. Both forms start from the same seed:
their losses are compared too.

    python benchmarks/compile_step.py --seq-lens 4096,16384 [--json benchmarks/results/compile-step.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def measure(rank: int, world: int, seq_len: int, compiled: bool, backend: str, steps: int) -> dict:
    import torch.distributed as dist

    from ulysses_sp.job import Job, TrainConfig

    job = Job(TrainConfig(sp_size=world, seq_len=seq_len, steps=2 * steps, sp_backend=backend, compile=compiled))
    times, losses = [], []
    for step in range(2 * steps):
        dist.barrier()
        start = time.perf_counter()
        losses.append(job.step(step))
        times.append(time.perf_counter() - start)
    job.close()
    return {"times": times, "losses": losses}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="4096,16384")
    p.add_argument("--sp-size", type=int, default=2)
    p.add_argument("--backend", default="auto")
    p.add_argument("--steps", type=int, default=10, help="timed steps (the job runs twice as many)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None)
    a = p.parse_args()

    from ulysses_sp.launch import run_ranks

    rows = []
    for seq_len in (int(x) for x in a.seq_lens.split(",")):
        for round_ in range(1, a.rounds + 1):
            forms = {}
            for compiled in (False, True):
                ranks = run_ranks(measure, a.sp_size, seq_len, compiled, a.backend, a.steps, timeout=3600)
                slowest = [max(t) for t in zip(*(r["times"] for r in ranks))]
                forms[compiled] = {"first_s": slowest[0], "median_s": statistics.median(slowest[a.steps:]), "losses": ranks[0]["losses"]}
            eager, comp = forms[False], forms[True]
            rows.append({"seq_len": seq_len, "round": round_, "sp_size": a.sp_size, "backend": a.backend, "eager": eager, "compiled": comp,
                         "speedup": eager["median_s"] / comp["median_s"],
                         "max_loss_difference": max(abs(x - y) for x, y in zip(eager["losses"], comp["losses"]))})
            r = rows[-1]
            print(f"{seq_len:>7} tokens, SP={a.sp_size}, round {round_}: eager {eager['median_s'] * 1e3:8.1f} ms/step "
                  f"(first {eager['first_s']:.1f} s), compiled {comp['median_s'] * 1e3:8.1f} ms/step (first {comp['first_s']:.1f} s): "
                  f"x{r['speedup']:.2f}; losses within {r['max_loss_difference']:.1e}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python benchmarks/compile_step.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items()
                                                                              if k != "json" and v is not None),
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
