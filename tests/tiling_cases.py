"""Tiled MLP and activation checkpointing (with offload) inside the spawned ranks: a tiny HF
Llama with SP, tiling and checkpointing on, against the same SP model with both off; DeepSpeed
ZeRO-2 and ZeRO-3 engines likewise."""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile

import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp import tiling
from ulysses_sp.decoder_layers import decoder_layers
from ulysses_sp.models.switch import apply_sequence_parallel, remove_sequence_parallel

from .cases import Parity, _topo_for, case

TILE = 5
"""Tokens per tile: 24 local tokens at P=2 (45 padded to 48) make 5 tiles, the last one short."""
TILING_CASES = {f"{b}/{mode}": dict(backend=b, checkpoint=mode) for b in ("ulysses", "allgather", "ring", "hybrid") for mode in ("layers", "offload")}
TILING_CASES["ulysses/offload/packed"] = dict(backend="ulysses", checkpoint="offload", packed=True)
TILING_CASES["ring/layers/packed"] = dict(backend="ring", checkpoint="layers", packed=True)
NORM_CASES = {"ulysses/offload/norms": dict(backend="ulysses", checkpoint="offload", tiled_norms=True),
              "ring/layers/norms/packed": dict(backend="ring", checkpoint="layers", tiled_norms=True, packed=True),
              "allgather/none/norms": dict(backend="allgather", checkpoint="none", tiled_norms=True)}
"""The norms tiled too (``tiled_norms``), at P=2 and P=4."""


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def _step(model, topo, data, **options):
    apply_sequence_parallel(model, topo, backend=options.pop("backend"), **options)
    local = usp.shard_batch(data, topo)
    logits = model(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
    loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    loss.backward()
    counts = [list(t.counts) for t in tiling.tiled_mlps(model)]
    store = tiling.offload_store(model)
    stats = store.stats() if store is not None else None
    remove_sequence_parallel(model)
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, counts, stats


def tiling_parity(topo, backend: str, checkpoint: str, packed=False, tiled_norms=False) -> dict:
    from .hf_cases import batch, tiny_model

    base = tiny_model("llama")
    tiled = copy.deepcopy(base)
    data = batch(packed)
    ref_loss, ref_grads, _, _ = _step(base, topo, data, backend=backend)
    norm_calls = []  # tiles of the final norm per forward: its module runs once per tile
    tiled.model.norm.register_forward_hook(lambda *_: norm_calls.append(1))
    loss, grads, counts, stats = _step(tiled, topo, data, backend=backend, tiled_mlp=TILE, checkpoint=checkpoint, tiled_norms=tiled_norms)
    worst, grad_rel = None, 0.0
    for name, g in grads.items():
        if _rel(g, ref_grads[name]) >= grad_rel:
            worst, grad_rel = name, _rel(g, ref_grads[name])
    all_counts = [None] * topo.sp_size
    dist.all_gather_object(all_counts, counts, group=topo.sp_group)
    return {
        "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
        "grad_rel": grad_rel, "worst_param": worst,
        "counts": counts, "counts_all_ranks": all_counts, "offload": stats,
        "restored": all("mlp" not in layer.__dict__ and "forward" not in layer.__dict__ for layer in decoder_layers(tiled))
        and not any(isinstance(v, tiling.TiledMLP) for m in tiled.modules() for v in m.__dict__.values()),
        "norm_calls": norm_calls,
        "attn_restored": tiled.config._attn_implementation == base.config._attn_implementation,
    }


def _case(env, name):
    return tiling_parity(_topo_for(env, Parity(), "zigzag"), **TILING_CASES[name])


def _norm_cases(env):
    return {name: tiling_parity(_topo_for(env, Parity(), "zigzag"), **options) for name, options in NORM_CASES.items()}


if importlib.util.find_spec("transformers") is not None:
    for _name in TILING_CASES:
        case(f"tiling/hf/{_name}", (2,))(lambda env, n=_name: _case(env, n))
    case("tiling/hf/norms", (2, 4))(_norm_cases)


# --------------------------------------------------------------------------- DeepSpeed

DS_RUNS = [(2, "layers", False), (3, "offload", False), (3, "layers", True)]
NORMS_IN = "3/offload"
"""The run whose tiled side tiles the norms too (ZeRO-3 gathers their parameters per tile)."""
"""(ZeRO stage, checkpoint, uneven) at SP=2 x DP=2: uneven gives DP rank 1 30 tokens instead of 40 (16 local after
padding, 6 tiles of 3 by its own count, against 7 for 20 local tokens); ZeRO-3 makes every rank run the world's maximum, 7."""


def _ds_step(topo, model, stage: int, uneven=False, **options):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from ulysses_sp.integrations.deepspeed import SequenceParallelMPU, gradient_scale

    from .ds_cases import _ds_config, _global_batch

    apply_sequence_parallel(model, topo, backend="ulysses", **options)
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config={**_ds_config(stage, True), "zero_allow_untested_optimizer": True}, mpu=SequenceParallelMPU(topo),
    )
    data = _global_batch(topo.dp_size)
    mine = {k: v[topo.dp_rank : topo.dp_rank + 1, : 30 if uneven and topo.dp_rank == 1 else None] for k, v in data.items()}
    local = usp.shard_batch(mine, topo)
    out = engine(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss = usp.sp_cross_entropy(out, local["shift_labels"], topo, count_group=dist.group.WORLD)
    engine.backward(loss * gradient_scale(engine, topo))
    grads = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
    engine.step()
    if stage == 3:
        from deepspeed.utils import safe_get_full_fp32_param
        params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    else:
        params = [p.detach().clone() for p in engine.module.parameters()]
    counts = [list(t.counts) for t in tiling.tiled_mlps(engine.module)]
    store = tiling.offload_store(engine.module)
    stats = store.stats() if store is not None else None
    engine.destroy()
    return loss.detach(), grads, params, counts, {"offload": stats, "own_tiles": tiling.tile_count(local["input_ids"].numel(), 3)}


def ds_tiling(topo) -> dict:
    from ulysses_sp.integrations.deepspeed import use_cpu_accelerator_if_needed

    from .hf_cases import tiny_model

    use_cpu_accelerator_if_needed()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "usp-torch-extensions"))
    out = {}
    for stage, mode, uneven in DS_RUNS:
        ref_loss, ref_grads, ref_params, _, _ = _ds_step(topo, tiny_model("llama"), stage, uneven)
        name = f"{stage}/{mode}" + ("/uneven" if uneven else "")
        loss, grads, params, counts, stats = _ds_step(topo, tiny_model("llama"), stage, uneven, tiled_mlp=3, checkpoint=mode,
                                                      tiled_norms=name == NORMS_IN)
        out[name] = {
            "loss_rel": abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()),
            "grad_rel": max(_rel(g, r) for g, r in zip(grads, ref_grads)),
            "param_rel": max(_rel(p, r) for p, r in zip(params, ref_params)),
            "param_moved": max(_rel(p, r) for p, r in zip(params, [q.detach() for q in tiny_model("llama").parameters()])),
            "counts": counts, **stats,
        }
    return out


if importlib.util.find_spec("deepspeed") is not None and importlib.util.find_spec("transformers") is not None:
    case("tiling/deepspeed", (4,))(lambda env: ds_tiling(_topo_for(env, Parity(sp_size=2), "zigzag")))
