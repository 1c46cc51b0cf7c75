"""The job's options: ``TrainConfig``, the command line that fills it, and the checks that
need no process group (so a bad flag fails at once, the same way on every rank)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

import torch

from ..kernels import KERNEL_NAMES
from ..layout import LAYOUTS, required_multiple
from ..mixers import MIXER_CHOICES
from ..registry import get_backend, list_backends
from ..tasks import cross_shard_depths, passkey_sample
from .errors import JobError

__all__ = ["TrainConfig", "parse_args", "check_launch", "job_layout", "memory_options", "DEFAULT_LR", "ENGINES"]


ENGINES = ("deepspeed", "fsdp2")
TASKS = ("lm", "sft", "dpo")

DEFAULT_LR = {"embedded": 3e-3, "pretrained": 2e-5}
"""--lr when neither the flag nor the DeepSpeed config gives one: the embedded model trains from
scratch; a loaded model is fine-tuned."""


@dataclass
class TrainConfig:
    sp_size: int | None = None
    """Ranks that share one sequence; the rest of the world is data parallel. None: every rank."""
    sp_backend: str = "auto"
    """A backend name, ``auto``, or comma-separated names, one per attention layer."""
    engine: str = "deepspeed"
    """``deepspeed`` (ZeRO, the config file) or ``fsdp2`` (torch's fully_shard over DP x SP, AdamW, DCP checkpoints)."""
    zero_stage: int | None = None
    """None: the DeepSpeed config's stage, else 2."""
    deepspeed: str | None = None
    """A DeepSpeed config JSON: micro batch, accumulation, precision, optimizer, scheduler, ZeRO, offload."""
    model: str | None = None
    """A Hugging Face config.json, or a local model directory (weights and tokenizer loaded if present)."""
    tokenizer: str | None = None
    """A local tokenizer directory; None: the model directory's."""
    data: str | None = None
    """Local JSON lines / Parquet (a ``text`` column) or text files; None: the embedded passkey task."""
    task: str = "lm"
    """``lm``: every token of the data's text is a target; ``sft``: JSON lines of ``prompt`` and ``completion``, the loss on the
    completion; ``dpo``: JSON lines of ``prompt``, ``chosen`` and ``rejected``, DPO's sigmoid loss against the initial model."""
    beta: float = 0.1
    """``--task dpo``: the DPO temperature."""
    eval_data: str | None = None
    token_cache: str | None = None
    """Where data files are tokenized once and memory-mapped (reused on resume); None: $XDG_CACHE_HOME/ulysses_sp/tokens."""
    packing: bool = True
    """Pack documents into --seq-len rows (position ids restart per document); False: one per row, padded."""
    seq_len: int = 4096
    steps: int = 200
    """Optimizer steps (each of gradient_accumulation_steps micro-steps)."""
    micro_batch: int | None = None
    grad_accum: int | None = None
    lr: float | None = None
    warmup_steps: int | None = None
    """Linear warmup; None: 5% of the steps. Then cosine decay to lr x min_lr_ratio."""
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    seed: int = 0
    eval_every: int = 0
    """Evaluate every N steps (0: only at the end, when there is eval data or the passkey task)."""
    eval_samples: int = 32
    """Held-out passkey prompts for the embedded task's eval."""
    save: str | None = None
    """Checkpoint directory (DeepSpeed format): written every --save-every steps and at the end."""
    save_every: int = 0
    keep_last: int = 2
    resume: str | None = None
    """``latest`` (the newest checkpoint in --save, if any) or a checkpoint directory."""
    metrics_file: str | None = None
    export_hf: str | None = None
    dist_timeout: float = 1800.0
    """Seconds a collective of training may wait for the other ranks."""
    io_timeout: float = 7200.0
    """Seconds the ranks wait (on a gloo group of their own) while rank 0 flushes, renames and rotates checkpoints or writes the export."""
    from_scratch: bool = False
    """Train ``--model``'s architecture from random weights (a directory without weight files is otherwise an error)."""
    """Write save_pretrained weights, config and tokenizer here at the end."""
    peak_tflops: float | None = None
    """Per-device peak for the FLOPs-utilisation estimate; None: known CUDA devices only."""
    ulysses_degree: int | None = None
    verify: bool = False
    """Before training, check on a small fp64 copy of the model's architecture that SP gives the one-process loss and gradients."""
    profile: str | None = None
    """A profile JSON from ``sp-bench calibrate`` for the auto policy."""
    dtype: str | None = None
    """``bf16``, ``fp16`` or ``fp32``; None: the DeepSpeed config's, else bf16 on CUDA, fp32 on CPU."""
    sp_kernel: str = "auto"
    sp_mixer: str = "auto"
    layout: str = "auto"
    """How each sequence's tokens lie across the SP ranks; auto: balanced for rows packed from --data, else zigzag."""
    tiled_loss: bool | None = None
    """The LM head and the loss over tiles of tokens; None: `memory_options` decides."""
    tiled_mlp: bool | None = None
    tiled_norms: bool | None = None
    """The layers' and the final norm over tiles (their fp32 intermediates one tile at a time); None: by length."""
    checkpoint: str = "auto"
    """``none``, ``layers``, ``offload`` or ``auto`` (decided by length); --gradient-checkpointing is ``layers``."""
    compile: bool = False
    """``torch.compile`` each decoder layer (``tiling.compile_layers``; fullgraph unless hybrid mixers run between
    graphs); checkpointing stays around it. Not with ZeRO-3."""


MEMORY_TILE_ELEMENTS = 1 << 26
"""A [local tokens, width] fp32 activation of this many elements (256 MiB) or more is tiled."""


def memory_options(cfg: TrainConfig, model_config, sp_size: int, on_gpu: bool) -> tuple[dict, dict]:
    """(tiled_loss, tiled_mlp, checkpoint) for ``apply_sequence_parallel`` and the loss, and
    why each was chosen. Defaults from the local length L = seq_len / sp_size: tile the loss
    when L x vocab, and the MLP when L x intermediate, reaches 64 Mi elements (256 MiB in
    fp32); checkpoint every layer from L = 8k, offloaded to host memory on GPUs from L = 32k."""
    local = cfg.seq_len // sp_size
    chosen, why = {}, {}
    for name, width in (("tiled_loss", model_config.vocab_size), ("tiled_mlp", model_config.intermediate_size),
                        ("tiled_norms", model_config.hidden_size)):
        given = getattr(cfg, name)
        chosen[name] = given if given is not None else local * width >= MEMORY_TILE_ELEMENTS
        why[name] = "flag" if given is not None else f"{local} local tokens x {width} {'>=' if chosen[name] else '<'} 2^26"
    if cfg.checkpoint != "auto":
        chosen["checkpoint"], why["checkpoint"] = cfg.checkpoint, "flag"
    else:
        chosen["checkpoint"] = "offload" if on_gpu and local >= 32768 else "layers" if local >= 8192 else "none"
        why["checkpoint"] = f"{local} local tokens{' on GPU' if on_gpu else ''}"
    return chosen, why


def _known_backend(name: str) -> bool:
    try:
        get_backend(name)
    except ValueError:
        return False
    return True


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="train.py", description="Train a Hugging Face causal LM with sequence parallelism under DeepSpeed.")
    g = p.add_argument_group("parallelism")
    g.add_argument("--sp-size", type=_positive, default=None, help="sequence-parallel size (default: every rank)")
    g.add_argument("--sp-backend", default="auto", help=f"auto, one of {', '.join(list_backends())}, hybrid-u{{U}} (the hybrid at Ulysses degree U), "
                   "or a comma-separated name per layer")
    g.add_argument("--sp-kernel", choices=KERNEL_NAMES, default="auto", help="local attention kernel (default: auto)")
    g.add_argument("--layout", choices=("auto", *LAYOUTS), default="auto",
                   help="tokens of each row across the SP ranks: balanced places packed documents so that every rank does the same "
                        "causal attention work; auto (default): balanced for rows packed from --data, else zigzag")
    g.add_argument("--sp-mixer", choices=MIXER_CHOICES, default="auto",
                   help="strategy for hybrid models' other token mixers (Gated DeltaNet, Mamba2, short convolutions); none refuses them "
                        "(default: auto)")
    g.add_argument("--ulysses-degree", type=int, default=None, help="what the hybrid backend means (default: sp size); hybrid-u{U} and auto use any degree")
    g.add_argument("--verify", action="store_true",
                   help="before training, check on a small fp64 copy of the model's architecture that SP gives the one-process loss and "
                        "every gradient (verify_sequence_parallel); the first thing to run on a new model")
    g.add_argument("--profile", default=None, help="a profile from sp-bench calibrate, for auto (default: built in)")
    g = p.add_argument_group("engine")
    g.add_argument("--engine", choices=ENGINES, default="deepspeed",
                   help="deepspeed (ZeRO; default) or fsdp2: torch's fully_shard over every rank, torch AdamW, torch.distributed.checkpoint "
                        "checkpoints (no DeepSpeed config; bf16 or fp32)")
    g = p.add_argument_group("DeepSpeed (the config file's values win; flags fill what it leaves out or sets to \"auto\")")
    g.add_argument("--deepspeed", nargs="?", const="", default=None, metavar="DS_CONFIG",
                   help="DeepSpeed config JSON (micro batch, accumulation, bf16/fp16, optimizer, scheduler, ZeRO, offload)")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", default=None, metavar="DS_CONFIG", help="the same, DeepSpeed's spelling")
    g.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=None, help="ZeRO stage (default: the config's, else 2)")
    g.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None, help="precision (default: the config's, else bf16 on CUDA, fp32 on CPU)")
    g.add_argument("--micro-batch-size", dest="micro_batch", type=_positive, default=None, help="sequences per rank per micro-step (default: the config's, else 1)")
    g.add_argument("--gradient-accumulation-steps", dest="grad_accum", type=_positive, default=None, help="micro-steps per optimizer step (default: the config's, else 1)")
    g = p.add_argument_group("model and data")
    g.add_argument("--model", default=None, help="config.json or local model directory (default: the embedded tiny Llama)")
    g.add_argument("--from-scratch", action="store_true", help="train --model's architecture from random weights (a directory "
                   "without weight files is otherwise refused)")
    g.add_argument("--tokenizer", default=None, help="local tokenizer directory (default: the --model directory)")
    g.add_argument("--data", default=None, help="JSON lines / Parquet with a 'text' column, or .txt files; for an image-text --model, "
                   "JSON lines with 'images' and 'text' or 'messages' (default: the embedded passkey task)")
    g.add_argument("--eval-data", default=None, help="held-out data in the same formats (the passkey task has its own)")
    g.add_argument("--task", choices=TASKS, default="lm",
                   help="lm: every token of the text is a target (default); sft: --data holds JSON lines of 'prompt' and 'completion', "
                        "the loss on the completion only; dpo: JSON lines of 'prompt', 'chosen' and 'rejected', DPO's sigmoid loss with "
                        "the initial model as the reference (whole lines per row)")
    g.add_argument("--beta", type=float, default=0.1, help="--task dpo: the DPO temperature (default 0.1)")
    g.add_argument("--token-cache", default=None, metavar="DIR",
                   help="where --data and --eval-data are tokenized once into memory-mapped token files, reused by later and "
                        "resumed runs (default: $XDG_CACHE_HOME/ulysses_sp/tokens, else ~/.cache/ulysses_sp/tokens)")
    g.add_argument("--packing", action=argparse.BooleanOptionalAction, default=True,
                   help="pack documents into --seq-len rows, attention restarting per document (default); --no-packing pads each document")
    g.add_argument("--seq-len", type=_positive, default=4096)
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=_positive, default=200, help="optimizer steps")
    g.add_argument("--lr", type=float, default=None, help=f"peak learning rate (default: {DEFAULT_LR['embedded']} embedded model, "
                   f"{DEFAULT_LR['pretrained']} loaded model)")
    g.add_argument("--warmup-steps", type=int, default=None, help="linear warmup steps (default: 5%% of --steps), then cosine decay")
    g.add_argument("--min-lr-ratio", type=float, default=0.1, help="the cosine decay's floor as a share of --lr (1: constant after warmup)")
    g.add_argument("--weight-decay", type=float, default=0.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--gradient-checkpointing", action="store_true", help="recompute each decoder layer in the backward (--checkpoint layers)")
    g.add_argument("--tiled-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="LM head + loss over tiles of tokens (default: on when local tokens x vocab >= 2^26)")
    g.add_argument("--tiled-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="each MLP over tiles of tokens, recomputed in backward (default: on when local tokens x intermediate >= 2^26)")
    g.add_argument("--tiled-norms", action=argparse.BooleanOptionalAction, default=None,
                   help="the layers' norms and the final one over tiles of tokens (default: on when local tokens x hidden >= 2^26)")
    g.add_argument("--compile", action="store_true", help="torch.compile each decoder layer (the SP attention one op in its graph; "
                   "hybrid models' mixers run eagerly between graphs); not with ZeRO-3")
    g.add_argument("--checkpoint", choices=("auto", "none", "layers", "offload"), default="auto",
                   help="activation checkpointing per layer; offload: to pinned host memory (default auto: layers from 8k local "
                        "tokens, offload on GPUs from 32k)")
    g = p.add_argument_group("eval, checkpoints, output")
    g.add_argument("--eval-every", type=int, default=0, help="evaluate every N steps (default: at the end only)")
    g.add_argument("--eval-samples", type=_positive, default=32, help="held-out prompts of the passkey task")
    g.add_argument("--save", default=None, help="checkpoint directory (DeepSpeed format), written every --save-every steps and at the end")
    g.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (default: at the end only)")
    g.add_argument("--keep-last", type=_positive, default=2, help="checkpoints kept in --save (default 2)")
    g.add_argument("--resume", default=None, help="'latest' (the newest checkpoint in --save; none: start fresh) or a checkpoint directory")
    g.add_argument("--metrics-file", default=None, help="JSON lines per step and eval: loss, lr, tokens/s, FLOPs utilisation, peak memory")
    g.add_argument("--export-hf", default=None, metavar="DIR", help="write a save_pretrained model (and tokenizer) here at the end")
    g.add_argument("--dist-timeout", type=float, default=1800.0, metavar="SECONDS",
                   help="how long a collective of training waits for the other ranks")
    g.add_argument("--io-timeout", type=float, default=7200.0, metavar="SECONDS",
                   help="how long the ranks wait while rank 0 flushes, renames and rotates checkpoints or writes the export")
    g.add_argument("--peak-tflops", type=float, default=None, help="device peak for the FLOPs-utilisation estimate (default: known GPUs)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    a = p.parse_args(argv)
    unknown = [name for name in a.sp_backend.split(",") if name != "auto" and not _known_backend(name)]
    if unknown:
        p.error(f"--sp-backend: unknown {unknown}; choose from auto, {', '.join(list_backends())}, hybrid-u{{U}} (one, or one per layer)")
    paths = {path for path in (a.deepspeed, a.deepspeed_config) if path}
    if len(paths) > 1:
        p.error(f"--deepspeed {a.deepspeed} and --deepspeed_config {a.deepspeed_config} name different files; give one")
    if a.resume == "latest" and not a.save:
        p.error("--resume latest looks in the --save directory: give --save too")
    if a.gradient_checkpointing and a.checkpoint not in ("auto", "layers"):
        p.error(f"--gradient-checkpointing is --checkpoint layers; it contradicts --checkpoint {a.checkpoint}")
    return TrainConfig(
        sp_size=a.sp_size, sp_backend=a.sp_backend, engine=a.engine, zero_stage=a.zero_stage, deepspeed=next(iter(paths), None), model=a.model,
        tokenizer=a.tokenizer, data=a.data, task=a.task, beta=a.beta, eval_data=a.eval_data, token_cache=a.token_cache, packing=a.packing, seq_len=a.seq_len, steps=a.steps,
        micro_batch=a.micro_batch, grad_accum=a.grad_accum, lr=a.lr, warmup_steps=a.warmup_steps, min_lr_ratio=a.min_lr_ratio,
        weight_decay=a.weight_decay, seed=a.seed, eval_every=a.eval_every, eval_samples=a.eval_samples, save=a.save,
        save_every=a.save_every, keep_last=a.keep_last, resume=a.resume, metrics_file=a.metrics_file, export_hf=a.export_hf, dist_timeout=a.dist_timeout,
        io_timeout=a.io_timeout,
        from_scratch=a.from_scratch,
        peak_tflops=a.peak_tflops, ulysses_degree=a.ulysses_degree, verify=a.verify, profile=a.profile, dtype=a.dtype, sp_kernel=a.sp_kernel, sp_mixer=a.sp_mixer, layout=a.layout,
        tiled_loss=a.tiled_loss, tiled_mlp=a.tiled_mlp, tiled_norms=a.tiled_norms, checkpoint="layers" if a.gradient_checkpointing else a.checkpoint, compile=a.compile,
    )


def job_layout(cfg: TrainConfig) -> str:
    """``--layout``, or for auto: balanced for packed data files (documents placed by work), zigzag otherwise."""
    return cfg.layout if cfg.layout != "auto" else ("balanced" if cfg.data and cfg.packing else "zigzag")


def check_launch(cfg: TrainConfig, world_size: int) -> int:
    """The SP size, after checking what the launch can take; raises `JobError` naming the fix."""
    sp = cfg.sp_size or world_size
    if world_size % sp:
        raise JobError(f"--sp-size {sp} does not divide the {world_size} ranks launched; use a divisor of {world_size} "
                       f"or launch a multiple of {sp} ranks")
    multiple = required_multiple("zigzag", sp)
    if cfg.seq_len % multiple:
        raise JobError(f"--seq-len {cfg.seq_len} is not a multiple of 2 x sp = {multiple} (each rank holds two chunks of every "
                       f"sequence); use {cfg.seq_len + (-cfg.seq_len % multiple)}")
    if cfg.engine not in ENGINES:
        raise JobError(f"--engine {cfg.engine!r}: choose from {', '.join(ENGINES)}")
    if cfg.engine == "fsdp2":
        given = [flag for flag, value in (("--deepspeed", cfg.deepspeed is not None), ("--zero-stage", cfg.zero_stage is not None),
                                          ("--dtype fp16", cfg.dtype == "fp16")) if value]
        if given:
            raise JobError(f"--engine fsdp2 takes no {', '.join(given)}: those are DeepSpeed's (fp16 needs its loss scaler); use bf16 or fp32")
    if cfg.data is None:
        try:
            passkey_sample(cfg.seq_len, torch.Generator().manual_seed(0))
        except ValueError as e:
            raise JobError(f"--seq-len: {e}") from None
        layout = job_layout(cfg)
        if not cross_shard_depths(cfg.seq_len, sp, layout):
            raise JobError(f"--seq-len {cfg.seq_len} leaves no place for a held-out pass key on other ranks than its answer "
                           f"({sp} ranks, layout {layout}); use a longer --seq-len")
    if cfg.eval_data is not None and cfg.data is None:
        raise JobError("--eval-data needs --data (the passkey task has its own held-out prompts)")
    if cfg.task != "lm":
        from .image_corpus import is_image_text

        if cfg.data is None:
            raise JobError(f"--task {cfg.task} needs --data: JSON lines of " + ("'prompt' and 'completion'" if cfg.task == "sft" else
                                                                                  "'prompt', 'chosen' and 'rejected'"))
        if is_image_text(cfg.model):
            raise JobError(f"--task {cfg.task} takes a text model: an image-text --model trains on its 'images' and 'text' lines (--task lm)")
    if cfg.task == "dpo":
        given = [flag for flag, on in (("--eval-data", cfg.eval_data is not None), ("--tiled-loss", bool(cfg.tiled_loss))) if on]
        if given:
            raise JobError(f"--task dpo takes no {', '.join(given)}: its loss reads each reply's log-probabilities from the logits "
                           "(no eval loss is defined for it here)")
    for name in ("data", "eval_data", "deepspeed", "profile"):
        path = getattr(cfg, name)
        if path and not os.path.exists(path):
            raise JobError(f"--{name.replace('_', '-')} {path}: no such file")
    if cfg.save_every < 0 or cfg.eval_every < 0:
        raise JobError("--save-every and --eval-every take a number of steps >= 0 (0: at the end only)")
    if cfg.save_every and not cfg.save:
        raise JobError("--save-every needs --save DIR, where the checkpoints go")
    if cfg.resume == "latest" and not cfg.save:
        raise JobError("--resume latest looks in the --save directory: give --save too")
    if cfg.resume not in (None, "latest") and not os.path.isdir(cfg.resume):
        raise JobError(f"--resume {cfg.resume}: no such directory (give a --save directory, one of its step* checkpoints, or latest)")
    for flag, seconds in (("dist-timeout", cfg.dist_timeout), ("io-timeout", cfg.io_timeout)):
        if seconds <= 0:
            raise JobError(f"--{flag} {seconds}: give the seconds the ranks may wait, > 0")
    if cfg.keep_last < 1:
        raise JobError(f"--keep-last {cfg.keep_last}: keep at least the newest checkpoint (1)")
    outputs = [("save", cfg.save, True), ("export-hf", cfg.export_hf, True), ("metrics-file", cfg.metrics_file, False)]
    if cfg.data:
        from .tokens import default_cache

        outputs.append(("token-cache", cfg.token_cache or default_cache(), True))
    for flag, path, is_dir in outputs:
        if path:
            _check_writable(flag, path, is_dir)
    return sp


def _check_writable(flag: str, path: str, is_dir: bool) -> None:
    """An output the job writes later (a checkpoint, the export, the metrics) fails now, on every
    rank, rather than after the first step or at the end, on rank 0."""
    target = os.path.abspath(path)
    if os.path.exists(target) and os.path.isdir(target) != is_dir:
        raise JobError(f"--{flag} {path}: " + ("exists and is not a directory" if is_dir else "is a directory; give a file name"))
    probe = target if os.path.isdir(target) else os.path.dirname(target)
    while not os.path.exists(probe):  # the nearest existing ancestor: the job creates the rest
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise JobError(f"--{flag} {path}: {probe} is a file, not a directory")
    if not os.access(probe, os.W_OK | os.X_OK) or (os.path.isfile(target) and not os.access(target, os.W_OK)):
        raise JobError(f"--{flag} {path}: not writable by this user ({target if os.path.isfile(target) else probe})")
