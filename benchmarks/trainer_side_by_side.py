"""The same tiny model, the same data, the same steps, four ways (issue 17):

1. ``reference``: ``transformers.Trainer`` on one process;
2. ``ulysses_sp``: our ``SequenceParallelTrainer``, SP=2 on 2 CPU ranks (DDP), and ``ulysses_sp-zero2``
   the same under DeepSpeed ZeRO-2 (like for like with 3);
3. ``hf-deepspeed-sp``: accelerate / transformers' own ``ParallelismConfig(sp_backend="deepspeed", sp_size=2)``
   (DeepSpeed-Ulysses through ``TrainingArguments(deepspeed=...)``, ZeRO-2), where it runs on CPU;
4. ``ulysses_sp-auto-3heads``: our trainer with ``sp_backend="auto"`` on the same model with 3 heads,
   which Ulysses cannot split over 2 ranks (compared with its own one-process reference); and,
   for the record, accelerate's path on that model (``hf-deepspeed-sp-3heads``).

Reports each run's largest loss deviation from its reference over the steps, and the seconds of
``train()`` (HF's train_runtime, slowest rank), as a table; writes
``benchmarks/results/trainer-side-by-side.json``. A run that cannot run says why.

    python benchmarks/trainer_side_by_side.py [--steps 20] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the ranks import this module by name
RESULTS = ROOT / "benchmarks" / "results" / "trainer-side-by-side.json"
VOCAB = 64


class Sequences(torch.utils.data.Dataset):
    """Arithmetic token sequences (stride 1-3) with 10% noise; the last quarter's targets ignored
    in every other sample (uneven valid-token counts)."""

    def __init__(self, n: int, seq: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            start, stride = torch.randint(0, VOCAB, (2,), generator=g).tolist()
            ids = (start + (stride % 3 + 1) * torch.arange(seq)) % VOCAB
            ids = torch.where(torch.rand(seq, generator=g) < 0.1, torch.randint(0, VOCAB, (seq,), generator=g), ids)
            labels = ids.clone()
            if i % 2:
                labels[-seq // 4:] = -100
            # position_ids: DeepSpeed's SP dataloader adapter insists on them (the same for every way)
            self.items.append({"input_ids": ids, "labels": labels, "position_ids": torch.arange(seq)})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_llama(heads: int):
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=heads,
        num_key_value_heads=heads if heads % 2 else heads // 2, head_dim=16, max_position_embeddings=4096,
        attention_dropout=0.0, use_cache=False,
    )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def training_args(opts, out: str) -> dict:
    return dict(
        output_dir=out, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_steps=opts["steps"], learning_rate=1e-3,
        lr_scheduler_type="constant", logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, seed=0,
    )


ZERO2 = {"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
         "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9}


def _result(trainer) -> dict:
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    runtime = next(h["train_runtime"] for h in trainer.state.log_history if "train_runtime" in h)
    return {"losses": losses, "train_seconds": runtime}


def run(rank: int, world: int, way: str, opts: dict) -> dict:
    """One way on this rank (spawned by ulysses_sp.launch.run_ranks)."""
    import transformers

    transformers.logging.set_verbosity_error()
    heads = 3 if way.endswith("3heads") else 4
    data = Sequences(opts["steps"] * 2 * 2, opts["seq"], seed=0)
    with tempfile.TemporaryDirectory() as out:
        if way.startswith("reference"):
            from transformers import Trainer, TrainingArguments

            trainer = Trainer(model=tiny_llama(heads), args=TrainingArguments(**training_args(opts, out)), train_dataset=data)
        elif way.startswith("hf-deepspeed-sp"):
            from accelerate.parallelism_config import ParallelismConfig
            from accelerate.utils import DeepSpeedSequenceParallelConfig
            from transformers import Trainer, TrainingArguments

            from ulysses_sp.integrations.deepspeed import use_cpu_accelerator_if_needed

            use_cpu_accelerator_if_needed()
            import deepspeed

            deepspeed.init_distributed(dist_backend="gloo")  # wraps our gloo group (its launcher would do this)
            pc = ParallelismConfig(sp_backend="deepspeed", sp_size=2,
                                   sp_handler=DeepSpeedSequenceParallelConfig(sp_seq_length=opts["seq"], sp_attn_implementation="sdpa"))
            args = TrainingArguments(**training_args(opts, out), deepspeed=dict(ZERO2), parallelism_config=pc)
            trainer = Trainer(model=tiny_llama(heads), args=args, train_dataset=data)
        else:
            from ulysses_sp.integrations.trainer import SequenceParallelTrainer, SequenceParallelTrainingArguments

            extra = {"deepspeed": dict(ZERO2)} if way.endswith("zero2") else {}
            args = SequenceParallelTrainingArguments(**training_args(opts, out), sp_size=2, sp_backend="auto" if "auto" in way else "ulysses", **extra)
            trainer = SequenceParallelTrainer(model=tiny_llama(heads), args=args, train_dataset=data)
        trainer.train()
        result = _result(trainer)
        if hasattr(trainer, "_sp_model"):
            result["backends"] = sorted({b.name for m in trainer._sp_model.modules() if "_ulysses_sp_attention" in m.__dict__
                                         for b in m.__dict__["_ulysses_sp_attention"]._chosen.values()})
    return result


WAYS = {  # name: (ranks, reference it is compared with)
    "reference": (1, "reference"),
    "ulysses_sp": (2, "reference"),
    "ulysses_sp-zero2": (2, "reference"),  # ours under the same DeepSpeed ZeRO-2 as accelerate's path
    "hf-deepspeed-sp": (2, "reference"),
    "reference-3heads": (1, "reference-3heads"),
    "ulysses_sp-auto-3heads": (2, "reference-3heads"),
    "hf-deepspeed-sp-3heads": (2, "reference-3heads"),  # what accelerate's path does with the same model
}


def _why(error: str) -> str:
    """The last line of the innermost traceback: the exception that stopped the run."""
    lines = [line for line in error.strip().splitlines() if line.strip()]
    return next((line.strip() for line in reversed(lines) if "Error" in line or "error" in line), lines[-1].strip())


def main(argv=None) -> None:
    from ulysses_sp.launch import RankFailure, run_ranks

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--ways", default=",".join(WAYS), help="comma-separated subset (a compared run needs its reference)")
    a = p.parse_args(argv)
    chosen = a.ways.split(",")
    opts = {"steps": a.steps, "seq": a.seq, "load_average_1_5_15_min_at_start": os.getloadavg()}
    results = {}
    for way, (ranks, _) in WAYS.items():
        if way not in chosen:
            results[way] = {"ok": False, "ranks": ranks, "why": "not run (--ways)"}
            continue
        try:
            per_rank = run_ranks(run, ranks, way, opts, timeout=600)
            results[way] = {"ok": True, "ranks": ranks, "losses": per_rank[0]["losses"],
                            "train_seconds": max(r["train_seconds"] for r in per_rank), "backends": per_rank[0].get("backends")}
        except RankFailure as e:
            results[way] = {"ok": False, "ranks": ranks, "why": _why(str(e)), "error": str(e)[-3000:]}
        except Exception:  # noqa: BLE001 - recorded as the reason this way cannot run
            results[way] = {"ok": False, "ranks": ranks, "why": traceback.format_exc().strip().splitlines()[-1]}
    rows = []
    for way, (ranks, ref) in WAYS.items():
        r = results[way]
        if r["ok"] and results[ref]["ok"]:
            r["max_loss_deviation"] = max(abs(x - y) for x, y in zip(r["losses"], results[ref]["losses"]))
        rows.append((way, ranks, ref, r))
    print(f"\n{a.steps} steps x 2 micro-batches of 2 x {a.seq} tokens, tiny Llama (2 layers, 4 or 3 heads), fp32, AdamW, CPU")
    print("| run | ranks | reference | max loss deviation | train s | backends / why not |\n|---|---|---|---|---|---|")
    for way, ranks, ref, r in rows:
        if r["ok"]:
            dev = f"{r['max_loss_deviation']:.2e}" if way != ref else "-"
            print(f"| {way} | {ranks} | {ref} | {dev} | {r['train_seconds']:.2f} | {', '.join(r['backends'] or []) or '-'} |")
        else:
            print(f"| {way} | {ranks} | {ref} | - | - | cannot run: {r['why']} |")
    import accelerate
    import deepspeed
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "accelerate": accelerate.__version__, "deepspeed": deepspeed.__version__, "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_average_1_5_15_min_at_end": os.getloadavg()}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"command": "python benchmarks/trainer_side_by_side.py " + " ".join(argv or sys.argv[1:]),
                                       "options": opts, "environment": env, "runs": results}, indent=1))
    print(f"written to {a.out}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
