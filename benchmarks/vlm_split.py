"""An image-text model under SP: what each rank's vision tower encodes, its peak memory up to the
text decoder, and the step time. A tiny fp32 Qwen2-VL (the tests' config, text width 32 or --hidden)
on one row of 16 images of 16 tokens each between text (512 tokens), at each P: vision tower calls
and patch rows per rank per step, the per-rank peak bytes (``peak_until``) of the embed-and-merge
step (from the model's call to its decoder's input, autograd recording), and the median step time
(shard_batch, forward, sp_cross_entropy, backward) over 5 steps after one warm-up, on gloo ranks.

    python benchmarks/vlm_split.py --ranks 1,2,4
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/vlm_cases.py builds the tiny model

IMAGES, STEPS = 16, 5


def rank_main(rank: int, world: int, hidden: int) -> dict:
    import ulysses_sp as usp
    from tests.vlm_cases import _qwen2_vl, embed_memory_row
    from ulysses_sp.models.image_text import text_decoder
    from ulysses_sp.testing.memory import peak_until

    torch.manual_seed(0)
    model = _qwen2_vl(hidden)
    batch = {k: v.float() if v.is_floating_point() else v for k, v in embed_memory_row(IMAGES, torch.Generator().manual_seed(0)).items()}
    topo = usp.init_sequence_parallel(world)
    usp.apply_sequence_parallel(model, topo)
    peak, _ = peak_until(text_decoder(model), lambda: model(**usp.model_inputs(usp.shard_batch(batch, topo))))
    calls, rows = [0], [0]

    def count(module, args, kwargs):
        calls[0] += 1
        rows[0] += args[0].shape[0]

    model.model.visual.register_forward_pre_hook(count, with_kwargs=True)
    times = []
    for _ in range(STEPS + 1):
        start = time.perf_counter()
        local = usp.shard_batch(batch, topo)
        usp.sp_cross_entropy(model(**usp.model_inputs(local)).logits, local["shift_labels"], topo).backward()
        times.append(time.perf_counter() - start)
    return {"calls": calls[0] / (STEPS + 1), "rows": rows[0] / (STEPS + 1), "step_ms": 1000 * statistics.median(times[1:]),
            "tokens": batch["input_ids"].shape[1], "peak": peak}


def main() -> None:
    from ulysses_sp.launch import run_ranks

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", default="1,2,4", help="comma-separated world sizes")
    parser.add_argument("--hidden", type=int, default=32, help="the text decoder's width")
    args = parser.parse_args()
    print("| P | tokens | vision calls per rank per step | patch rows per rank per step | embed-and-merge peak per rank | step (median, slowest rank) |")
    print("|---|---|---|---|---|---|")
    for world in (int(w) for w in args.ranks.split(",")):
        results = run_ranks(rank_main, world, args.hidden)
        rows = sorted({r["rows"] for r in results})
        print(f"| {world} | {results[0]['tokens']} | {max(r['calls'] for r in results):g} | {', '.join(f'{x:g}' for x in rows)} | "
              f"{max(r['peak'] for r in results) / 2**20:.2f} MiB | {max(r['step_ms'] for r in results):.0f} ms |")


if __name__ == "__main__":
    main()
