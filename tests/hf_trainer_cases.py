"""Cases for tests/test_hf_trainer.py: transformers.Trainer on one process (the reference) and
SequenceParallelTrainer on 2 ranks, on the same tiny models and data (run inside spawned ranks).

Training uses plain SGD without clipping: Adam (and clipping) would hide a gradient that is off
by a constant factor, SGD does not. The labels mask a different number of targets per sample,
so a per-micro-batch mean, or a count off by sp_size, changes the curve.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import traceback

import torch
from torch.distributed.fsdp import FSDPModule

STEPS, GA, SEQ = 8, 2, 45
"""8 optimizer steps of 2 micro-batches; 45 tokens, padded to 48 by shard_batch at SP=2."""
LR = 1.0


class Samples(torch.utils.data.Dataset):
    """``n`` causal-LM samples of ``SEQ`` tokens (arithmetic sequences with 10% noise, so the loss
    falls); sample i ignores a different number of targets.
    ``packed``: three documents per sample, position ids restarting at 0, and a document's first
    token is nobody's target (labels -100 there, Hugging Face's flattening convention)."""

    def __init__(self, n: int, seed: int = 0, packed: bool = False, vocab: int = 64):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for i in range(n):
            start, stride = torch.randint(0, vocab, (2,), generator=g).tolist()
            ids = (start + (stride % 3 + 1) * torch.arange(SEQ)) % vocab  # learnable: a stride of 1, 2 or 3
            noise = torch.rand(SEQ, generator=g) < 0.1
            ids = torch.where(noise, torch.randint(0, vocab, (SEQ,), generator=g), ids)
            labels = ids.clone()
            labels[: 3 * (i % 5)] = -100
            item = {"input_ids": ids, "labels": labels}
            if packed:
                cut = sorted(torch.randperm(SEQ - 2, generator=g)[:2].add(1).tolist())
                lengths = [cut[0], cut[1] - cut[0], SEQ - cut[1]]
                pos = torch.cat([torch.arange(n_) for n_ in lengths])
                item["position_ids"] = pos
                item["labels"] = labels.masked_fill(pos == 0, -100)
            self.items.append(item)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class ImageSamples(Samples):
    """:class:`Samples` over 60 text ids, each with one Qwen image: its start marker, 16 image tokens
    (no targets) and its end marker from token 3 + i % 5 on, its 64 patches and grid."""

    def __init__(self, n: int, seed: int = 0):
        from .vlm_cases import END, IMAGE, START, TOKENS, _qwen_visuals

        super().__init__(n, seed=seed, vocab=END)
        g = torch.Generator().manual_seed(seed + 1)
        for i, item in enumerate(self.items):
            at = 3 + i % 5
            ids = item["input_ids"].clone()
            ids[at], ids[at + 1:at + 1 + TOKENS], ids[at + 1 + TOKENS] = START, IMAGE, END
            item.update(input_ids=ids, labels=item["labels"].masked_fill(ids == IMAGE, -100), mm_token_type_ids=(ids == IMAGE).int(),
                        **_qwen_visuals(["image"], g))


def collate_images(items: list) -> dict:
    """Token rows stacked, Qwen's patches and grids of the batch's images concatenated (as its processor does)."""
    out = {k: torch.stack([item[k] for item in items]) for k in ("input_ids", "labels", "mm_token_type_ids")}
    return {**out, **{k: torch.cat([item[k] for item in items]) for k in ("pixel_values", "image_grid_thw")}}


def model_for(case: dict):
    from .hf_cases import _CONFIGS, tiny_model

    if case.get("images"):
        from .vlm_cases import FAMILIES

        torch.manual_seed(0)
        return FAMILIES[case["family"]][0]()
    if case["family"] in _CONFIGS:
        model = tiny_model(case["family"], **case.get("overrides", {}))
    else:  # a hybrid of tests/model_families.py
        import transformers

        from .model_families import config

        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config(case["family"], **case.get("overrides", {})))
    if case.get("lora"):
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(1)
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return model


def common_args(case: dict, out: str) -> dict:
    return dict(
        output_dir=out, per_device_train_batch_size=case.get("batch", 2), per_device_eval_batch_size=1 if case.get("packed") else 2,
        gradient_accumulation_steps=GA, max_steps=STEPS, learning_rate=case.get("lr", LR), lr_scheduler_type="constant", optim="sgd",
        max_grad_norm=0.0, weight_decay=0.0, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
        train_sampling_strategy="sequential", disable_tqdm=True, seed=0, dataloader_num_workers=0,
    )


def data_for(case: dict):
    """Exactly the samples of STEPS windows of the global batch (2 samples, 1 when packed), and 5
    eval samples (batches of 2: the last one short, and uneven over 2 DP groups)."""
    packed = case.get("packed", False)
    if case.get("images"):
        return ImageSamples(STEPS * GA * 2), ImageSamples(5, seed=9)
    return Samples(STEPS * GA * (1 if packed else 2), packed=packed), Samples(5, seed=9, packed=packed)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]


def _generate(model) -> list[int]:
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.arange(1, 6)[None], max_new_tokens=6, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def _token_mean(model, dataset) -> float:
    """The mean loss over every target token of ``dataset``, one sample at a time."""
    import torch.nn.functional as F

    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for item in dataset:
            inputs = collate_images([item]) if "pixel_values" in item else {k: v[None] for k, v in item.items()}
            inputs.pop("labels")
            logits = model(**inputs).logits[0, :-1].double()
            targets = item["labels"][1:]
            total += F.cross_entropy(logits, targets, ignore_index=-100, reduction="sum").item()
            count += (targets != -100).sum().item()
    return total / count


def _without_targets(dataset, n: int) -> list:
    """``dataset``'s samples and ``n`` more without any target: a token-weighted mean is unchanged."""
    items = [dataset[i] for i in range(len(dataset))]
    return items + [{**item, "labels": torch.full_like(item["labels"], -100)} for item in items[:n]]


