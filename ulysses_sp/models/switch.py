"""Sequence parallelism for Hugging Face causal LMs through transformers' attention interface.

``apply_sequence_parallel(model, topo)`` registers the ``"ulysses_sp"``
attention implementation (and a mask function that builds no mask: causal
masking, sliding windows and packed documents are handled inside the backends;
each layer's ``sliding_window`` and ``softcap`` go to its backend), gives every
attention layer its own `SequenceParallelAttention` (so ``auto`` can
choose per layer) and switches the model to it. Inputs are this rank's shards
from `ulysses_sp.shard_batch`; pass its ``position_ids`` (global, so
rotary embeddings are right on every rank) and, for packed input,
``cu_seq_lens_q=local["cu_seqlens"]``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from .. import kernels
from ..attention import SequenceParallelAttention
from ..dropout import install_rank_dropout, remove_rank_dropout
from ..profile import Profile
from ..topology import Topology
from .. import tiling
from ..decoder_layers import decoder_layers
from . import coverage, image_text, llama4, token_mixers

__all__ = ["ATTN_IMPLEMENTATION", "apply_sequence_parallel", "chosen_backends", "remove_sequence_parallel", "sp_attention_forward",
           "switched_model"]

ATTN_IMPLEMENTATION = "ulysses_sp"
"""The ``attn_implementation`` name of SP attention in transformers' ``AttentionInterface``.

