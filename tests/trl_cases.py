"""Cases for tests/test_trl.py: TRL's SFT, DPO and GRPO trainers on one process (the reference) and
ulysses_sp's on SP (x DP) ranks, on the same tiny models, data and completions (run inside the pool's ranks).

Training is SGD without clipping unless a case says otherwise: Adam would hide a gradient off by a
constant factor (a loss scaled by the SP or DP size), SGD does not. Every case returns the logged
metrics of every step and the parameters after training.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback

import torch

STEPS, GA, LR = 2, 2, 0.5
WORDS = 40
"""The tiny tokenizer's words (ulysses_sp.testing.tiny_checkpoint): w0 .. w39."""


def _text(g: torch.Generator, n: int) -> str:
    start = int(torch.randint(0, WORDS, (1,), generator=g))
    return " ".join(f"w{(start + i * 3 + int(torch.randint(0, 2, (1,), generator=g))) % WORDS}" for i in range(n))


def _lengths(g, lo, hi) -> int:
    return int(torch.randint(lo, hi, (1,), generator=g))


def preference_rows(n: int, seed: int = 0, uneven: bool = False) -> list[dict]:
    """Prompt, chosen and rejected texts of different lengths; one pair with a 1-word rejected reply.
    ``uneven``: as real preference data, lengths that differ 10x and more within a pair and across
    pairs (prompts 2 to 40 words, replies alternately 2 to 6 and 20 to 40)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        if uneven:
            short, long = " " + _text(g, _lengths(g, 2, 6)), " " + _text(g, _lengths(g, 20, 40))
            rows.append({"prompt": _text(g, _lengths(g, 2, 40)), "chosen": short if i % 2 else long, "rejected": long if i % 2 else short})
        else:
            rows.append({"prompt": _text(g, _lengths(g, 3, 12)), "chosen": " " + _text(g, _lengths(g, 2, 14)),
                         "rejected": " " + _text(g, 1 if i == 1 else _lengths(g, 2, 14))})
    return rows


def completion_rows(n: int, seed: int = 0, uneven: bool = False) -> list[dict]:
    """``uneven``: completions of 2 to 4 words and of 30 to 40, in turn."""
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": _text(g, _lengths(g, 3, 12)),
             "completion": " " + _text(g, _lengths(g, *((2, 4) if i % 2 else (30, 40))) if uneven else _lengths(g, 2, 20))} for i in range(n)]


def prompt_rows(n: int, seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"prompt": _text(g, _lengths(g, 2, 9))} for _ in range(n)]


def _tiny(family: str, path: str):
    """The tiny model of ``family`` and its tokenizer, saved in ``path`` and loaded back (TRL's GRPO loads
    its reference model from the policy's path)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ulysses_sp.testing import tiny_checkpoint

    if not os.path.exists(os.path.join(path, "config.json")):
        if family == "llama":
            tiny_checkpoint.write_tiny_llama(path)
        else:  # a hybrid of tests/model_families.py, with the tiny tokenizer
            from .model_families import config

            tiny_checkpoint._tokenizer().save_pretrained(path)
            torch.manual_seed(0)
            AutoModelForCausalLM.from_config(config(family, vocab_size=48, pad_token_id=1, eos_token_id=2, bos_token_id=None)).save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _rows(case: dict) -> int:
    """The rows the steps read: steps x accumulation x batch x DP groups."""
    return STEPS * case.get("ga", GA) * case.get("batch", 2) * case.get("dp", 1)


def _common(case: dict, out: str, world: int = 1) -> dict:
    return dict(
        output_dir=out, per_device_train_batch_size=case.get("batch", 2) * (case.get("dp", 1) if world == 1 else 1),
        gradient_accumulation_steps=case.get("ga", GA), max_steps=STEPS, learning_rate=case.get("lr", LR), lr_scheduler_type="constant",
        optim=case.get("optim", "sgd"), max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, disable_tqdm=True, seed=0, dataloader_num_workers=0, bf16=False, fp16=False,
    )


def _logged(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if isinstance(v, float)} for h in trainer.state.log_history if "train_runtime" not in h]


def _evaluated(trainer) -> dict:
    """``evaluate()``'s numbers after training (on the held-out rows)."""
    return {k: v for k, v in trainer.evaluate().items() if isinstance(v, float) and "runtime" not in k and "per_second" not in k}


