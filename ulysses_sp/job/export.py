"""``--export-hf``: the trained model as a Hugging Face directory that ``from_pretrained`` loads."""

from __future__ import annotations

import torch.distributed as dist

from ..models.switch import remove_sequence_parallel

__all__ = ["export_hf"]


GATHER_BYTES = 1 << 30
"""ZeRO-3 gathers the full parameters in groups of at most this many bytes (or one larger
parameter), so no rank ever holds the whole model: the point of ZeRO-3."""


def _groups(params) -> list[list]:
    groups, size = [[]], 0
    for p in params:
        n = getattr(p, "ds_numel", p.numel()) * p.element_size()
        if groups[-1] and size + n > GATHER_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += n
    return groups


def export_hf(engine, path: str, tokenizer=None, wait_group=None) -> None:
    """Write ``save_pretrained`` weights (in the dtype the engine computes in), config and
    tokenizer (or an image-text model's processor) to ``path`` on rank 0. Collective: every rank calls it (ZeRO-3 gathers the
    partitions group by group, `GATHER_BYTES` at a time, and rank 0 copies each to host
    memory). Switches the model back from SP attention; it is not trained further. The ranks
    wait for rank 0's writing on ``wait_group`` (default: the world's)."""
    model = remove_sequence_parallel(engine.module)
    rank0 = dist.get_rank() == 0
    if hasattr(engine, "full_state_dict"):  # --engine fsdp2: its shards gathered to rank 0's CPU
        state = engine.full_state_dict()
        model.config.architectures = [engine.architecture]
    elif engine.zero_optimization_stage() == 3:
        import deepspeed

        names = {}  # a parameter under each of its names (tied weights have two)
        for name, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(p, []).append(name)
        state = {}
        for group in _groups(list(names)):
            with deepspeed.zero.GatheredParameters(group):
                if rank0:
                    for p in group:
                        for name in names[p]:
                            state[name] = p.detach().cpu().clone()
        if rank0:  # buffers are not partitioned
            state.update({k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in state})
    else:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if rank0 else None
    if rank0:
        dtype = next(v.dtype for v in state.values() if v.is_floating_point())
        model.save_pretrained(path, state_dict=state)
        model.config.dtype = dtype  # what from_pretrained loads it as: save_pretrained wrote the parameters' (FSDP2's float32 masters)
        model.config.save_pretrained(path)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    dist.barrier(group=wait_group)
