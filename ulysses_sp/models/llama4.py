"""Llama 4's attention under SP: chunked layers and the NoPE layers' query temperature.

- A ``chunked_attention`` layer (``config.layer_types``) attends causally within blocks of
  ``config.attention_chunk_size`` positions: the blocks are extra document boundaries, a cut at
  every multiple of the chunk size inside each document (a packed document is computed as if
  alone, as every packed row is here), so each backend runs them as packed documents.
- A NoPE layer with ``attn_temperature_tuning`` scales its queries by
  ``1 + attn_scale * log1p(floor((i + 1) / floor_scale))``, i the token's index in the row
  (``arange(S)`` in transformers). On a shard that index is the rank's, not the row's: the
  layer's own scaling is turned off while switched, and the attention function applies it from
  the global positions (``position_ids``, which a model pre-hook records: the decoder layers do
  not pass them on), in the same dtypes as transformers.
"""

from __future__ import annotations

import torch

__all__ = ["install", "remove", "boundaries", "chunked_boundaries", "scale_queries"]

_CHUNK = "_ulysses_sp_chunk"
_TEMPERATURE = "_ulysses_sp_temperature"
_POSITIONS = "_ulysses_sp_positions_hook"


def boundaries(module, cu_seqlens, seq_len: int) -> tuple[int, ...] | None:
    """A switched chunked-attention layer's documents with its chunk cuts (`chunked_boundaries`),
    computed once per model forward for every layer of that chunk size (one host read); None for
    any other layer."""
    if _CHUNK not in module.__dict__:
        return None
    chunk, context = module.__dict__[_CHUNK]
    if chunk not in context["chunked"]:
        context["chunked"][chunk] = chunked_boundaries(cu_seqlens, seq_len, chunk)
    return context["chunked"][chunk]


def _chunked(module) -> int | None:
    config = getattr(module, "config", None)
    chunk = getattr(config, "attention_chunk_size", None)
    types = getattr(config, "layer_types", None) or ()
    idx = getattr(module, "layer_idx", None)
    return chunk if chunk and idx is not None and idx < len(types) and types[idx] == "chunked_attention" else None


def install(model, layers) -> None:
    """Mark ``layers``' chunked layers with their chunk size, and move the query temperature of
    their NoPE layers into the attention function (positions recorded by a model pre-hook)."""
    remove(model, layers)
    context: dict = {"chunked": {}}  # this forward's position_ids, and its boundaries per chunk size
    tuned = [m for m in layers if getattr(m, "attn_temperature_tuning", False) and not getattr(m, "use_rope", True)]
    chunked = [(m, _chunked(m)) for m in layers if _chunked(m)]
    for module, chunk in chunked:
        module.__dict__[_CHUNK] = (chunk, context)
    for module in tuned:
        module.__dict__[_TEMPERATURE] = context
        module.attn_temperature_tuning = False  # remove() sets it back
    if tuned or chunked:
        def record(_, args, kwargs):
            context.update(ids=kwargs.get("position_ids"), chunked={})

        model.__dict__[_POSITIONS] = model.register_forward_pre_hook(record, with_kwargs=True)


def remove(model, layers) -> None:
    handle = model.__dict__.pop(_POSITIONS, None)
    if handle is not None:
        handle.remove()
    for module in layers:
        module.__dict__.pop(_CHUNK, None)
        if module.__dict__.pop(_TEMPERATURE, None) is not None:
            module.attn_temperature_tuning = True


def chunked_boundaries(cu_seqlens, seq_len: int, chunk: int) -> tuple[int, ...]:
    """Document boundaries ``(0, ..., seq_len)`` (None: one document) with a cut added at every
    multiple of ``chunk`` inside each document."""
    bounds = [0, seq_len] if cu_seqlens is None else [int(x) for x in cu_seqlens]
    out = [0]
    for start, end in zip(bounds, bounds[1:]):
        out += list(range(start + chunk, end, chunk)) + [end]
    return tuple(out)


def scale_queries(module, query_bhsd: torch.Tensor) -> torch.Tensor:
    """The NoPE layer's temperature of ``query`` ``[B, H, S/P, D]`` from each token's global position,
    computed as transformers computes it from the row index."""
    positions = module.__dict__.get(_TEMPERATURE)
    if positions is None:
        return query_bhsd
    ids = positions.get("ids")
    if ids is None:
        raise ValueError(f"{type(module).__name__} (layer {module.layer_idx}): the query temperature of Llama 4's NoPE layers needs the "
                         "global position_ids (ulysses_sp.model_inputs(ulysses_sp.shard_batch(batch, topo)))")
    scales = torch.log1p(torch.floor((ids.to(query_bhsd.device).float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0
    return (query_bhsd * scales.expand(query_bhsd.shape[0], -1)[:, None, :, None]).to(query_bhsd.dtype)
