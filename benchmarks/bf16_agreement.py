"""SP in bf16 beside one process in bf16, each against one process in fp64, for families whose attention runs under a
strategy of its own (DeepSeek Sparse Attention's ``indexed``, DeepSeek-V4's ``compressed``: their attention is computed
by ulysses_sp's code, not transformers' eager, so it rounds differently). Each family's default config shrunk, weights
drawn in fp64 and loaded into the model built in bf16 (its float32 modules kept), random tokens: the loss's relative
error, and each parameter's gradient's (max abs difference over max abs), median and worst over the parameters.

    python benchmarks/bf16_agreement.py --ranks 2,4 --out benchmarks/results/bf16_agreement.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def _rank(rank: int, world: int, names: list) -> list:
    import torch
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    import ulysses_sp as usp
    from ulysses_sp.models import verify
    from ulysses_sp.models.shrink import shrink_config

    topo = usp.init_sequence_parallel(world, timeout=120)
    rows = []
    for name in names:
        config = shrink_config(CONFIG_MAPPING[name]())
        exact = verify._build(config, topo.device, 0)
        data = verify._batch(config, 12 * world + 5, False, 1)
        truth = verify._grads(exact, verify._one_process_loss(exact, data, topo.device))
        low = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, experts_implementation="eager")
        low.load_state_dict(exact.state_dict())
        low.train()
        one = verify._grads(low, verify._one_process_loss(low, data, topo.device))
        floor = 1e-6 * max(g.abs().max().item() for g in truth[1] if g is not None)
        alone = {n: verify._rel(g.double(), t, floor) for (n, _), g, t in zip(low.named_parameters(), one[1], truth[1]) if g is not None and t is not None}
        sp_loss, split, _, mixers = verify._one_run(low, topo, data, truth, "auto", "auto", "auto")
        both = [n for n in alone if n in split]
        rows.append({"family": name, "strategies": sorted(set(mixers.values())),
                     "loss": (abs(one[0].item() - truth[0].item()) / abs(truth[0].item()), sp_loss),
                     "median": (statistics.median(alone[n] for n in both), statistics.median(split[n] for n in both)),
                     "worst": (max(alone[n] for n in both), max(split[n] for n in both))})
    return rows


def main() -> None:
    import datetime

    import torch
    import transformers

    from ulysses_sp.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--families", default="deepseek_v32,hy_v4,deepseek_v4")
    p.add_argument("--out", help="also write the table there")
    a = p.parse_args()
    names = a.families.split(",")
    lines = [f"# python benchmarks/bf16_agreement.py --ranks {a.ranks} --families {a.families}",
             f"# {datetime.date.today().isoformat()}, transformers {transformers.__version__}, torch {torch.__version__}, gloo CPU ranks",
             "| family | P | strategy | loss error: one process / SP | gradient error, median: one process / SP | worst: one process / SP |",
             "|---|---|---|---|---|---|"]
    for world in (int(w) for w in a.ranks.split(",")):
        for r in run_ranks(_rank, world, names, timeout=900)[0]:
            lines.append(f"| {r['family']} | {world} | {'/'.join(r['strategies'])} | " + " | ".join(f"{x:.1e} / {y:.1e}" for x, y in
                                                                                             (r["loss"], r["median"], r["worst"])) + " |")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