def reference(case: dict) -> dict:
    """transformers.Trainer on one process: the loss per step, eval_loss, predict()'s logits, generate()."""
    from transformers import Trainer, TrainingArguments

    model = model_for(case)
    # transformers.Trainer weighs an accumulation window's micro-batches by their targets only for a model that takes
    # num_items_in_batch, and Qwen2.5-VL opts out (accepts_loss_kwargs = False, a Gemma 3 fix): a mean of micro-batch
    # means then. SequenceParallelTrainer weighs by targets for every model, so the reference does too.
    model.accepts_loss_kwargs = True
    train, evaluation = data_for(case)
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(model=model, args=TrainingArguments(**common_args(case, out)), train_dataset=train, eval_dataset=evaluation,
                          data_collator=collate_images if case.get("images") else None)
        trainer.train()
        result = {"losses": _losses(trainer), "eval_loss": trainer.evaluate()["eval_loss"], "eval_loss_tokens": _token_mean(trainer.model, evaluation)}
        if case.get("predict"):
            result["logits"] = trainer.predict(evaluation).predictions
            result["generated"] = _generate(trainer.model)
    return result


def sp_run(case: dict) -> dict:
    """SequenceParallelTrainer on this rank; what the case asks for."""
    import torch.distributed as dist

    from ulysses_sp.integrations.trainer import SequenceParallelTrainer, SequenceParallelTrainingArguments

    _fresh_accelerate_state()
    model = model_for(case)
    train, evaluation = data_for(case)
    result = {}
    trainer_class = case.get("trainer_class", SequenceParallelTrainer)
    with tempfile.TemporaryDirectory() as out:
        out = _shared_dir(out)
        kwargs = {**common_args(case, out), "sp_size": case.get("sp_size", 2), "sp_backend": case.get("backend", "ulysses"), **case.get("args", {})}
        args = SequenceParallelTrainingArguments(**kwargs)
        trainer = trainer_class(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                                data_collator=collate_images if case.get("images") else None)
        k_needs_grad = _watch_k(trainer.model) if case.get("lora") else None
        trainer.train()
        result["deepspeed"] = trainer.is_deepspeed_enabled
        result["fsdp2"] = isinstance(getattr(trainer.model_wrapped, "_orig_mod", trainer.model_wrapped), FSDPModule)
        result["layout"] = trainer.topo.layout
        result["losses"] = _losses(trainer)
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        if case.get("eval_without_targets"):  # batches of 2: the third holds one sample without targets, the fourth none
            result["eval_loss_without_targets"] = trainer.evaluate(_without_targets(evaluation, 3))["eval_loss"]
        result["chosen"] = sorted({b.name for m in trainer._sp_model.modules() if "_ulysses_sp_attention" in m.__dict__
                                   for b in m.__dict__["_ulysses_sp_attention"]._chosen.values()})
        if case.get("predict"):
            result["logits"] = trainer.predict(evaluation).predictions
            trainer.args.sp_predict_logits = "none"
            result["no_logits_error"] = _raised(lambda: trainer.predict(evaluation))
            trainer.args.sp_predict_logits = "argmax"
            result["argmax"] = trainer.predict(evaluation).predictions
            trainer.remove_sequence_parallel()
            result["generated"] = _generate(trainer.model)
            result["eval_after_remove"] = _raised(lambda: trainer.evaluate())
        if case.get("lora"):
            result["k_needs_grad"] = sorted(set(k_needs_grad))
            if case.get("save"):
                result.update(_lora_checks(trainer, case, out))
        dist.barrier()
    return result


