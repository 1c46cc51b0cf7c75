"""The main job: train a Hugging Face causal LM with sequence parallelism under DeepSpeed.

``train.py`` at the repository root calls :func:`main`. Runs under the
``deepspeed`` launcher or ``torchrun``; on a machine without CUDA it uses
DeepSpeed's CPU accelerator and gloo. With no ``--model`` / ``--data`` it
trains the embedded default: a small Llama-style model (random init, config
below) on byte-level passkey retrieval (``ulysses_sp.tasks``). On GPUs each rank
binds ``cuda:LOCAL_RANK`` and trains in bf16 by default (DeepSpeed's mixed
precision, fp32 master weights); on CPU in fp32.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import comm
from .devices import bind_device, check_one_rank_per_device, local_world_size, move_batch
from .data import shard_batch, sp_cross_entropy
from .loss import causal_lm_loss
from .kernels import KERNEL_NAMES
from .integrations.deepspeed import SequenceParallelMPU, gradient_scale, use_cpu_accelerator_if_needed
from .tasks import PAD_ID, VOCAB_SIZE, passkey_batch
from .registry import get_backend, list_backends
from .topology import init_sequence_parallel

__all__ = ["TrainConfig", "main", "parse_args"]

DTYPES = ("bf16", "fp16", "fp32")


@dataclass
class TrainConfig:
    sp_size: int
    """Ranks that share one sequence; the rest of the world is data parallel."""
    sp_backend: str = "auto"
    """A backend name, ``auto``, or comma-separated names, one per attention layer."""
    zero_stage: int = 2
    model: str | None = None
    """A Hugging Face config.json, or a local model directory (weights loaded if present)."""
    data: str | None = None
    """A JSON-lines file of {"text": ...} records (byte-level tokens), instead of the passkey task."""
    seq_len: int = 4096
    steps: int = 200
    lr: float = 3e-3
    seed: int = 0
    save: str | None = None
    resume: str | None = None
    ulysses_degree: int | None = None
    profile: str | None = None
    """A profile JSON from ``sp-bench calibrate`` for the auto policy."""
    dtype: str | None = None
    """``bf16``, ``fp16`` or ``fp32``; None: bf16 on CUDA, fp32 on CPU. bf16/fp16 go through
    DeepSpeed's mixed precision (it casts the fp32 model and keeps fp32 master weights)."""
    sp_kernel: str = "auto"
    """The local attention kernel: ``auto``, ``flash_attn``, ``torch`` or ``math``."""
    tiled_loss: bool | None = None
    """The LM head and the loss over tiles of tokens (``causal_lm_loss``); None: :func:`memory_options` decides."""
    tiled_mlp: bool | None = None
    """Each layer's MLP over tiles of tokens, recomputed in the backward; None: decided by length."""
    checkpoint: str = "auto"
    """``none``, ``layers`` (per-layer activation checkpointing), ``offload`` (and the
    checkpoints in pinned host memory), or ``auto``: decided by length."""


MEMORY_TILE_ELEMENTS = 1 << 26
"""A [local tokens, width] fp32 activation of this many elements (256 MiB) or more is tiled."""


def memory_options(cfg: TrainConfig, model_config, sp_size: int, on_gpu: bool) -> tuple[dict, dict]:
    """(tiled_loss, tiled_mlp, checkpoint) for ``apply_sequence_parallel`` and the loss, and
    why each was chosen. Defaults from the local length L = seq_len / sp_size: tile the loss
    when L x vocab, and the MLP when L x intermediate, reaches 64 Mi elements (256 MiB in
    fp32); checkpoint every layer from L = 8k, offloaded to host memory on GPUs from L = 32k."""
    local = cfg.seq_len // sp_size
    chosen, why = {}, {}
    for name, width in (("tiled_loss", model_config.vocab_size), ("tiled_mlp", model_config.intermediate_size)):
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