def _params(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _dpo(case: dict, sp: bool, out: str, path: str) -> dict:
    from datasets import Dataset

    model, tok = _tiny(case["family"], path)
    initial = _params(model)
    ref, _ = _tiny(case["family"], path)
    kwargs = dict(_common(case, out, 2 if sp else 1), beta=0.5, loss_type=case.get("loss_type", ["sigmoid"]),
                  ld_alpha=case.get("ld_alpha"), train_sampling_strategy="sequential", **case.get("args", {}))
    data = Dataset.from_list(preference_rows(_rows(case), uneven=case.get("uneven", False)))
    evaluation = Dataset.from_list(preference_rows(4, seed=5))
    kwargs["per_device_eval_batch_size"] = 2 * (1 if sp else case.get("dp", 1))
    if sp:
        from ulysses_sp.integrations.trl import SequenceParallelDPOConfig, SequenceParallelDPOTrainer

        args = SequenceParallelDPOConfig(**kwargs, sp_size=case["sp"], sp_backend=case.get("backend", "auto"))
        with per_rank_sums() if case.get("per_rank") else mis_scaled(case["mis_scaled"]) if "mis_scaled" in case else contextlib.nullcontext():
            by_path = case.get("by_path")  # the models as TRL's docs give them: a path each, loaded by the trainer
            trainer = SequenceParallelDPOTrainer(model=path if by_path else model, ref_model=path if by_path else ref, args=args,
                                                 train_dataset=data, eval_dataset=evaluation, processing_class=tok)
            trainer.train()
            return {"logged": _logged(trainer), "params": _params(trainer.model), "initial": initial, "eval": _evaluated(trainer)}
    else:
        from trl import DPOConfig, DPOTrainer

        trainer = DPOTrainer(model=model, ref_model=ref, args=DPOConfig(**kwargs), train_dataset=data, eval_dataset=evaluation,
                             processing_class=tok)
    trainer.train()
    return {"logged": _logged(trainer), "params": _params(trainer.model), "initial": initial, "eval": _evaluated(trainer)}


@contextlib.contextmanager
def per_rank_sums():
    """The bug the gathered log-probabilities guard against: each rank's sequence sums over its own tokens
    only (every other rank's log-probabilities read as 0), as a per-rank loss would."""
    from ulysses_sp.integrations import trl as module

    whole = module.gather_sequence

    def own_only(x, topo, dim=1, cu_seqlens=None):
        mine = whole(torch.full_like(x, topo.sp_rank, dtype=torch.float32), topo, dim, cu_seqlens) == topo.sp_rank
        return whole(x, topo, dim, cu_seqlens) * mine.to(x.dtype)

    module.gather_sequence = own_only
    try:
        yield
    finally:
        module.gather_sequence = whole


@contextlib.contextmanager
def mis_scaled(factor: float):
    """One micro-batch's gradient (the second training forward's) scaled by ``factor``: what a wrong
    loss scale under accumulation would do to one micro-batch of the window."""
    from ulysses_sp.integrations.trl import _FusedHeadTrainer

    right, calls = _FusedHeadTrainer._token_grad_scale, []

    def scale(self):
        calls.append(None)
        return right(self) * (factor if len(calls) == 2 else 1.0)

    _FusedHeadTrainer._token_grad_scale = scale
    try:
        yield
    finally:
        _FusedHeadTrainer._token_grad_scale = right


def _sft(case: dict, sp: bool, out: str, path: str) -> dict:
    from datasets import Dataset

    model, tok = _tiny(case["family"], path)
    initial = _params(model)
    kwargs = dict(_common(case, out, 2 if sp else 1), packing=case.get("packing", False), padding_free=case.get("padding_free", False),
                  train_sampling_strategy="sequential", max_length=64 if case.get("packing") else None, **case.get("args", {}))
    rows = completion_rows(_rows(case) * (4 if case.get("packing") else 1), uneven=case.get("uneven", False))  # packed: more rows than the steps read
    data = Dataset.from_list(rows)
    if sp:
        from ulysses_sp.integrations.trl import SequenceParallelSFTConfig, SequenceParallelSFTTrainer

        args = SequenceParallelSFTConfig(**kwargs, sp_size=case["sp"], sp_backend=case.get("backend", "auto"))
        trainer = SequenceParallelSFTTrainer(model=path if case.get("by_path") else model, args=args, train_dataset=data, processing_class=tok)
    else:
        from trl import SFTConfig, SFTTrainer

        trainer = SFTTrainer(model=model, args=SFTConfig(**kwargs), train_dataset=data, processing_class=tok)
    trainer.train()
    return {"logged": _logged(trainer), "params": _params(trainer.model), "initial": initial, "layout": getattr(getattr(trainer, "topo", None), "layout", None)}


def _reward(completions, **kwargs) -> list[float]:
    """A reward that differs within every group: the completion's words ``w{k}`` with k even, counted."""
    return [float(sum(int(w[1:]) % 2 == 0 for w in c.split() if w[1:].isdigit())) for c in completions]


def fixed_generate(model, rank_noise: bool, length: int = 10):
    """``model.generate`` replaced by completions of 2 to ``length - 1`` words and end-of-sequence padding to
    ``length``, drawn from a generator seeded by each prompt's tokens and its occurrence in the batch (the same
    completions however the batch is split over ranks); with ``rank_noise``, ranks other than 0 draw others
    (what sampling on diverging RNG streams would do)."""
    import torch.distributed as dist

    def generate(input_ids=None, attention_mask=None, **kwargs):
        seen, rows = {}, []
        extra = dist.get_rank() if rank_noise and dist.is_initialized() else 0
        for ids, m in zip(input_ids.tolist(), attention_mask.tolist()):
            key = tuple(i for i, keep in zip(ids, m) if keep)
            seen[key] = seen.get(key, -1) + 1
            g = torch.Generator().manual_seed(hash(key) % (1 << 31) + 1000 * seen[key] + 7919 * extra)
            n = int(torch.randint(2, length, (1,), generator=g))
            rows.append(torch.cat([torch.randint(3, WORDS + 3, (n,), generator=g), torch.tensor([2] * (length - n))]))
        return torch.cat([input_ids, torch.stack(rows).to(input_ids.device)], dim=1)

    model.generate = generate


def _grpo(case: dict, sp: bool, out: str, path: str) -> dict:
    from datasets import Dataset

    model, tok = _tiny(case["family"], path)
    initial = _params(model)
    kwargs = dict(_common(case, out, 2 if sp else 1), num_generations=2, max_completion_length=case.get("length", 10),
                  beta=case.get("beta", 0.1),
                  loss_type=case.get("loss_type", "grpo"), shuffle_dataset=False, **case.get("args", {}))
    data = Dataset.from_list(prompt_rows(_rows(case)))
    evaluation = Dataset.from_list(prompt_rows(4, seed=5))  # 2 prompts x 2 generations: batches of 2 rows (a prompt) per DP group
    kwargs["per_device_eval_batch_size"] = 2 * (1 if sp else case.get("dp", 1))  # one process: the DP groups' batches at once
    seen = []
    if sp:
        from ulysses_sp.integrations.trl import SequenceParallelGRPOConfig, SequenceParallelGRPOTrainer as cls

        args = SequenceParallelGRPOConfig(**kwargs, sp_size=case["sp"], sp_backend=case.get("backend", "auto"))
    else:
        from trl import GRPOConfig, GRPOTrainer as cls

        args = GRPOConfig(**kwargs)

    class Recording(cls):
        def _generate_single_turn(self, *a, **k):
            got = super()._generate_single_turn(*a, **k)
            seen.append(got[0])
            return got

    trainer = Recording(model=path if case.get("by_path") else model, reward_funcs=_reward, args=args, train_dataset=data,
                        eval_dataset=evaluation, processing_class=tok)
    fixed_generate(trainer.model, case.get("rank_noise", False) and sp, case.get("length", 10))
    trainer.train()
    seen_in_training = list(seen)
    return {"logged": _logged(trainer), "params": _params(trainer.model), "initial": initial, "completions": seen_in_training,
            "eval": _evaluated(trainer)}


RUNS = {"dpo": _dpo, "sft": _sft, "grpo": _grpo}


def reference(case: dict) -> dict:
    with tempfile.TemporaryDirectory() as out:
        return RUNS[case["trainer"]](case, False, out, os.path.join(out, "model"))


def sp_run(case: dict) -> dict:
    import torch.distributed as dist

    from .hf_trainer_cases import _fresh_accelerate_state, _shared_dir

    _fresh_accelerate_state()
    with tempfile.TemporaryDirectory() as out:
        out = _shared_dir(out)
        path = os.path.join(out, "model")
        if dist.get_rank() == 0:
            _tiny(case["family"], path)
        dist.barrier()
        got = RUNS[case["trainer"]](case, True, out, path)
        dist.barrier()
    return got


def guarded(fn) -> dict:
    try:
        return {"ok": True, "value": fn()}
    except Exception:  # noqa: BLE001 - reported by the test with the rank's traceback
        return {"ok": False, "error": traceback.format_exc()}


def run_references(rank: int, world: int, names) -> dict:
    torch.set_num_threads(1)
    return {name: guarded(lambda n=name: reference(REFERENCES[n])) for name in names}


def run_sp_cases(rank: int, world: int, names) -> dict:
    torch.set_num_threads(1)
    return {name: guarded(lambda n=name: sp_run(SP_CASES[world][n][1])) for name in names}



UNEVEN = {"uneven": True, "batch": 1, "ga": 4}
"""Rows of lengths that differ 10x, one pair (or row) a micro-batch, four micro-batches a step."""


def _cases() -> tuple[dict, dict]:
    """(one-process references by name, {world: {SP case name: (reference name, case)}})."""
    refs = {
        "dpo-llama": {"trainer": "dpo", "family": "llama"},
        "dpo-llama-ipo": {"trainer": "dpo", "family": "llama", "loss_type": ["ipo"]},
        "dpo-llama-ld_alpha": {"trainer": "dpo", "family": "llama", "ld_alpha": 0.5},
        "dpo-llama-dp2": {"trainer": "dpo", "family": "llama", "dp": 2},
        "dpo-llama-uneven": {"trainer": "dpo", "family": "llama", **UNEVEN},
        "dpo-llama-uneven-dp2": {"trainer": "dpo", "family": "llama", **UNEVEN, "dp": 2},
        "sft-llama-uneven": {"trainer": "sft", "family": "llama", **UNEVEN},
        "sft-llama": {"trainer": "sft", "family": "llama"},
        "sft-llama-packed": {"trainer": "sft", "family": "llama", "packing": True},
        "sft-llama-packed-adamw": {"trainer": "sft", "family": "llama", "packing": True, "optim": "adamw_torch", "lr": 1e-3},
        "sft-llama-dp2": {"trainer": "sft", "family": "llama", "dp": 2},
        "sft-llama-packed-dp2": {"trainer": "sft", "family": "llama", "packing": True, "dp": 2},
        **{f"grpo-llama-{loss}": {"trainer": "grpo", "family": "llama", "loss_type": loss} for loss in ("grpo", "dapo", "dr_grpo")},
        "grpo-qwen3_5": {"trainer": "grpo", "family": "qwen3_5"},
        "dpo-qwen3_5": {"trainer": "dpo", "family": "qwen3_5"},
        "sft-qwen3_5": {"trainer": "sft", "family": "qwen3_5"},
        "grpo-llama-dapo-dp2": {"trainer": "grpo", "family": "llama", "loss_type": "dapo", "dp": 2},
        **{f"grpo-llama-{loss}-uneven": {"trainer": "grpo", "family": "llama", "loss_type": loss, "length": 40} for loss in ("dapo", "dr_grpo")},
    }
    sp = {2: {}, 3: {}, 4: {}}
    for name in refs:
        if not name.endswith(("-dp2", "-adamw")):
            sp[2][f"{name}/sp2"] = (name, {**refs[name], "sp": 2})
    sp[2]["dpo-llama/sp2/per-rank-sums"] = ("dpo-llama", {**refs["dpo-llama"], "sp": 2, "per_rank": True})
    sp[2]["dpo-llama-uneven/sp2/mis-scaled"] = ("dpo-llama-uneven", {**refs["dpo-llama-uneven"], "sp": 2, "mis_scaled": 1.5})
    sp[2]["grpo-llama-grpo/sp2/diverging-samples"] = ("grpo-llama-grpo", {**refs["grpo-llama-grpo"], "sp": 2, "rank_noise": True})
    for name in ("dpo-llama-uneven", "sft-llama-uneven", "grpo-llama-dapo"):  # the trainers given the model's path
        sp[2][f"{name}/sp2"][1]["by_path"] = True
    for name in ("dpo-llama", "dpo-llama-uneven", "sft-llama-packed-adamw", "grpo-llama-dr_grpo"):
        sp[3][f"{name}/sp3"] = (name, {**refs[name], "sp": 3})
    for name in ("dpo-llama-dp2", "dpo-llama-uneven-dp2", "sft-llama-dp2", "sft-llama-packed-dp2", "grpo-llama-dapo-dp2"):
        sp[4][f"{name}/dp2xsp2"] = (name, {**refs[name], "sp": 2})
    return refs, sp


REFERENCES, SP_CASES = _cases()