def _fresh_accelerate_state() -> None:
    """accelerate keeps its state in process-wide singletons, and TrainingArguments(deepspeed=...)
    sets ACCELERATE_USE_DEEPSPEED in the environment: without a reset, every trainer made after
    the DeepSpeed case would silently run under DeepSpeed too."""
    from accelerate.state import AcceleratorState

    os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)
    AcceleratorState._reset_state(reset_partial_state=True)


def _watch_k(model) -> list:
    """(layer, whether k_proj's output needs a gradient) for every training forward."""
    seen = []
    for name, module in model.named_modules():
        if name.endswith("self_attn.k_proj"):
            layer = int(name.split("layers.")[1].split(".")[0])
            module.register_forward_hook(lambda m, i, o, layer=layer: seen.append((layer, o.requires_grad)) if m.training else None)
    return seen


def _shared_dir(local: str) -> str:
    """One directory for every rank (rank 0's), so rank 0 can save what all ranks read."""
    import torch.distributed as dist

    holder = [local]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _lora_checks(trainer, case, out) -> dict:
    """The adapter: only q and v carry LoRA; layer 0's k gets no gradient under SP (its input,
    the frozen embedding, needs none); saved and reloaded it gives the trained model's logits."""
    import torch.distributed as dist
    from peft import PeftModel

    names = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    path = os.path.join(out, "adapter")
    trainer.save_model(path)
    dist.barrier()
    trainer.remove_sequence_parallel()
    ids = torch.arange(SEQ)[None] % 64
    with torch.no_grad():
        trained = trainer.model.eval()(input_ids=ids).logits
        base = model_for({**case, "lora": False})
        loaded = PeftModel.from_pretrained(base, path).eval()
        reloaded = loaded(input_ids=ids).logits
    return {
        "trainable": names,
        "saved_files": sorted(os.listdir(path)),
        "reload_err": (trained - reloaded).abs().max().item(),
        "lora_moved": max(p.abs().max().item() for n, p in trainer.model.named_parameters() if "lora_B" in n),
    }


def _raised(fn) -> str | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return f"{type(e).__name__}: {e}"
    return None


def _unscaled_class():
    """The other negative control: DDP's average over the world left as it is."""
    from ulysses_sp.integrations.trainer import SequenceParallelTrainer

    class Unscaled(SequenceParallelTrainer):
        def _gradient_scale(self, model):
            return 1.0

    return Unscaled