def parse_args(argv=None) -> TrainConfig:
    p = argparse.ArgumentParser(prog="train.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sp-size", type=int, default=None, help="sequence-parallel size (default: every rank)")
    p.add_argument("--sp-backend", default="auto", help=f"auto, one of {', '.join(list_backends())}, hybrid-u{{U}} (the hybrid at Ulysses degree U), or a comma-separated name per layer")
    p.add_argument("--profile", default=None, help="a profile from sp-bench calibrate, for auto (default: built in)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2)
    p.add_argument("--model", default=None, help="config.json or local model directory (default: the embedded tiny Llama)")
    p.add_argument("--data", default=None, help="JSON lines with a 'text' field (default: the embedded passkey task)")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=DTYPES, default=None, help="training precision (default: bf16 on CUDA, fp32 on CPU)")
    p.add_argument("--sp-kernel", choices=KERNEL_NAMES, default="auto", help="local attention kernel (default: auto)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="what the hybrid backend means (default: sp size); hybrid-u{U} and auto use any degree")
    p.add_argument("--tiled-loss", action=argparse.BooleanOptionalAction, default=None,
                   help="LM head + loss over tiles of tokens (default: on when local tokens x vocab >= 2^26)")
    p.add_argument("--tiled-mlp", action=argparse.BooleanOptionalAction, default=None,
                   help="each MLP over tiles of tokens, recomputed in backward (default: on when local tokens x intermediate >= 2^26)")
    p.add_argument("--checkpoint", choices=("auto", "none", "layers", "offload"), default="auto",
                   help="activation checkpointing per layer; offload: to pinned host memory (default auto: layers from 8k local "
                        "tokens, offload on GPUs from 32k)")
    p.add_argument("--save", default=None, help="checkpoint directory (DeepSpeed format), written at the end")
    p.add_argument("--resume", default=None, help="checkpoint directory to continue from")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)  # set by the deepspeed launcher
    a = p.parse_args(argv)
    unknown = [name for name in a.sp_backend.split(",") if name != "auto" and not _known_backend(name)]
    if unknown:
        p.error(f"--sp-backend: unknown {unknown}; choose from auto, {', '.join(list_backends())}, hybrid-u{{U}} (one, or one per layer)")
    return TrainConfig(
        sp_size=a.sp_size, sp_backend=a.sp_backend, zero_stage=a.zero_stage, model=a.model, data=a.data, seq_len=a.seq_len,
        steps=a.steps, lr=a.lr, seed=a.seed, save=a.save, resume=a.resume, ulysses_degree=a.ulysses_degree, profile=a.profile,
        dtype=a.dtype, sp_kernel=a.sp_kernel, tiled_loss=a.tiled_loss, tiled_mlp=a.tiled_mlp, checkpoint=a.checkpoint,
    )


def default_model_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 16, pad_token_id=PAD_ID,
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, use_cache=False,
    )


def build_model(cfg: TrainConfig):
    import transformers

    if cfg.model is None:
        config = default_model_config()
    elif os.path.isdir(cfg.model) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(cfg.model)):
        return transformers.AutoModelForCausalLM.from_pretrained(cfg.model).float()
    else:
        config = transformers.AutoConfig.from_pretrained(cfg.model)
    torch.manual_seed(cfg.seed)
    return transformers.AutoModelForCausalLM.from_config(config).float()


class TextFile:
    """Byte-level samples from a JSON-lines file: record ``step * dp_size + dp_rank`` (cycling)."""

    def __init__(self, path: str, seq_len: int):
        with open(path) as f:
            self.records = [json.loads(line)["text"].encode() for line in f if line.strip()]
        if not self.records:
            raise ValueError(f"{path}: no records")
        self.seq_len = seq_len

    def batch(self, step: int, dp_rank: int, dp_size: int) -> dict:
        raw = list(self.records[(step * dp_size + dp_rank) % len(self.records)][: self.seq_len])
        ids = torch.tensor(raw, dtype=torch.long).unsqueeze(0)
        return {"input_ids": ids, "labels": ids.clone()}


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set (Linux: KiB)


def _chosen_backends(model) -> dict[int, str]:
    return {
        m.layer_idx: ",".join(sorted({b.name for b in m.__dict__["_ulysses_sp_attention"]._chosen.values()}))
        for m in model.modules()
        if "_ulysses_sp_attention" in m.__dict__
    }


def resolve_dtype(dtype: str | None, on_gpu: bool) -> str:
    """The precision to train in: ``dtype``, or by default bf16 on CUDA and fp32 on CPU.
    Raises ``ValueError`` for a precision this machine cannot train in."""
    dtype = dtype or ("bf16" if on_gpu else "fp32")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if on_gpu and dtype == "bf16" and not torch.cuda.is_bf16_supported():
        raise ValueError(f"--dtype bf16: {torch.cuda.get_device_name()} has no bf16 support; use --dtype fp16 or fp32")
    if not on_gpu and dtype == "fp16" and not _cpu_fp16_supported():
        raise ValueError("--dtype fp16: DeepSpeed's CPU accelerator needs oneDNN fp16 support, which this CPU lacks; use --dtype bf16 or fp32")
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


