"""The DeepSpeed config the job runs with: the user's file, the flags, and defaults.

The file's values win; flags fill what it leaves out or sets to ``"auto"`` (the Hugging Face
convention), and a flag that contradicts the file is an error rather than a silent choice.
``train_batch_size`` means sequences per optimizer step: micro batch x accumulation x DP
groups, since the ranks of an SP group share one sequence. DeepSpeed, told by our mpu that
every rank is data parallel, would count it per rank, so it is checked here and not passed on.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field

import torch

from .config import DEFAULT_LR, TrainConfig
from .errors import JobError

__all__ = ["DTYPES", "ResolvedConfig", "load_ds_config", "resolve_ds_config", "resolve_dtype", "precision_config"]

DTYPES = ("bf16", "fp16", "fp32")


def load_ds_config(path: str | None) -> dict:
    if not path:
        return {}
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise JobError(f"--deepspeed {path}: cannot read it as JSON ({e})") from None
    if not isinstance(config, dict):
        raise JobError(f"--deepspeed {path}: a DeepSpeed config is a JSON object, got {type(config).__name__}")
    return config


def resolve_dtype(dtype: str | None, on_gpu: bool) -> str:
    """The precision to train in: ``dtype``, or by default bf16 on CUDA and fp32 on CPU.
    Raises ``ValueError`` for a precision this machine cannot train in."""
    dtype = dtype or ("bf16" if on_gpu else "fp32")
    if dtype not in DTYPES:
        raise JobError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if on_gpu and dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise JobError(f"--dtype bf16: {torch.cuda.get_device_name()} has no bf16 support; use --dtype fp16 or fp32")
    if not on_gpu and dtype == "fp16" and not _cpu_fp16_supported():
        raise JobError("--dtype fp16: DeepSpeed's CPU accelerator needs oneDNN fp16 support, which this CPU lacks; use --dtype bf16 or fp32")
    return dtype


def _cpu_fp16_supported() -> bool:
    """What DeepSpeed's CPU accelerator asks before it accepts fp16 (bf16 it always accepts)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except Exception:
        return False


def precision_config(dtype: str) -> dict:
    """The DeepSpeed config section for ``dtype``: DeepSpeed casts the fp32 model it is given
    and keeps fp32 master weights in its optimizer wrapper (fp16: with dynamic loss scaling)."""
    if dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if dtype == "fp16":
        return {"fp16": {"enabled": True, "initial_scale_power": 16}}
    return {}


@dataclass
class ResolvedConfig:
    config: dict
    """What goes to ``deepspeed.initialize``."""
    micro_batch: int
    grad_accum: int
    zero_stage: int
    dtype: str
    lr: float
    warmup_steps: int
    ds_optimizer: bool
    """The config builds the optimizer (else the job passes torch's AdamW)."""
    ds_scheduler: bool
    """The config builds the scheduler (else the job passes warmup + cosine)."""
    sources: dict[str, str] = field(default_factory=dict)
    """Each setting's value and where it came from, for the log."""

    def describe(self, without=()) -> str:
        return ", ".join(f"{name} {value}" for name, value in self.sources.items() if name not in without)


def _given(value):
    """A config value, or None where it is absent or ``"auto"``."""
    return None if value is None or value == "auto" else value


def _remaining_auto(node, path=""):
    if node == "auto":
        yield path
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from _remaining_auto(value, f"{path}.{key}" if path else key)