A switched model's ``config._attn_implementation``; its attention function is ``sp_attention_forward``.
"""
_STATE = "_ulysses_sp_attention"
_PREVIOUS = "_ulysses_sp_previous"


def _unsupported(module, what: str, fix: str) -> ValueError:
    spa, mixer = module.__dict__.get(_STATE), module.__dict__.get(coverage.MIXER)
    under = f"backend {spa.backend!r}" if spa is not None else f"mixer {mixer[0].name!r}" if mixer is not None else "backend '?'"
    return ValueError(f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}): {what} is not supported by ulysses_sp ({under}); {fix}")


def sp_attention_forward(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, is_causal: bool | None = None,
                         sliding_window: int | None = None, softcap: float | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="ulysses_sp"``.

    Runs the module's `SequenceParallelAttention` on this rank's shards. Registered with
    ``AttentionInterface`` on import; `apply_sequence_parallel` switches models to it.

    Args:
        module: The attention layer calling it (switched by `apply_sequence_parallel`).
        query: ``[B, Hq, S/P, D]``.
        key: ``[B, Hkv, S/P, D]``.
        value: ``[B, Hkv, S/P, Dv]``.
        attention_mask: None, or a mask that masks nothing (the backends handle causality,
            windows and packed documents themselves).
        dropout: Attention dropout; only 0 in training.
        scaling: Scale of the scores (default: ``1 / sqrt(D)``).
        is_causal: Must be causal (default: the module's ``is_causal``).
        sliding_window: The layer's window (Mistral, Qwen2, Gemma 2/3, GPT-OSS; None on full
            layers): query i sees keys ``i - W < j <= i``, as ``masking_utils.sliding_window_overlay``
            and flash-attn's ``window_size=(W - 1, W - 1)``.
        softcap: Gemma 2's ``attn_logit_softcapping``: scores capped at ``softcap * tanh(s / softcap)``.
        **kwargs: What transformers passes besides; ``cu_seq_lens_q`` (packed documents),
            ``s_aux`` (learned attention sinks, one logit per head: GPT-OSS and its kin) and
            ``ulysses_sp_blocks`` (each batch row's bidirectional image blocks, from the image-text
            split: Gemma 3, PaliGemma, and Gemma 4 on its sliding layers) are used; under the ``indexed``
            strategy (DeepSeek Sparse Attention), ``indices`` (the indexer's choice) and the mask of this
            rank's rows go to the strategy's ``attend``, as the ``compressed`` strategy's call goes to its own
            (DeepSeek-V4).

    Returns:
        The output ``[B, S/P, Hq, Dv]`` and None (no attention weights).

    Raises:
        RuntimeError: The module was not switched by `apply_sequence_parallel`.
        ValueError: What SP does not support, naming the layer: attention dropout in
            training, an additive bias or padding mask, a KV cache with past
            tokens (generation), bidirectional attention, or a mask under torch.compile.
    """
    spa = module.__dict__.get(_STATE)
    whole = spa is None and coverage.MIXER in module.__dict__  # the module runs on the gathered sequence under a mixer strategy
    if spa is None and not whole:
        raise RuntimeError(f"attn_implementation {ATTN_IMPLEMENTATION!r} needs ulysses_sp.apply_sequence_parallel(model, topo) first")
    if not whole:
        coverage.mark_called(module, kwargs)
    if dropout and module.training:
        raise _unsupported(module, f"attention dropout ({dropout})", "set config.attention_dropout = 0 for training")
    attend = getattr(module.__dict__[coverage.MIXER][0], "attend", None) if whole else None
    if attend is not None:  # DeepSeek Sparse Attention: this rank's queries over the gathered keys, by its mask and the indexer's choice
        return attend(module, query, key, value, attention_mask, scaling, kwargs.get("indices"), kwargs.get("s_aux")), None
    if kwargs.get("position_bias") is not None:
        raise _unsupported(module, "an additive attention (position) bias", "use a model without one")
    # a mask is dropped here, so only one that masks nothing may pass: all True, or (additive) all 0
    if attention_mask is not None and torch.compiler.is_compiling():  # reading it back would be a graph break
        raise _unsupported(module, "an attention mask under torch.compile", "drop attention_mask (shard_batch's batches need none)")
    if attention_mask is not None and not bool(attention_mask.all() if attention_mask.dtype == torch.bool else (attention_mask == 0).all()):
        raise _unsupported(module, "a padding attention mask or an additive bias", "pad on the right with ulysses_sp.shard_batch and drop attention_mask")
    past = kwargs.get("past_key_values")
    if key.shape[2] != query.shape[2] or (past is not None and past.get_seq_length() > 0):
        raise _unsupported(module, f"a KV cache with past tokens ({key.shape[2]} keys for {query.shape[2]} queries: generation)",
                           "call remove_sequence_parallel(model) to generate")
    if not (is_causal if is_causal is not None else getattr(module, "is_causal", True)):
        # a causal LM attending to later tokens sees its labels; and under SP the right padding would be attended to
        raise _unsupported(module, "bidirectional self-attention (is_causal=False)",
                           "train a causal LM (BERT-style models: set config.is_decoder=True)")
    if whole:
        return _whole_sequence_attention(query, key, value, scaling, sliding_window, softcap, kwargs.get("s_aux")), None
    query, cu_seqlens = llama4.scale_queries(module, query), kwargs.get("cu_seq_lens_q")
    chunked = llama4.boundaries(module, cu_seqlens, query.shape[2] * spa.topo.sp_size)  # Llama 4's chunked layers: cuts in each document
    cu_seqlens = cu_seqlens if chunked is None else chunked
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    options = dict(causal=True, softmax_scale=scaling, cu_seqlens=cu_seqlens, window=sliding_window, softcap=softcap, sinks=kwargs.get("s_aux"))
    rows = kwargs.get(coverage.BLOCKS)
    if rows and not image_text.takes_blocks(module, sliding_window):
        rows = None
    if not rows or len(set(rows)) == 1:
        return spa(q, k, v, **options, blocks=rows[0] if rows else None), None
    # each row's own image blocks: one call per row (every rank holds the same rows, so the calls match)
    return torch.cat([spa(q[i:i + 1], k[i:i + 1], v[i:i + 1], **options, blocks=blocks) for i, blocks in enumerate(rows)]), None


def _whole_sequence_attention(query, key, value, scaling, sliding_window, softcap, sinks):
    """Causal attention of an attention module that a mixer strategy runs on the whole gathered
    sequence (one document at a time when packed): ZAYA's attention, whose q/k projection holds
    a convolution over the sequence, runs under the allgather mixer. The kernels take GQA as it is."""
    return kernels.local_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), causal=True, scale=scaling,
                                   window=sliding_window, softcap=softcap or 0.0, sinks=sinks)