def _overcounting_class():
    """The negative control: num_items_in_batch counted on every SP rank's copy of the samples,
    as transformers' own cross-device count would (too large by sp_size)."""
    from ulysses_sp.integrations.trainer import SequenceParallelTrainer

    class OverCounting(SequenceParallelTrainer):
        def get_batch_samples(self, epoch_iterator, num_batches, device):
            batches, n = super().get_batch_samples(epoch_iterator, num_batches, device)
            return batches, None if n is None else n * self.topo.sp_size

    return OverCounting


def error_cases(rank: int) -> dict:
    """Bad input raises a ValueError on every rank before any collective (else this would hang)."""
    from ulysses_sp.integrations.trainer import SequenceParallelTrainer, SequenceParallelTrainingArguments

    from .hf_cases import tiny_model

    out = {}
    with tempfile.TemporaryDirectory() as d:
        base = dict(output_dir=d, report_to=[], use_cpu=True)
        out["sp3_on_2"] = _raised(lambda: SequenceParallelTrainer(model=tiny_model("llama"), args=SequenceParallelTrainingArguments(sp_size=3, **base)))
        out["ulysses_3_heads"] = _raised(lambda: SequenceParallelTrainer(
            model=tiny_model("llama", hidden_size=24, num_attention_heads=3, num_key_value_heads=3),
            args=SequenceParallelTrainingArguments(sp_size=2, sp_backend="ulysses", **base)))
        out["layers_list"] = _raised(lambda: SequenceParallelTrainer(
            model=tiny_model("llama"), args=SequenceParallelTrainingArguments(sp_size=2, sp_backend="ring,ring,ring", **base)))
        out["unknown_backend"] = _raised(lambda: SequenceParallelTrainingArguments(sp_size=2, sp_backend="rong", **base))
        out["bad_predict_mode"] = _raised(lambda: SequenceParallelTrainingArguments(sp_size=2, sp_predict_logits="all", **base))
        out["bloom"] = _raised(lambda: SequenceParallelTrainer(model=_bloom(), args=SequenceParallelTrainingArguments(sp_size=2, **base)))
        out["fsdp1"] = _raised(lambda: SequenceParallelTrainer(model=tiny_model("llama"), args=SequenceParallelTrainingArguments(
            sp_size=2, fsdp=True, fsdp_config={"version": 1}, **base)))
        # not an error: sp_verify checks the architecture before training
        report = SequenceParallelTrainer(model=tiny_model("llama"), args=SequenceParallelTrainingArguments(sp_size=2, sp_verify=True, **base)).verify_report
        out["sp_verify"] = (report.passed, report.layers, report.worst[2])
    return out


def _bloom():
    import transformers

    return transformers.AutoModelForCausalLM.from_config(transformers.BloomConfig(vocab_size=64, hidden_size=32, n_layer=2, n_head=4))