def resolve_ds_config(cfg: TrainConfig, user: dict, *, dp_size: int, sp_size: int, on_gpu: bool, pretrained: bool) -> ResolvedConfig:
    """Merge the user's DeepSpeed config (``user``, possibly empty), the flags and the defaults."""
    config = copy.deepcopy(user)
    sources = {}

    def pick(label, from_config, config_key, flag, flag_name, default, default_why="default"):
        if from_config is not None:
            if flag is not None and flag != from_config:
                raise JobError(f"{flag_name} {flag} contradicts the DeepSpeed config's {config_key} {from_config}; drop one of them")
            sources[label] = f"{from_config} (config)"
            return from_config
        if flag is not None:
            sources[label] = f"{flag} (flag)"
            return flag
        sources[label] = f"{default} ({default_why})"
        return default

    micro = pick("micro batch", _given(config.get("train_micro_batch_size_per_gpu")), "train_micro_batch_size_per_gpu",
                 cfg.micro_batch, "--micro-batch-size", 1)
    accum = pick("gradient accumulation", _given(config.get("gradient_accumulation_steps")), "gradient_accumulation_steps",
                 cfg.grad_accum, "--gradient-accumulation-steps", 1)
    total = _given(config.pop("train_batch_size", None))
    if total is not None and total != micro * accum * dp_size:
        if sources["gradient accumulation"].endswith("(default)") and total % (micro * dp_size) == 0:
            accum = total // (micro * dp_size)
            sources["gradient accumulation"] = f"{accum} (config train_batch_size {total} / micro {micro} / dp {dp_size})"
        else:
            raise JobError(f"the DeepSpeed config's train_batch_size {total} is not micro batch x accumulation x DP groups = "
                           f"{micro} x {accum} x {dp_size}: the {sp_size} ranks of an SP group share one sequence, so DP groups = world / sp")
    if cfg.data and cfg.packing and micro > 1:
        raise JobError(f"micro batch {micro} with packing: a packed row carries its own document boundaries and the attention "
                       "kernels take one set per batch, so packed training needs a micro batch of 1; raise --seq-len (or accumulate "
                       "with --gradient-accumulation-steps), or pass --no-packing")
    zero = config.setdefault("zero_optimization", {})
    stage = pick("ZeRO stage", _given(zero.get("stage")), "zero_optimization.stage", cfg.zero_stage, "--zero-stage", 2)

    enabled = [name for name in ("bf16", "fp16") if _given(config.get(name, {}).get("enabled")) is True]
    if len(enabled) > 1:
        raise JobError("the DeepSpeed config enables both bf16 and fp16; enable one")
    dtype = pick("precision", enabled[0] if enabled else None, "precision", cfg.dtype, "--dtype", resolve_dtype(None, on_gpu),
                 "default on " + ("CUDA" if on_gpu else "CPU"))
    dtype = resolve_dtype(dtype, on_gpu)
    for name in ("bf16", "fp16"):
        section = {**precision_config(dtype).get(name, {}), **config.get(name, {})}
        if section or name in config:
            config[name] = {**section, "enabled": name == dtype}

    optimizer = config.get("optimizer")
    params = optimizer.setdefault("params", {}) if optimizer else {}
    default_lr = DEFAULT_LR["pretrained" if pretrained else "embedded"]
    lr = pick("lr", _given(params.get("lr")), "optimizer.params.lr", cfg.lr, "--lr", default_lr,
              "default for a " + ("loaded" if pretrained else "from-scratch") + " model")
    offload = _given(zero.get("offload_optimizer", {}).get("device")) not in (None, "none")
    if optimizer is None and offload:
        optimizer = config["optimizer"] = {"type": "AdamW", "params": {"weight_decay": cfg.weight_decay}}
        params = optimizer["params"]
        sources["optimizer"] = "AdamW (DeepSpeed's, since ZeRO offloads the optimizer)"
    elif optimizer is not None:
        sources["optimizer"] = f"{optimizer.get('type')} (config)"
    else:
        sources["optimizer"] = f"torch AdamW, weight decay {cfg.weight_decay} (default)"
    if optimizer is not None:
        params["lr"] = lr

    warmup = cfg.warmup_steps if cfg.warmup_steps is not None else round(0.05 * cfg.steps)
    scheduler = config.get("scheduler")
    if scheduler is not None:
        fill = {"total_num_steps": cfg.steps, "warmup_num_steps": warmup, "warmup_max_lr": lr, "warmup_min_lr": 0.0,
                "cos_min_ratio": cfg.min_lr_ratio, "warmup_min_ratio": 0.0}
        sp = scheduler.setdefault("params", {})
        for key, value in sp.items():
            if value == "auto" and key in fill:
                sp[key] = fill[key]
        sources["schedule"] = f"{scheduler.get('type')} (config)"
    else:
        sources["schedule"] = f"linear warmup {warmup} steps, cosine to {cfg.min_lr_ratio} x lr at step {cfg.steps} " + (
            "(flags)" if cfg.warmup_steps is not None else "(default)")
    config.setdefault("gradient_clipping", 1.0)
    sources["gradient clipping"] = f"{config['gradient_clipping']} ({'config' if 'gradient_clipping' in user else 'default'})"
    config.update(train_micro_batch_size_per_gpu=micro, gradient_accumulation_steps=accum)
    zero["stage"] = stage
    left = list(_remaining_auto(config))
    if left:
        raise JobError(f"the DeepSpeed config sets {', '.join(left)} to \"auto\", which the job cannot fill; give values")
    config.setdefault("steps_per_print", 1 << 30)
    return ResolvedConfig(config=config, micro_batch=micro, grad_accum=accum, zero_stage=stage, dtype=dtype, lr=lr, warmup_steps=warmup,
                          ds_optimizer=optimizer is not None, ds_scheduler=scheduler is not None, sources=sources)