def train(cfg: TrainConfig) -> list[float]:
    """Run the job; returns the loss of every step run (on every rank)."""
    use_cpu_accelerator_if_needed()
    import deepspeed

    from .integrations.transformers import apply_sequence_parallel

    on_gpu = torch.cuda.is_available()
    dtype = resolve_dtype(cfg.dtype, on_gpu)  # before any process group: a bad flag fails at once on every rank
    device = bind_device()  # cuda:LOCAL_RANK before NCCL starts; CPU without CUDA
    deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo")
    check_one_rank_per_device(dist.group.WORLD, device)
    if not on_gpu:  # ranks share the cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size(default=dist.get_world_size())))
    topo = init_sequence_parallel(cfg.sp_size or dist.get_world_size(), ulysses_degree=cfg.ulysses_degree, layout="zigzag", profile=cfg.profile)
    rank0 = topo.rank == 0

    backend = cfg.sp_backend.split(",") if "," in cfg.sp_backend else cfg.sp_backend
    model = build_model(cfg)
    memory, why = memory_options(cfg, model.config, topo.sp_size, on_gpu)
    model = apply_sequence_parallel(model, topo, backend=backend, kernel=cfg.sp_kernel, tiled_mlp=memory["tiled_mlp"],
                                    checkpoint=memory["checkpoint"])
    model.train()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "zero_optimization": {"stage": cfg.zero_stage},
        "steps_per_print": 1 << 30,
        **precision_config(dtype),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config, mpu=SequenceParallelMPU(topo))
    scale = gradient_scale(engine, topo)  # undoes the averaging of this ZeRO stage

    start = 0
    if cfg.resume:
        _, client = engine.load_checkpoint(cfg.resume)
        start = int(client["step"])
    source = TextFile(cfg.data, cfg.seq_len) if cfg.data else None
    if rank0:
        print(
            f"ulysses-sp: world {topo.world_size} = dp {topo.dp_size} x sp {topo.sp_size}, backend {cfg.sp_backend}, "
            f"kernel {cfg.sp_kernel}, ZeRO {cfg.zero_stage}, {dtype} on {topo.device}, seq {cfg.seq_len}, steps {start}..{cfg.steps}, "
            f"data {'passkey task' if source is None else cfg.data}",
            flush=True,
        )
        print("memory: " + ", ".join(f"{name} {value} ({why[name]})" for name, value in memory.items()), flush=True)
    progress = None
    if rank0:
        from tqdm import tqdm

        # the bar only on a terminal; logs get the per-step lines alone
        progress = tqdm(total=cfg.steps - start, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True, disable=not sys.stdout.isatty())

    losses = []
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        if source is None:
            batch = passkey_batch(cfg.seq_len, seed=cfg.seed, step=step, dp_rank=topo.dp_rank)
        else:
            batch = source.batch(step, topo.dp_rank, topo.dp_size)
        local = move_batch(shard_batch(batch, topo, pad_token_id=PAD_ID), topo.device)  # shard on CPU, move this rank's part
        if memory["tiled_loss"]:
            loss = causal_lm_loss(engine, local, topo, count_group=dist.group.WORLD)
        else:
            logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
            loss = sp_cross_entropy(logits, local["shift_labels"], topo, count_group=dist.group.WORLD)
        engine.backward(loss * scale)
        engine.step()
        losses.append(loss.item())
        seconds = time.perf_counter() - t0
        peaks = comm.all_gather_ints((_peak_memory_bytes(topo.device) // 2**20,), dist.group.WORLD, topo.device)
        if step == start and rank0:
            layers = _chosen_backends(engine.module)
            progress.write("backend per layer: " + ", ".join(f"{i}: {b}" for i, b in sorted(layers.items())))
        if rank0:
            tokens = cfg.seq_len * topo.dp_size
            progress.write(
                f"step {step + 1:4d}  loss {losses[-1]:.4f}  {tokens / seconds:8.0f} tokens/s  "
                f"peak memory per rank {', '.join(f'{m[0]} MiB' for m in peaks)}"
            )
            progress.update(1)
    if progress is not None:
        progress.close()
    if cfg.save:
        engine.save_checkpoint(cfg.save, client_state={"step": cfg.steps})
        if rank0:
            print(f"checkpoint written to {cfg.save}", flush=True)
    engine.destroy()
    dist.barrier()  # gloo aborts at exit when a rank tears down while another still talks
    dist.destroy_process_group()
    return losses


def main(argv=None) -> None:
    train(parse_args(argv))
