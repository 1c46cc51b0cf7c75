"""``--export-hf``: the trained model as a Hugging Face directory that ``from_pretrained`` loads."""

from __future__ import annotations

import contextlib

import torch.distributed as dist

from ..integrations.transformers import remove_sequence_parallel

__all__ = ["export_hf"]


def export_hf(engine, path: str, tokenizer=None) -> None:
    """Write ``save_pretrained`` weights (in the dtype the engine computes in), config and
    tokenizer to ``path`` on rank 0. Collective: every rank calls it (ZeRO-3 gathers each
    rank's partitions). Switches the model back from SP attention; it is not trained further."""
    import deepspeed

    model = remove_sequence_parallel(engine.module)
    gathered = deepspeed.zero.GatheredParameters(list(model.parameters())) if engine.zero_optimization_stage() == 3 else contextlib.nullcontext()
    with gathered:
        state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()} if dist.get_rank() == 0 else None
    if dist.get_rank() == 0:
        dtype = next(iter(state.values())).dtype
        model.config.dtype = dtype  # what from_pretrained loads it as
        model.save_pretrained(path, state_dict=state)
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
    dist.barrier()
