"""FSDP2 with SP (ulysses_sp/integrations/fsdp.py), inside the spawned ranks; assertions in
tests/test_fsdp.py. Every case trains a tiny Llama sharded over all the ranks (SP = 2, DP = the
rest) and returns the largest difference of its parameters from one process trained on the
same global batch."""

from __future__ import annotations

import copy
import importlib.util

import torch
import torch.nn.functional as F

import ulysses_sp as usp

from .cases import Env, case

SEQ, VOCAB = 40, 64
VARIANTS = {"plain": {}, "tiled": {"tiled_mlp": 8}}
"""What apply_sequence_parallel gets; "tiled" also takes the loss through causal_lm_loss (tiles of the head)."""


def _model(family: str = "llama"):
    from .hf_trainer_cases import model_for

    return model_for({"family": family})  # tiny_model for the attention families; hybrids from tests/model_families.py


def _batch(samples: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (samples, SEQ), generator=g)
    labels = ids.clone()
    labels[0, : 5 + seed % 7] = -100  # uneven target counts: the token weighting matters
    return {"input_ids": ids, "labels": labels}


def _token_sums(model, data: dict) -> tuple[torch.Tensor, int]:
    """One process: the summed token losses of ``data`` and their count."""
    logits = model(input_ids=data["input_ids"]).logits
    targets = data["labels"][:, 1:]
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), targets.reshape(-1), ignore_index=-100, reduction="sum"), int((targets != -100).sum())


def _loss(model, local: dict, topo, variant: str, count_group=None):
    if variant == "tiled":
        return usp.causal_lm_loss(model, local, topo, count_group=count_group)
    return usp.sp_cross_entropy(model(**usp.model_inputs(local)).logits, local["shift_labels"], topo, count_group=count_group)


def _sharded(ref, topo, variant: str, **fsdp):
    from ulysses_sp.integrations.fsdp import apply_fsdp2

    model = copy.deepcopy(ref)
    usp.apply_sequence_parallel(model, topo, **VARIANTS[variant])
    return apply_fsdp2(model, topo, **fsdp)


def _max_difference(model, ref) -> float:
    return max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))


def sgd_step(topo, variant: str, divide_factor=None, family: str = "llama") -> float:
    """One SGD step; each SP group's loss its samples' token mean (sp_cross_entropy's default),
    the DP groups averaged: the one-process loss is the mean of the samples' token means."""
    ref = _model(family)
    model = _sharded(ref, topo, variant, gradient_divide_factor=divide_factor)
    data = _batch(topo.dp_size, seed=1)
    torch.stack([s / n for s, n in (_token_sums(ref, {k: v[i : i + 1] for k, v in data.items()}) for i in range(topo.dp_size))]).mean().backward()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    local = usp.shard_batch({k: v[topo.dp_rank : topo.dp_rank + 1] for k, v in data.items()}, topo)
    _loss(model, local, topo, variant).backward()
    optimizer.step()
    return _max_difference(model, ref)


def adamw_steps(topo, variant: str, steps: int = 3, accumulation: int = 2, equal_weights: bool = False) -> float:
    """Three AdamW steps of two micro-batches each; the loss the token mean of the whole step's
    global batch (count over the world, each micro-batch weighted by its share of the step's
    targets, as the job does), so the gradient is the plain sum: divide factor 1."""
    import torch.distributed as dist

    ref = _model()
    model = _sharded(ref, topo, variant, gradient_divide_factor=1)
    # AdamW moves an element by about lr x g / (|g| + eps): where |g| is near eps it multiplies the
    # fp32 rounding between the shards' summation order and one process's (every gradient agreed
    # within 3e-8) by about lr / eps. Measured, 3 steps: lr 1e-3, eps 1e-8: 1.4e-6 apart; lr 1e-2,
    # eps 1e-6: 3.4e-6 (SP = 2) and 6.9e-6 (DP 2 x SP 2); lr 1e-4, eps 1e-6: at most 5.2e-8,
    # while the micro-batches weighted wrongly move the parameters 2.0e-4 apart (the control below).
    ref_opt, opt = (torch.optim.AdamW(m.parameters(), lr=1e-4, eps=1e-6, weight_decay=0.1) for m in (ref, model))
    for step in range(steps):
        micro = [_batch(topo.dp_size, seed=10 * step + j) for j in range(accumulation)]
        total = sum(int((m["labels"][:, 1:] != -100).sum()) for m in micro)
        for m in micro:
            s, _ = _token_sums(ref, m)
            (s / total).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for m in micro:
            local = usp.shard_batch({k: v[topo.dp_rank : topo.dp_rank + 1] for k, v in m.items()}, topo)
            n = int((m["labels"][:, 1:] != -100).sum())
            weight = 1 / accumulation if equal_weights else n / total  # equal: the wrong weighting the control checks
            (_loss(model, local, topo, variant, count_group=dist.group.WORLD) * weight).backward()
        opt.step()
        opt.zero_grad()
    return _max_difference(model, ref)


if importlib.util.find_spec("transformers") is not None:

    @case("fsdp/", worlds=(2, 3, 4))
    def _fsdp(env: Env):
        """SP = 2 (DP = 2 on 4 ranks), SP = 3 on 3 ranks."""
        topo = env.topo(3 if env.world == 3 else 2)
        return {f"{what.__name__}-{variant}": what(topo, variant) for what in (sgd_step, adamw_steps) for variant in VARIANTS}

    @case("fsdp-placements/", worlds=(2,))
    def _placements(env: Env):
        """One SGD step under the contiguous and balanced layouts (zigzag: the case above), and a
        hybrid model (Qwen3.5: Gated DeltaNet layers under their mixer strategy, and attention)."""
        out = {layout: sgd_step(env.topo(2, layout=layout), "plain") for layout in ("contiguous", "balanced")}
        out["qwen3_5"] = sgd_step(env.topo(2), "plain", family="qwen3_5")
        return out

    @case("fsdp-options/", worlds=(2,))
    def _options(env: Env):
        """fully_shard's options pass through: bf16 parameters with fp32 reductions, no resharding
        after the forward, CPU offload. Gradients of one step of the tiled variant, relative to one
        process's in fp32."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        topo, out = env.topo(2), {}
        options = {"bf16": {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)},
                   "no-reshard": {"reshard_after_forward": False}, "offload": {"offload_policy": CPUOffloadPolicy(pin_memory=False)}}
        for name, kwargs in options.items():
            ref = _model()
            model = _sharded(ref, topo, "tiled", **kwargs)
            data = _batch(1, seed=3)
            _loss(model, usp.shard_batch(data, topo), topo, "tiled").backward()
            summed, count = _token_sums(ref, data)
            (summed / count).backward()
            out[name] = max(((p.grad.full_tensor().float() - q.grad).abs().max() / q.grad.abs().max()).item()
                            for p, q in zip(model.parameters(), ref.parameters()))
        return out

    @case("fsdp-wrong/", worlds=(4,))
    def _wrong(env: Env):
        """Two wrong trainings the comparisons must catch: one SGD step with FSDP2's own averaging
        over all ranks (divide factor = world), and AdamW with the micro-batches weighted equally
        instead of by their targets (Adam is blind to a constant factor, not to a wrong mix)."""
        return {"sgd": sgd_step(env.topo(2), "plain", divide_factor=env.world), "adamw": adamw_steps(env.topo(2), "plain", equal_weights=True)}
