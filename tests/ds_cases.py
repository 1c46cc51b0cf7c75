"""DeepSpeed cases (inside the spawned ranks; deepspeed imported lazily)."""

from __future__ import annotations

import copy
import dataclasses
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ulysses_sp as usp
from ulysses_sp.integrations.deepspeed import (
    DistributedAttention,
    SequenceParallelMPU,
    gradient_scale,
    use_cpu_accelerator_if_needed,
)

from .hf_cases import tiny_model

SEQ = 40
STAGES = [(0, True), (1, True), (1, False), (2, True), (2, False), (3, True), (3, False)]


def _global_batch(dp_size: int) -> dict:
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 64, (dp_size, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :5] = -100  # uneven valid-token counts across DP groups: token weighting matters
    return {"input_ids": ids, "labels": labels}


def _ds_config(stage: int, reduce_scatter: bool) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": stage, "reduce_scatter": reduce_scatter},
        "steps_per_print": 10**9,
    }


def ds_gradients(topo, stage: int, reduce_scatter: bool) -> dict:
    """The gradient DeepSpeed holds after engine.backward (before step) against the one-process
    gradient of the same global batch; ``ratio`` is the mean over parameters of their gradient norms,
    engine over one process (1 when no constant factor is left)."""
    use_cpu_accelerator_if_needed()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "usp-torch-extensions"))
    import deepspeed
    from deepspeed.utils import safe_get_full_grad


    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    data = _global_batch(topo.dp_size)
    logits = ref(input_ids=data["input_ids"]).logits
    F.cross_entropy(logits[:, :-1].reshape(-1, 64), data["labels"][:, 1:].reshape(-1), ignore_index=-100).backward()

    usp.apply_sequence_parallel(model, topo, backend="ulysses")
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.0), config=_ds_config(stage, reduce_scatter),
        mpu=SequenceParallelMPU(topo),
    )
    mine = {k: v[topo.dp_rank : topo.dp_rank + 1] for k, v in data.items()}
    local = usp.shard_batch(mine, topo)
    out = engine(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
    loss = usp.sp_cross_entropy(out, local["shift_labels"], topo, count_group=dist.group.WORLD)
    scale = gradient_scale(engine, topo)
    engine.backward(loss * scale)
    worst, ratios = 0.0, []
    for p, p_ref in zip(engine.module.parameters(), ref.parameters()):
        grad = safe_get_full_grad(p)
        worst = max(worst, ((grad - p_ref.grad).abs().max() / p_ref.grad.abs().max()).item())
        ratios.append((grad.norm() / p_ref.grad.norm()).item())
    engine.destroy()
    return {"rel_err": worst, "ratio": sum(ratios) / len(ratios), "scale": scale}


def distributed_attention(topo) -> dict:
    """The drop-in DistributedAttention against DeepSpeed's own and one-process attention: out, dq, dk, dv."""
    use_cpu_accelerator_if_needed()
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention as DeepSpeedDA

    deepspeed.init_distributed(dist_backend="gloo")  # its backward asks DeepSpeed's comm for the world size


    from .reference import reference_attention

    def local_attention(q, k, v):  # [s, b, h, d] in, as DeepSpeed-Ulysses code writes it
        return reference_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)).transpose(0, 1)

    g = torch.Generator().manual_seed(3)
    s, b, h, d = 16, 2, 4, 8
    full = [torch.randn(s, b, h, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(3)]
    dout = torch.randn(s, b, h, d, generator=g, dtype=torch.float64)
    ref = local_attention(*full)
    ref.backward(dout)
    contiguous = dataclasses.replace(topo, layout="contiguous")

    def run(attention):  # this rank's output and the gradients of its q, k, v shards
        shards = [usp.shard_sequence(t.detach(), contiguous, dim=0).requires_grad_() for t in full]
        out = attention(*shards, batch_dim_idx=1)
        out.backward(usp.shard_sequence(dout, contiguous, dim=0))
        return [out.detach()] + [t.grad for t in shards]

    ours = run(DistributedAttention(local_attention, topo.sp_group))
    theirs = run(DeepSpeedDA(local_attention, topo.sp_group, scatter_idx=2, gather_idx=0))
    mine_ref = [usp.shard_sequence(t, contiguous, dim=0) for t in (ref.detach(), *(x.grad for x in full))]
    return {"vs_reference": max((a - r).abs().max().item() for a, r in zip(ours, mine_ref)),
            "vs_deepspeed": max((a - t).abs().max().item() for a, t in zip(ours, theirs)),
            "grad_scale": min(x.abs().max().item() for x in mine_ref[1:])}