def _mask_parts(fn, seen=None):
    """The mask functions composed into ``fn``: transformers' ``or_masks`` / ``and_masks`` keep their
    parts in their closures."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return
    seen.add(id(fn))
    yield fn
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            held = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        for part in held if isinstance(held, tuple) else (held,):
            if callable(part):
                yield from _mask_parts(part, seen)


def _no_mask(*args, config=None, use_vmap=False, mask_function=None, **kwargs):
    """Masks are the backends' business: causal via the flag, sliding windows via the
    ``sliding_window`` kwarg of each layer, documents via cu_seqlens. transformers calls
    this for ``create_causal_mask`` and ``create_sliding_window_causal_mask`` alike, so no
    S x S mask is built for either kind of layer, nor for Llama 4's chunked layers (their chunks
    are boundaries the attention function adds). Masks the backends cannot reproduce (overlays such
    as bidirectional or image-token blocks) raise."""
    if use_vmap:  # transformers sets it exactly when an or_mask_function / and_mask_function overlays the mask
        raise ValueError("a mask overlay (or_mask_function / and_mask_function: bidirectional attention, image-token blocks) "
                         "is not supported by ulysses_sp")
    # block_sequence_ids (Gemma 3's and PaliGemma's image blocks, HRM's prefix-LM prefix) overlay without use_vmap
    if mask_function is not None and any(getattr(f, "__qualname__", "").startswith("blockwise_overlay") for f in _mask_parts(mask_function)):
        raise ValueError("a bidirectional block overlay (block_sequence_ids: image tokens or a prefix attending to each other both ways) "
                         "is not supported by ulysses_sp")
    return None


AttentionInterface.register(ATTN_IMPLEMENTATION, sp_attention_forward)
AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)


def _attention_layers(model):
    """The attention modules with a layer index: classes named ``...Attention``, and those whose name
    does not say attention but whose forward calls the attention interface (LongCat-Flash's MLA)."""
    named = lambda m: type(m).__name__.endswith("Attention") or "Attention" not in type(m).__name__ and coverage.routes_attention(m)  # noqa: E731
    return [m for m in model.modules() if named(m) and hasattr(m, "layer_idx") and coverage.MIXER not in m.__dict__]


def _backend_per_layer(backend, layers) -> dict[int, str]:
    indices = sorted({layer.layer_idx for layer in layers})
    if isinstance(backend, str):
        return dict.fromkeys(indices, backend)
    if callable(backend):
        return {i: backend(i) for i in indices}
    names = list(backend)
    if len(names) != len(indices):
        raise ValueError(f"a per-layer backend list needs one name per attention layer ({len(indices)}), got {len(names)}: {names}")
    return dict(zip(indices, names))


def apply_sequence_parallel(model: nn.Module, topo: Topology, backend: str | list[str] | Callable[[int], str] = "auto",
                            profile: Profile | None = None, kernel: str = "auto", tiled_mlp: bool | int = False, checkpoint: str = "none",
                            mixer: str = "auto", tiled_norms: bool = False) -> nn.Module:
    """Switch a model to SP attention and token mixers: documented at `ulysses_sp.apply_sequence_parallel`."""
    decoder = image_text.decoder_to_switch(model)
    if decoder is not None:
        apply_sequence_parallel(decoder, topo, backend, profile, kernel, tiled_mlp, checkpoint, mixer, tiled_norms)
        image_text.split_at_decoder(model, decoder, topo)
        return model
    token_mixers.install_mixers(model, topo, mixer)
    try:
        coverage.check_coverage(model)
        tile_tokens = tiling.validate_options(tiled_mlp, checkpoint)
        if checkpoint != "none" and tiling.hf_checkpointing(model):
            raise ValueError(f"checkpoint={checkpoint!r} replaces transformers' gradient checkpointing; call model.gradient_checkpointing_disable() "
                             "first or pass checkpoint='none'")
        if tile_tokens is not None and not any("mlp" in layer._modules for layer in decoder_layers(model)):
            raise ValueError(f"tiled_mlp: {type(model).__name__} has no decoder layer with an `mlp` module to tile")
        if not isinstance(tiled_norms, bool):
            raise ValueError(f"tiled_norms must be True or False, got {tiled_norms!r}")
        if tiled_norms and not tiling.norms(model):
            raise ValueError(f"tiled_norms: {type(model).__name__} has no norm (a module named *Norm) in or beside its decoder layers")
        layers = _attention_layers(model)
        if not layers and not token_mixers.mixer_layers(model):
            raise ValueError(f"{type(model).__name__} has no attention layers with a layer_idx and no token mixer; ulysses_sp cannot switch it")
        per_layer = _backend_per_layer(backend, layers)
    except ValueError:
        token_mixers.remove_mixers(model)
        raise
    if _PREVIOUS not in model.__dict__:
        model.__dict__[_PREVIOUS] = (model.config._attn_implementation, model.config.use_cache)
    for layer in layers:  # plain attribute, not a submodule: state_dict and parameters stay as they were
        layer.__dict__[_STATE] = SequenceParallelAttention(
            topo, backend=per_layer[layer.layer_idx], layer_idx=layer.layer_idx, profile=profile, kernel=kernel
        )
    llama4.install(model, layers)
    tiling.untile_mlp(model)
    tiling.uncheckpoint_layers(model)
    if tile_tokens is not None:
        tiling.tile_mlp(model, tile_tokens, sp_size=topo.sp_size)
    if tiled_norms:
        tiling.tile_norms(model, tile_tokens or 0, sp_size=topo.sp_size)
    tiling.checkpoint_layers(model, checkpoint)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    model.config.use_cache = False
    coverage.install_guards(model, topo.sp_size)
    install_rank_dropout(model, topo)
    return model


def switched_model(model: nn.Module) -> nn.Module | None:
    """The module that `apply_sequence_parallel` switched, while it is switched.

    Its ``config.use_cache`` is SP's (off).

    Args:
        model: The model given to `apply_sequence_parallel`.

    Returns:
        The model itself, or an image-text model's text decoder; None when not switched.
    """
    switched = image_text.text_decoder(model) if image_text.is_split(model) else model
    return switched if switched is not None and _PREVIOUS in switched.__dict__ else None


def chosen_backends(model: nn.Module) -> dict[int, list[str]]:
    """The backends each attention layer has run so far (``auto`` may pick one per shape).

    Args:
        model: A model switched by `apply_sequence_parallel`.

    Returns:
        Layer index -> backend names, sorted. Layers whose attention has not run (an encoder's,
            a cross-attention's under the same index) are left out.
    """
    chosen: dict[int, set[str]] = {}
    for m in model.modules():
        if _STATE in m.__dict__ and m.__dict__[_STATE]._chosen:
            chosen.setdefault(m.layer_idx, set()).update(b.name for b in m.__dict__[_STATE]._chosen.values())
    return {layer: sorted(names) for layer, names in sorted(chosen.items())}


def remove_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo `apply_sequence_parallel`: documented at `ulysses_sp.remove_sequence_parallel`."""
    if image_text.unsplit(model):
        remove_sequence_parallel(image_text.text_decoder(model))
        return model
    previous = model.__dict__.pop(_PREVIOUS, None)
    if previous is None:
        return model
    for layer in _attention_layers(model):
        layer.__dict__.pop(_STATE, None)
    llama4.remove(model, _attention_layers(model))
    coverage.remove_guards(model)
    remove_rank_dropout(model)
    token_mixers.remove_mixers(model)
    tiling.untile_mlp(model)
    tiling.uncheckpoint_layers(model)
    attn_implementation, use_cache = previous
    model.set_attn_implementation(attn_implementation)
    model.config.use_cache = use_cache
    return model