REFERENCES = {
    "llama": dict(family="llama", predict=True),
    "qwen2-packed": dict(family="qwen2", packed=True, batch=1),
    "llama-lora": dict(family="llama", lora=True, lr=8.0),  # adapters start at B = 0: a larger step
    "llama-3heads": dict(family="llama", overrides=dict(hidden_size=24, num_attention_heads=3, num_key_value_heads=3)),
    "qwen3_5": dict(family="qwen3_5"),  # Gated DeltaNet and attention: the DeltaNet layer under the allgather mixer
    # an image in every sample, the vision tower trains too; it learns slower (lr 2 and 4 diverge)
    "qwen2_5_vl": dict(family="qwen2_5_vl", images=True, learns=0.05),
}
DEEPSPEED_ZERO2 = {
    "zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto", "gradient_clipping": "auto", "steps_per_print": 10**9,
}
SP_CASES = {  # name: (reference, case)
    "llama/sp2": ("llama", dict(REFERENCES["llama"], eval_without_targets=True)),
    "llama/dp2": ("llama", dict(family="llama", sp_size=1, batch=1)),
    "llama/sp2/overcount": ("llama", dict(family="llama", overcount=True)),
    "llama/sp2/zero2": ("llama", dict(family="llama", args=dict(deepspeed=DEEPSPEED_ZERO2))),
    "llama/sp2/zero3": ("llama", dict(family="llama", args=dict(deepspeed={**DEEPSPEED_ZERO2, "zero_optimization": {"stage": 3}}))),
    "qwen2-packed/sp2/ring": ("qwen2-packed", dict(REFERENCES["qwen2-packed"], backend="ring")),
    "qwen2-packed/sp2/ring/zigzag": ("qwen2-packed", dict(REFERENCES["qwen2-packed"], backend="ring", args=dict(sp_layout="zigzag"))),
    "llama/sp2/unscaled": ("llama", dict(family="llama", unscaled=True)),
    "llama-lora/sp2": ("llama-lora", dict(REFERENCES["llama-lora"], save=True)),
    "llama-lora/sp2/ring": ("llama-lora", dict(REFERENCES["llama-lora"], backend="ring")),
    "llama-3heads/sp2/auto": ("llama-3heads", dict(REFERENCES["llama-3heads"], backend="auto")),
    "qwen3_5/sp2": ("qwen3_5", dict(REFERENCES["qwen3_5"])),
    "qwen2_5_vl/sp2": ("qwen2_5_vl", dict(REFERENCES["qwen2_5_vl"])),
    # accelerate's FSDP2 (fully_shard over the world, averaging), which accelerate enables on GPUs only: forced here on CPU
    "llama/sp2/fsdp2": ("llama", dict(family="llama", fsdp=True, args=dict(fsdp=True, fsdp_config={"version": 2}))),
    "llama/sp2/fsdp2/unscaled": ("llama", dict(family="llama", fsdp=True, unscaled=True, args=dict(fsdp=True, fsdp_config={"version": 2}))),
    # TrainingArguments(torch_compile=True): accelerate compiles the whole model; the SP attention is one op in its graphs
    "qwen2-packed/sp2/ring/compiled": ("qwen2-packed", dict(REFERENCES["qwen2-packed"], backend="ring", args=dict(torch_compile=True))),
}


def run_references(rank: int, world: int, names) -> dict:
    return {name: _guarded(lambda n=name: reference(REFERENCES[n])) for name in names}


def run_sp_cases(rank: int, world: int, names) -> dict:
    torch.set_num_threads(1)
    results = {"errors": _guarded(lambda: error_cases(rank))}
    for name in names:
        _, case = SP_CASES[name]
        if case.get("overcount"):
            case = dict(case, trainer_class=_overcounting_class())
        if case.get("unscaled"):
            case = dict(case, trainer_class=_unscaled_class())
        with _accelerate_fsdp_on_cpu() if case.get("fsdp") else contextlib.nullcontext():
            results[name] = _guarded(lambda c=case: sp_run(c))
    return results


@contextlib.contextmanager
def _accelerate_fsdp_on_cpu():
    """accelerate takes an FSDP plugin only for GPU-like distributed types (``AcceleratorState``'s
    MULTI_GPU ... branch) and otherwise prepares DDP; on CPU ranks the state is set to FSDP with
    the plugin, so that its FSDP2 preparation (``fully_shard`` over the world, on gloo) runs."""
    import accelerate.state as state
    from accelerate.utils import DistributedType

    original = state.AcceleratorState.__init__

    def init(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type, self.fsdp_plugin = DistributedType.FSDP, fsdp_plugin

    state.AcceleratorState.__init__ = init
    try:
        yield
    finally:
        state.AcceleratorState.__init__ = original


def _guarded(fn) -> dict:
    try:
        return {"ok": True, "value": fn()}
    except Exception:  # noqa: BLE001 - reported by the test with the rank's traceback
        return {"ok": False, "error": traceback.format_exc()}
