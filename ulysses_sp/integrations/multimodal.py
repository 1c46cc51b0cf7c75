"""Image- and video-text models under SP: only the text decoder is switched, and the sequence is
split at the decoder's input.

The model's own forward runs as in one process on the whole sequence: it embeds the tokens, merges
the image and video features at their placeholder tokens and numbers the positions (Qwen's
multimodal RoPE too). A forward pre-hook on the text decoder then keeps this rank's shard of the
embeddings, the positions (each packed document numbered from 0) and Qwen3-VL's deepstack
features, so an image may straddle any shard boundary and a rank may hold none.

A forward pre-hook on the whole model refuses position ids and padding masks (before any
collective), takes ``cu_seq_lens_q`` (packed documents, or the balanced layout's placement) out of
the keyword arguments, which the model would also hand its vision tower, for the decoder, and, for
the families of ``ENCODE_ONCE`` (Qwen's, LLaVA), encodes each image and video on one rank of the SP
group and all-gathers the features into ``mm_encoder_outputs``. Other families (SmolVLM) run their
vision tower on every image on every rank. The vision tower keeps its own (bidirectional) attention;
summing its gradients over the SP group, as for any replicated parameter, gives the one-process
gradient either way.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import ModelOutput

from .. import comm
from ..data import shard_sequence
from ..topology import Topology
from . import coverage

__all__ = ["ENCODE_ONCE", "TESTED", "decoder_to_switch", "is_split", "text_decoder", "split_at_decoder", "unsplit"]

_HOOKS = "_ulysses_sp_multimodal"


TESTED = ("llava", "qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "smolvlm")
"""``config.model_type`` of the image-text families that tests/test_multimodal.py holds exact; the
others are refused by name until a test holds them too."""
_AUDIO = re.compile(r"^audio_|^input_features$|^input_values$")


def text_decoder(model) -> nn.Module | None:
    """The text decoder of an image- or video-text model (``model.get_decoder()``), or None."""
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def decoder_to_switch(model) -> nn.Module | None:
    """None for a text model, the text decoder of a tested image- or video-text family; raises
    ``ValueError`` naming any other model with inputs besides text (audio-text models included).
    (Switching a whole image-text model once ran SmolVLM's vision tower under the text decoder's
    attention and cut images at shard boundaries: the loss off by a relative 1.04.)"""
    others = coverage.other_modalities(model)
    if not others:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    decoder = None if any(_AUDIO.search(n) for n in others) or model_type not in TESTED else text_decoder(model)
    if decoder is None:
        raise ValueError(
            f"{type(model).__name__} ({model_type}) takes inputs besides text ({', '.join(others)}): ulysses_sp splits the "
            f"sequences of the image- and video-text families it tests ({', '.join(TESTED)}), not this one's; train its text "
            "model alone (built from its text config) or without sequence parallelism"
        )
    return decoder


def _per_document(position_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Positions numbered from 0 in each packed document: a document's positions, computed on the
    whole row, are its own plus the (per-axis) position of its first token."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(position_ids.device)
    first = torch.repeat_interleave(cu_seqlens[:-1].to(position_ids.device), lengths)
    return position_ids - position_ids.index_select(-1, first)


def _deepstack(visual_bs: torch.Tensor, features: list, topo: Topology, cu) -> tuple[torch.Tensor, list]:
    """This rank's part of Qwen3-VL's visual-token mask ``[B, S]`` and of each deepstack level's
    features (one row per visual token, in the mask's row-major order)."""
    index_bs = torch.full(visual_bs.shape, -1, dtype=torch.long, device=visual_bs.device)
    index_bs[visual_bs] = torch.arange(int(visual_bs.sum()), device=visual_bs.device)
    local_bs = shard_sequence(index_bs, topo, dim=1, cu_seqlens=cu)
    held = local_bs[local_bs >= 0]
    return local_bs >= 0, [rows.index_select(0, held.to(rows.device)) for rows in features]


def owners(work: list[int], ranks: int) -> list[int]:
    """The rank that encodes each image or video: the most work first, each to the least loaded rank
    (ties: the lowest), the same on every rank."""
    load, owner = [0] * ranks, [0] * len(work)
    for i in sorted(range(len(work)), key=lambda i: (-work[i], i)):
        owner[i] = min(range(ranks), key=lambda r: (load[r], r))
        load[owner[i]] += work[i]
    return owner


@dataclass
class EncodedVisuals(ModelOutput):
    """What a Qwen model's ``mm_encoder_outputs[kind]`` takes: one feature tensor per item, and
    Qwen3-VL's deepstack features (per level, one tensor per item)."""

    pooler_output: tuple | None = None
    deepstack_features: list | None = None


ENCODE_ONCE = {"qwen2_vl": "grid", "qwen2_5_vl": "grid", "qwen3_vl": "grid", "qwen3_vl_moe": "grid", "llava": "images"}
"""The families whose images (and videos) each rank of an SP group encodes a share of: rows of patches
with a ``*_grid_thw`` per item (Qwen), or one image per row of ``pixel_values`` (LLaVA). The others
run their vision tower on every image on every rank."""


def _items(model, style: str, kind: str, pixels: torch.Tensor, kwargs: dict):
    """(encode a list of item indices, each item's feature tokens, each item's work), or None when
    the items cannot be told apart (LLaVA's image tokens not an equal share per image)."""
    if style == "grid":
        grid = kwargs[f"{kind}_grid_thw"]
        patches = grid.prod(-1).tolist()
        starts = [0]
        for n in patches:
            starts.append(starts[-1] + n)
        get = model.get_image_features if kind == "image" else model.get_video_features
        merge = model.config.vision_config.spatial_merge_size ** 2
        return (lambda idx: get(torch.cat([pixels[starts[i]:starts[i + 1]] for i in idx]), grid[idx], return_dict=True),
                [n // merge for n in patches], patches)
    n, tokens = pixels.shape[0], int((kwargs["input_ids"] == model.config.image_token_id).sum())
    if n == 0 or tokens % n:
        return None
    return lambda idx: model.get_image_features(pixel_values=pixels[idx], return_dict=True), [tokens // n] * n, [1] * n


def _encode_once(model, topo: Topology, encode, tokens: list[int], work: list[int]) -> EncodedVisuals:
    """The features of every image (or video) of the batch, each encoded on one rank of the SP group
    (``owners``, by ``work``) and all-gathered, differentiably: the backward sums every rank's use of
    them and hands each owner its items' gradients."""
    levels = 1 + len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())
    owner = owners(work, topo.sp_size)
    mine = [i for i, r in enumerate(owner) if r == topo.sp_rank]
    if mine:
        out = encode(mine)
        local = [torch.cat(list(out.pooler_output))] + [torch.cat(level) for level in (getattr(out, "deepstack_features", None) or [])]
    else:  # nothing to encode here: zeros that still reach the encoder, so its gradients exist (0) on every rank (DDP)
        text = {id(p) for p in text_decoder(model).parameters()}
        anchor = sum(p.sum() for p in model.parameters() if id(p) not in text and p.requires_grad) * 0
        local = [anchor.new_zeros(0, model.config.text_config.hidden_size) + anchor for _ in range(levels)]
    held = [sum(t for t, r in zip(tokens, owner) if r == rank) for rank in range(topo.sp_size)]
    width = max(held)
    gathered = [comm.all_gather(F.pad(x, (0, 0, 0, width - x.shape[0])), topo.sp_group, dim=0) for x in local]
    offset, features = [0] * topo.sp_size, [[] for _ in range(levels)]
    for t, r in zip(tokens, owner):
        for level, full in zip(features, gathered):
            level.append(full[r * width + offset[r]:r * width + offset[r] + t])
        offset[r] += t
    return EncodedVisuals(pooler_output=tuple(features[0]), deepstack_features=[tuple(f) for f in features[1:]] or None)


def _check_mask(mask, who: str) -> None:
    """Only a mask that masks nothing (all-ones ``[B, S]``) may pass: the split drops it."""
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())):
        what = "a mapping of" if isinstance(mask, dict) else f"a {mask.dim()}-D" if isinstance(mask, torch.Tensor) else "an"
        raise ValueError(
            f"{who} {what} attention mask (padding, or image tokens attending to each other both ways), which ulysses_sp "
            "cannot split; pad on the right with shard_batch and pass no mask"
        )


def _model_hook(topo: Topology, state: dict):
    def hook(model, args, kwargs):
        _check_mask(kwargs.get("attention_mask"), f"{type(model).__name__} was given")  # before the encoders' collectives
        if kwargs.get("position_ids") is not None:
            raise ValueError(
                f"{type(model).__name__} under sequence parallelism numbers its positions itself on the whole sequence "
                "(multimodal RoPE included); pass no position_ids: ulysses_sp.model_inputs(ulysses_sp.shard_batch(batch, topo)) "
                "gives the whole token ids, the images and the document boundaries"
            )
        state["cu_seqlens"] = kwargs.pop("cu_seq_lens_q", None)
        style = ENCODE_ONCE.get(model.config.model_type) if topo.sp_size > 1 and kwargs.get("mm_encoder_outputs") is None else None
        encoded = {}
        for kind, key in (("image", "pixel_values"), ("video", "pixel_values_videos")):
            items = _items(model, style, kind, kwargs[key], kwargs) if style and kwargs.get(key) is not None else None
            if items is not None:
                del kwargs[key]
                encoded[kind] = _encode_once(model, topo, *items)
        if encoded:
            kwargs["mm_encoder_outputs"] = encoded
        return args, kwargs
    return hook


def _decoder_hook(topo: Topology, state: dict):
    def hook(decoder, args, kwargs):
        embeds = kwargs.get("inputs_embeds")
        if args or embeds is None:
            raise ValueError(f"{type(decoder).__name__} must be called with inputs_embeds by keyword under sequence parallelism")
        b, s = embeds.shape[:2]
        cu_seqlens = state.pop("cu_seqlens", None)
        if cu_seqlens is None and topo.layout == "balanced":
            cu_seqlens = torch.tensor([0, s], dtype=torch.int32)
        cu = None if cu_seqlens is None else [int(x) for x in cu_seqlens]
        if cu is not None and cu[-1] != s:
            raise ValueError(f"cu_seq_lens_q ends at {cu[-1]}, the sequence has {s} tokens: pass the whole row's document boundaries")
        _check_mask(kwargs.get("attention_mask"), f"{type(decoder).__name__} was handed")
        kwargs["attention_mask"] = None
        positions = kwargs.get("position_ids")
        if positions is None:
            positions = torch.arange(s, device=embeds.device).expand(b, s)
        if cu is not None:
            positions = _per_document(positions, cu_seqlens)
            kwargs["cu_seq_lens_q"] = cu_seqlens
        kwargs["inputs_embeds"] = shard_sequence(embeds, topo, dim=1, cu_seqlens=cu)
        kwargs["position_ids"] = shard_sequence(positions, topo, dim=positions.dim() - 1, cu_seqlens=cu)
        if kwargs.get("visual_pos_masks") is not None:  # Qwen3-VL's deepstack: features added at the visual tokens
            kwargs["visual_pos_masks"], kwargs["deepstack_visual_embeds"] = _deepstack(
                kwargs["visual_pos_masks"], kwargs.get("deepstack_visual_embeds") or [], topo, cu)
        return args, kwargs
    return hook


def split_at_decoder(model, decoder: nn.Module, topo: Topology) -> None:
    """Install the two hooks (see the module's docstring); the decoder's is the first to run."""
    unsplit(model)
    state: dict = {}
    model.__dict__[_HOOKS] = [
        model.register_forward_pre_hook(_model_hook(topo, state), with_kwargs=True),
        decoder.register_forward_pre_hook(_decoder_hook(topo, state), with_kwargs=True, prepend=True),
    ]


def is_split(model) -> bool:
    return _HOOKS in model.__dict__


def unsplit(model) -> bool:
    """Remove the hooks; whether there were any."""
    handles = model.__dict__.pop(_HOOKS, [])
    for handle in handles:
        handle.remove()
    return bool(handles)
