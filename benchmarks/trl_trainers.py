"""TRL's trainers under SP on CPU: each trainer's time and peak memory per rank at SP=1 and SP=2 on
the embedded tiny Llama (issue 47), and the longest GRPO completion whose training step fits a
memory budget with and without SP.

Time: ``train()`` seconds of ``--steps`` optimizer steps (slowest rank). Peak: the largest bytes of
tensors alive at once during one more optimizer step, counted by ``ulysses_sp.testing.memory.PeakMemory``
(activations, gradients, optimizer states, communication buffers; not the weights loaded before).
GRPO's completions come from a seeded stand-in for ``generate`` (every completion exactly
``--completion`` tokens), so the step's training forward and backward are what is measured; real
generation runs on whole sequences on every rank and SP does not shrink it.

    python benchmarks/trl_trainers.py [--steps 3] [--seq 2048] [--budget-completion 2048]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results" / "trl-trainers.json"
WORDS = 40


def _words(rng: random.Random, n: int) -> str:
    start = rng.randrange(WORDS)
    return " ".join(f"w{(start + 3 * i + (rng.random() < 0.1)) % WORDS}" for i in range(n))


def _model_dir() -> str:
    import torch.distributed as dist

    from ulysses_sp.testing.tiny_checkpoint import write_tiny_llama

    path = os.path.join(tempfile.gettempdir(), "ulysses-sp-bench-trl-model")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        write_tiny_llama(path)
    dist.barrier()
    return path


def _fixed_generate(model, length: int):
    def generate(input_ids=None, attention_mask=None, **kwargs):
        g = torch.Generator().manual_seed(int(input_ids.sum()))
        return torch.cat([input_ids, torch.randint(3, WORDS + 3, (input_ids.shape[0], length), generator=g)], dim=1)

    model.generate = generate


def _trainer(kind: str, sp: int, seq: int, completion: int, steps: int, out: str):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ulysses_sp.integrations import trl as usp_trl

    path = _model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    rng = random.Random(0)
    common = dict(output_dir=out, per_device_train_batch_size=1, gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-4,
                  logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, seed=0, bf16=False,
                  gradient_checkpointing=False, sp_size=sp, sp_backend="ulysses")
    if kind == "sft":
        data = Dataset.from_list([{"prompt": _words(rng, seq // 4), "completion": " " + _words(rng, seq - seq // 4 - 1)} for _ in range(8)])
        args = usp_trl.SequenceParallelSFTConfig(**common, max_length=None)
        return usp_trl.SequenceParallelSFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    if kind == "dpo":
        data = Dataset.from_list([{"prompt": _words(rng, seq // 4), "chosen": " " + _words(rng, seq // 2), "rejected": " " + _words(rng, seq // 2)}
                                  for _ in range(8)])
        args = usp_trl.SequenceParallelDPOConfig(**common, max_length=None)
        return usp_trl.SequenceParallelDPOTrainer(model=model, ref_model=AutoModelForCausalLM.from_pretrained(path), args=args,
                                                  train_dataset=data, processing_class=tok)
    _fixed_generate(model, completion)
    data = Dataset.from_list([{"prompt": _words(rng, 32)} for _ in range(16)])
    args = usp_trl.SequenceParallelGRPOConfig(**dict(common, per_device_train_batch_size=2), num_generations=2,
                                              max_completion_length=completion, beta=0.0)
    reward = lambda completions, **kw: [float(len(c)) % 7 for c in completions]  # noqa: E731 - any reward that differs in a group
    return usp_trl.SequenceParallelGRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok)


def run(rank: int, world: int, kind: str, seq: int, completion: int, steps: int) -> dict:
    from ulysses_sp.testing.memory import PeakMemory

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(suffix=f"-{rank}") as out:
        timed = _trainer(kind, world, seq, completion, steps, out)
        start = time.perf_counter()
        timed.train()
        seconds = time.perf_counter() - start
        measured = _trainer(kind, world, seq, completion, 1, out)
        with PeakMemory() as peak:
            measured.train()
    return {"seconds": seconds, "peak": peak.peak}


def _on_ranks(kind, sp, seq, completion, steps) -> dict:
    from ulysses_sp.launch import run_ranks

    got = run_ranks(run, sp, kind, seq, completion, steps, timeout=1800)
    return {"seconds": max(r["seconds"] for r in got), "peak_mib": max(r["peak"] for r in got) / 2**20}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=2048, help="tokens per SFT sample and per DPO prompt + reply")
    p.add_argument("--completion", type=int, default=1024, help="GRPO completion tokens in the time/peak table")
    p.add_argument("--budget-completion", type=int, default=2048, help="the budget: SP=1's peak at this completion length")
    a = p.parse_args(argv)
    rows = {}
    for kind in ("sft", "dpo", "grpo"):
        for sp in (1, 2):
            rows[f"{kind}/sp{sp}"] = _on_ranks(kind, sp, a.seq, a.completion, a.steps)
            print(f"{kind:5s} SP={sp}: {rows[f'{kind}/sp{sp}']['seconds']:6.1f} s  peak {rows[f'{kind}/sp{sp}']['peak_mib']:7.1f} MiB per rank", flush=True)
    budget = _on_ranks("grpo", 1, a.seq, a.budget_completion, 1)["peak_mib"]
    longest = {1: a.budget_completion}
    length, fits = a.budget_completion, True
    while fits and length * 5 // 4 + 64 <= 16384:  # the tiny model's positions
        length = length * 5 // 4 // 64 * 64
        fits = _on_ranks("grpo", 2, a.seq, length, 1)["peak_mib"] <= budget
        if fits:
            longest[2] = length
    print(f"GRPO: budget {budget:.1f} MiB (SP=1's step at {a.budget_completion} completion tokens); longest completion within it, "
          f"in steps of 1.25x: SP=1 {longest[1]}, SP=2 {longest.get(2, 'none above SP=1')}", flush=True)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"args": vars(a), "rows": rows, "budget_mib": budget, "longest_completion": longest}, indent=1))


if __name__ == "__main__":
    main()
