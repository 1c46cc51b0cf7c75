"""Image- and video-text models under SP: only the text decoder is switched, and the sequence is
split at the model's input.

A forward pre-hook on the whole model checks the call before any collective, numbers the whole
row's positions as the model would (Qwen's multimodal RoPE too; each packed document from 0), and
encodes each image and video on one rank of the SP group (by patches, ``owners``); each feature row
then goes to the rank that holds its token (``comm.rows_to_ranks``). The model's own forward gets
this rank's shard of the ids and positions and the features of exactly its image and video tokens,
so it embeds and merges only those, with each family's merge (and Qwen3-VL's deepstack) code
unchanged: an image may straddle any shard boundary, a rank may hold none, and nothing
hidden-sized is sequence-long on any rank. Audio clips (the Omni thinkers) are encoded the same way and
merged into this rank's embeddings before the model runs. A pre-hook on the text decoder hands its attention
the document boundaries (``cu_seq_lens_q``), which the model would also have handed its vision tower, and the
bidirectional blocks (``ulysses_sp_blocks``: Gemma 3's images, PaliGemma's prefixes) read from the whole row.
The vision tower keeps its own (bidirectional) attention; summing its gradients over the SP group,
as for any replicated parameter, gives the one-process gradient.
"""

from __future__ import annotations

import inspect
import itertools
import re
import types
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import ModelOutput

from .. import comm
from .. import layout as _layout
from ..data import shard_sequence
from ..loss import SPLIT_AT_DECODER
from ..topology import Topology
from . import coverage

__all__ = ["STYLES", "TESTED", "decoder_to_switch", "is_split", "text_decoder", "split_at_decoder", "unsplit"]

_HOOKS = SPLIT_AT_DECODER


_AUDIO = re.compile(r"^audio_|^input_features$|^input_values$")


def text_decoder(model) -> nn.Module | None:
    """The text decoder of an image- or video-text model.

    Args:
        model (nn.Module): a transformers model.

    Returns:
        ``model.get_decoder()`` where it is another module than ``model``, else None.
    """
    get = getattr(model, "get_decoder", None)
    decoder = get() if callable(get) else None
    return decoder if isinstance(decoder, nn.Module) and decoder is not model else None


def decoder_to_switch(model) -> nn.Module | None:
    """The module that ``apply_sequence_parallel`` switches inside an image- or video-text model.

    Switching the whole model would run its vision tower under the text decoder's attention and
    cut images at shard boundaries.

    Args:
        model (nn.Module): a transformers model.

    Returns:
        None for a text model; the text decoder of a tested image- or video-text family.

    Raises:
        ValueError: any other model with inputs besides text (audio-text models included), named.
    """
    others = coverage.other_modalities(model)
    if not others:
        return None
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    audio = any(_AUDIO.search(n) for n in others) and model_type not in AUDIO + AUDIO_BY_ENCODER
    decoder = None if audio or model_type not in TESTED else text_decoder(model)
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
    """What ``mm_encoder_outputs[kind]`` takes in every tested family: the features of this rank's
    tokens of that kind, and Qwen3-VL's deepstack features (per level)."""

    pooler_output: tuple | None = None
    deepstack_features: list | None = None


STYLES = {"qwen2_vl": "grid", "qwen2_5_vl": "grid", "qwen3_vl": "grid", "qwen3_vl_moe": "grid", "qwen3_5": "grid", "qwen3_5_moe": "grid",
          "qwen2_5_omni_thinker": "grid", "qwen3_omni_moe_thinker": "grid", "glm4v": "grid", "glm4v_moe": "grid", "glm46v": "grid",
          "kimi_k25": "grid", "llava": "images", "smolvlm": "images", "idefics3": "images", "internvl": "images", "gemma3": "images",
          "paligemma": "images", "mistral3": "sized", "llava_next": "runs", "llava_next_video": "runs", "llava_onevision": "runs",
          "gemma4": "runs"}
"""How each tested family's visual inputs split into items (images, videos).

Rows of patches with a ``*_grid_thw`` per item (Qwen), or one image per ``[C, H, W]`` of ``pixel_values`` (LLaVA's
``[N, ...]``, SmolVLM's ``[B, N, ...]`` with ``pixel_attention_mask``; all-zero padding images dropped), or one image per
``[C, H, W]`` padded to the largest, its own size in ``image_sizes`` (Mistral 3, Pixtral's tower), or one image per
``[tiles, C, H, W]`` with its ``image_sizes``, its tokens one run of placeholders (LLaVA-NeXT's and LLaVA-OneVision's anyres
tiles and newlines; images whose runs touch are encoded as one item; LLaVA-NeXT-Video's and LLaVA-OneVision's videos,
``[frames, C, H, W]`` each, likewise; Gemma 4's ``[patches, 3 * patch ** 2]`` per image and per video frame, with each
patch's place in ``image_position_ids`` / ``video_position_ids``, each frame's tokens a run)."""
TESTED = tuple(sorted(STYLES))
"""``config.model_type`` of the image-text families that tests/test_multimodal.py holds exact.

The others are refused by name until a test holds them too."""
VIDEO_AS_IMAGE_TOKENS = ("glm4v", "glm4v_moe", "glm46v")
"""Families whose video tokens are image tokens, told apart by ``mm_token_type_ids`` (2; images 1): GLM-4.1V, 4.5V and 4.6V,
each video frame its own run after a timestamp. Their forward scatters image features into every image token (transformers'
cannot take an image and a video in one row), so the features of both go to it as one stream in token order (`_one_stream`)."""
_TIME_POOLED = ("kimi_k25",)
"""Grid families that average a video's frames into one frame's tokens (Kimi-K2.5's temporal pooling)."""
_TENSOR_FEATURES = ("gemma3", "internvl", "paligemma")
"""Families whose merge takes the features as one tensor, not a tuple of tensors."""
BIDIRECTIONAL = {"gemma3": ("token_type_ids", (1,)), "paligemma": ("token_type_ids", (0,)), "gemma4": ("mm_token_type_ids", (1, 2))}
"""Families whose tokens of some kinds attend to each other both ways: the input that marks them, and its values there
(Gemma 3: 1, each image's tokens; PaliGemma: 0, each document's prefix, its image and prompt; Gemma 4: 1 or 2, each image's
and each video frame's tokens). Each run of them in the whole row (cut at document boundaries) is a block of the attention's
mask (`image_blocks`) on the layers that take it (`takes_blocks`)."""
_POSITIONS_FROM = {"paligemma": 1}
"""Families that number a document's positions from another first value than 0."""
_PIXELS = {"image": "pixel_values", "video": "pixel_values_videos", "audio": "input_features"}
AUDIO = ("qwen2_5_omni_thinker", "qwen3_omni_moe_thinker")
"""Families whose audio clips (``input_features`` ``[clips, mels, frames]`` with ``feature_attention_mask``) are encoded
like images, each on one rank of the group: Qwen2.5-Omni's and Qwen3-Omni's thinkers. Other audio-text models are refused."""
AUDIO_BY_ENCODER = ("gemma4",)
"""Families whose audio clips (``input_features`` ``[clips, frames, mels]`` with ``input_features_mask``) are encoded like
images, and whose forward merges them itself, through its ``get_audio_features``: Gemma 4, whose per-layer inputs the model
computes from each rank's own ids as in one process. Its ``get_audio_features`` answers the forward with this rank's rows
(`_encoded_audio`)."""
_VIDEO_BATCHED = ("llava_next_video", "llava_onevision")
"""Families whose merge takes the video features as one ``[videos, tokens, H]`` tensor."""
_SPENT = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", "pixel_attention_mask", "image_sizes", "batch_num_images",
          "image_position_ids", "video_position_ids", "num_frames_per_video", "input_features", "feature_attention_mask", "audio_feature_lengths",
          "video_second_per_grid", "use_audio_in_video", "input_features_mask")


def image_blocks(types_bs: torch.Tensor, cu_seqlens: list[int] | None = None, marker: tuple[int, ...] = (1,)) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Each row's bidirectional blocks: the global ``(start, end)`` of every run of the ``marker`` types
    in the row's token types (an image's tokens, or a prefix), cut at the documents' boundaries ``cu_seqlens``.

    Args:
        types_bs (torch.Tensor): ``[B, S]`` token types of the whole rows.
        cu_seqlens (list[int] | None): the packed documents' boundaries, or None.
        marker (tuple[int, ...]): the token types of a block's tokens.

    Returns:
        One tuple of ``(start, end)`` per row."""
    cuts = sorted(set(cu_seqlens or ()))
    rows = []
    for row in torch.isin(types_bs, torch.tensor(marker, dtype=types_bs.dtype)).tolist():
        blocks, start = [], 0
        for on, group in itertools.groupby(row):
            end = start + len(list(group))
            if on:
                edges = [start, *(x for x in cuts if start < x < end), end]
                blocks += [(a, b) for a, b in zip(edges, edges[1:])]
            start = end
        rows.append(tuple(blocks))
    return tuple(rows)


def takes_blocks(attention: nn.Module, sliding_window: int | None) -> bool:
    """Whether an attention layer applies the bidirectional blocks: every layer of Gemma 3 and PaliGemma;
    Gemma 4's only on its sliding layers, and only where its text config's ``use_bidirectional_attention``
    is ``"vision"`` (its small models attend causally), as transformers' ``create_masks_for_vision_model``."""
    if not getattr(attention.config, "model_type", "").startswith("gemma4"):
        return True
    return attention.config.use_bidirectional_attention == "vision" and bool(sliding_window)


def _runs(token_bs: torch.Tensor) -> list[int]:
    """The lengths of the runs of ``True`` in each row of ``token_bs``, row after row."""
    return [b - a for row in image_blocks(token_bs.int()) for a, b in row]


def _items(model, kind: str, kwargs: dict, token_bs: torch.Tensor):
    """(encode a list of item indices, each item's feature tokens, each item's work). Items whose
    tokens cannot be told apart (an uneven share per image, runs that touch) are encoded as one."""
    pixels, tokens = kwargs[_PIXELS[kind]], int(token_bs.sum())
    if kind == "audio":  # each clip's frames in feature_attention_mask (Gemma 4: input_features_mask); its tokens one run
        by_encoder = model.config.model_type in AUDIO_BY_ENCODER
        mask, runs = kwargs["input_features_mask" if by_encoder else "feature_attention_mask"], _runs(token_bs)

        def encode_audio(idx):
            out = model.model.get_audio_features(pixels[idx], mask[idx], return_dict=True)
            if by_encoder:  # [clips, tokens, H] and each clip's real tokens in attention_mask
                return EncodedVisuals(pooler_output=out.pooler_output[out.attention_mask.to(out.pooler_output.device)])
            return EncodedVisuals(pooler_output=out.last_hidden_state)
        if len(runs) != pixels.shape[0]:
            return (lambda idx: encode_audio(list(range(pixels.shape[0])))), [tokens], [1]
        return encode_audio, runs, runs
    if STYLES[model.config.model_type] == "grid":
        grid = kwargs[f"{kind}_grid_thw"]
        patches = grid.prod(-1).tolist()
        starts = [0]
        for n in patches:
            starts.append(starts[-1] + n)
        get = model.get_image_features if kind == "image" else model.get_video_features
        vision = model.config.vision_config
        merge = vision.spatial_merge_size ** 2 if hasattr(vision, "spatial_merge_size") else vision.merge_kernel_size[0] * vision.merge_kernel_size[1]
        per_frame = grid[:, 1:].prod(-1).tolist() if model.config.model_type in _TIME_POOLED else patches
        return (lambda idx: get(torch.cat([pixels[starts[i]:starts[i + 1]] for i in idx]), grid[idx], return_dict=True),
                [n // merge for n in per_frame], patches)
    if STYLES[model.config.model_type] == "sized":  # an image's tokens: its patches merged m x m (break tokens are text)
        sizes = kwargs["image_sizes"]
        side = model.config.vision_config.patch_size * model.config.spatial_merge_size
        tokens = [(h // side) * (w // side) for h, w in sizes.tolist()]
        return (lambda idx: model.get_image_features(pixel_values=pixels[idx], image_sizes=sizes[idx], return_dict=True)), tokens, tokens
    if STYLES[model.config.model_type] == "runs":
        runs = _runs(token_bs)
        if f"{kind}_position_ids" in kwargs:  # Gemma 4: [images or frames, patches, ...], each patch's (x, y), -1 on padding;
            where = kwargs[f"{kind}_position_ids"]  # each image's and each frame's tokens a run
            get = model.model.get_image_features if kind == "image" else model.model.get_video_features

            def encode_runs(idx):
                frames = {} if kind == "image" else {"num_frames_per_video": torch.tensor([len(idx)])}
                return get(pixels[idx], where[idx], return_dict=True, **frames)
        elif kind == "video":  # LLaVA-NeXT-Video, LLaVA-OneVision: [videos, frames, C, H, W], each video's tokens a run
            def encode_runs(idx):
                return model.get_video_features(pixel_values_videos=pixels[idx], return_dict=True)
        else:
            sizes = kwargs["image_sizes"]

            def encode_runs(idx):
                return model.get_image_features(pixel_values=pixels[idx], image_sizes=sizes[idx], return_dict=True)
        if len(runs) != pixels.shape[0]:
            return (lambda idx: encode_runs(list(range(pixels.shape[0])))), [tokens], [1]
        return encode_runs, runs, runs
    flat = pixels.flatten(0, pixels.dim() - 4)  # [N, C, H, W]
    mask = kwargs.get("pixel_attention_mask")
    real = [i for i in range(flat.shape[0]) if bool(flat[i].any())]

    def encode(idx):
        picked = flat[[real[i] for i in idx]]
        extra = {} if mask is None else {"pixel_attention_mask": mask.flatten(0, mask.dim() - 3)[[real[i] for i in idx]][None]}
        return model.get_image_features(pixel_values=picked[None] if pixels.dim() == 5 else picked, return_dict=True, **extra)

    if not real or tokens % len(real):
        return (lambda idx: encode(list(range(len(real))))), [tokens], [1]
    return encode, [tokens // len(real)] * len(real), [1] * len(real)


def _encode(model, topo: Topology, encode, tokens: list[int], work: list[int], kind: str) -> tuple[torch.Tensor, list[int]]:
    """This rank's share of the items (``owners`` by ``work``), encoded: one row per feature token,
    Qwen3-VL's deepstack levels beside the features (``[rows, levels * H]``), and which rank owns each item."""
    owner = owners(work, topo.sp_size)
    mine = [i for i, r in enumerate(owner) if r == topo.sp_rank]
    # every parameter outside the text decoder joins the rows times 0, so that the same parameters hold a gradient on
    # every rank, as DeepSpeed's and DDP's reductions need: where this rank encodes nothing, and where the encoding
    # leaves one unused (the LLaVA families' CLIP post-layernorm above the feature layer, Gemma 3's SigLIP head)
    text = {id(p) for p in text_decoder(model).parameters()}
    anchor = sum(p.sum() for p in model.parameters() if id(p) not in text and p.requires_grad) * 0
    if mine:
        out = encode(mine)
        levels = [out.pooler_output] + list(getattr(out, "deepstack_features", None) or [])
        # a tensor of rows, or of [items, tokens, H] (InternVL), or a tuple of each item's rows
        return torch.cat([x.flatten(0, -2) if isinstance(x, torch.Tensor) else torch.cat(list(x)) for x in levels], dim=-1) + anchor, owner
    levels = 1 if kind == "audio" else 1 + len(getattr(model.config.vision_config, "deepstack_visual_indexes", None) or ())
    return anchor.new_zeros(0, levels * model.config.text_config.hidden_size) + anchor, owner


def _to_holders(model, topo: Topology, kind: str, kwargs: dict, token_bs: torch.Tensor, cu) -> EncodedVisuals:
    """The features of this rank's tokens of ``kind`` (in its local order), each item encoded once
    in the SP group and its rows sent to the ranks that hold its tokens (``comm.rows_to_ranks``)."""
    index_bs = torch.full(token_bs.shape, -1, dtype=torch.long)
    index_bs[token_bs.cpu()] = torch.arange(int(token_bs.sum()))
    encode, tokens, work = _items(model, kind, kwargs, token_bs)
    local, owner = _encode(model, topo, encode, tokens, work, kind)
    item = torch.repeat_interleave(torch.arange(len(tokens)), torch.tensor(tokens))  # each feature token's item
    row = torch.zeros(len(tokens), dtype=torch.long)  # an item's first row in its owner's encoded rows
    load = [0] * topo.sp_size
    for i, r in enumerate(owner):
        row[i], load[r] = load[r], load[r] + tokens[i]
    starts = torch.cumsum(torch.tensor([0] + tokens[:-1]), 0)
    holder_of = torch.tensor(owner)[item]
    needs = []  # each rank's feature tokens, in its local order
    for rank in range(topo.sp_size):
        held = _layout.shard(index_bs, topo.layout, topo.sp_size, rank, dim=1, cu_seqlens=cu).flatten()
        needs.append(held[held >= 0])
    sent = [need[holder_of[need] == topo.sp_rank] for need in needs]  # what this rank sends each rank
    mine = needs[topo.sp_rank]
    got = [int((holder_of[mine] == r).sum()) for r in range(topo.sp_size)]
    rows = torch.cat(sent)
    rows = row[item[rows]] + rows - starts[item[rows]]
    received = comm.rows_to_ranks(local.index_select(0, rows.to(local.device)), [len(s) for s in sent], got, topo.sp_group)
    order = torch.argsort(holder_of[mine], stable=True)  # received rows come by sender, each sender's in local order
    features = received.index_select(0, torch.argsort(order).to(received.device))
    levels = features.chunk(features.shape[-1] // model.config.text_config.hidden_size, dim=-1)
    first = levels[0] if model.config.model_type in _TENSOR_FEATURES else (levels[0],)
    if kind == "video" and model.config.model_type in _VIDEO_BATCHED:
        first = levels[0][None]
    return EncodedVisuals(pooler_output=first, deepstack_features=[(x,) for x in levels[1:]] or None)


def _tokens_of(model, kind: str, kwargs: dict) -> torch.Tensor:
    """``[B, S]``: where the whole row's tokens of ``kind`` (``"image"``, ``"video"``, ``"audio"``) are."""
    ids = kwargs["input_ids"]
    if model.config.model_type in VIDEO_AS_IMAGE_TOKENS and kind == "video":
        return (ids == model.config.image_token_id) & (kwargs["mm_token_type_ids"] == 2)
    if model.config.model_type in VIDEO_AS_IMAGE_TOKENS and kwargs.get("mm_token_type_ids") is not None:
        return (ids == model.config.image_token_id) & (kwargs["mm_token_type_ids"] != 2)
    return ids == getattr(model.config, f"{kind}_token_id")


def _one_stream(model, topo: Topology, encoded: dict, kwargs: dict, cu) -> dict:
    """GLM's image and video features as its forward scatters them: one stream into this rank's image tokens, in order."""
    video = shard_sequence(_tokens_of(model, "video", kwargs), topo, dim=1, cu_seqlens=cu)
    either = shard_sequence(kwargs["input_ids"] == model.config.image_token_id, topo, dim=1, cu_seqlens=cu)
    is_video = video[either]  # of this rank's image-id tokens, in order: which are a video's
    parts = {kind: encoded[kind].pooler_output[0] for kind in encoded}
    rows = parts["video"].new_empty(len(is_video), parts["video"].shape[-1])
    rows[is_video.to(rows.device)] = parts["video"]
    if "image" in parts:
        rows[~is_video.to(rows.device)] = parts["image"]
    return {"image": EncodedVisuals(pooler_output=(rows,))}


def _check_mask(mask, who: str) -> None:
    """Only a mask that masks nothing (all-ones ``[B, S]``, or the mapping of no masks that "ulysses_sp"'s
    mask function makes) may pass: the split drops it."""
    if isinstance(mask, dict) and all(m is None for m in mask.values()):
        return
    if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2 and bool(mask.all())):
        what = "a mapping of" if isinstance(mask, dict) else f"a {mask.dim()}-D" if isinstance(mask, torch.Tensor) else "an"
        raise ValueError(
            f"{who} {what} attention mask (padding, or image tokens attending to each other both ways), which ulysses_sp "
            "cannot split; pad on the right with shard_batch and pass no mask"
        )


def _whole_positions(model, kwargs: dict) -> torch.Tensor:
    """The positions the model would number the whole row with: Qwen's multimodal RoPE
    (``[3 or 4, B, S]``, from its own ``compute_3d_position_ids``), else ``[B, S]`` from 0."""
    ids = kwargs["input_ids"]
    compute = getattr(getattr(model, "model", None), "compute_3d_position_ids", None)
    positions = None
    if compute is not None:
        named = [p.name for p in inspect.signature(compute).parameters.values() if p.kind is p.POSITIONAL_OR_KEYWORD]
        given = {name: kwargs.get(name) for name in named}
        given["attention_mask"] = torch.ones_like(ids) if model.config.model_type in AUDIO else None  # Omni numbers nothing without
        if kwargs.get("feature_attention_mask") is not None and "audio_feature_lengths" in named:  # as the model's forward
            given["audio_feature_lengths"] = kwargs["feature_attention_mask"].sum(1)
        positions = compute(**given)
    return torch.arange(ids.shape[1], device=ids.device).expand(ids.shape) if positions is None else positions


def _check_prefixes(blocks, cu: list[int], s: int, who: str) -> None:
    """PaliGemma's prefix (token type 0) is one block per document, before its suffix (1): a second
    run of 0s in a document is refused unless it ends the row (padding, which no real token sees), and
    so is an unpacked row whose prefix runs to its end, where padding (also 0) would join the prefix."""
    for row in blocks:
        for a, b in zip(cu, cu[1:]):
            runs = [(x, y) for x, y in row if a <= x < b]
            inner = [r for r in runs[1:] if r[1] != s]
            if inner or len(cu) == 2 and runs and runs[0][1] == s:
                raise ValueError(f"{who} under sequence parallelism takes one prefix (token type 0) per document, before its suffix "
                                 f"(token type 1), not ending an unpacked row (padding would join it); document [{a}, {b}) has "
                                 f"its 0s at {runs}")


def _model_hook(topo: Topology, state: dict):
    """Before any collective: the checks. Then the whole row's positions, this rank's shard of every
    ``[B, S]`` input and the features of its image and video tokens (``_to_holders``)."""
    def hook(model, args, kwargs):
        who = type(model).__name__
        state.pop("audio", None)  # a previous call's, had it stopped before its model asked for them
        if hasattr(next(model.parameters()), "ds_id"):  # DeepSpeed ZeRO-3 partitions every parameter
            raise ValueError(f"{who} under sequence parallelism encodes each image, video or clip on one rank, while DeepSpeed ZeRO-3 "
                             "gathers a module's weights on every rank at each of its calls: ZeRO-3 is not supported for image-text "
                             "models; use ZeRO stage 1 or 2")
        _check_mask(kwargs.pop("attention_mask", None), f"{who} was given")
        if kwargs.get("position_ids") is not None:
            raise ValueError(
                f"{who} under sequence parallelism numbers its positions itself on the whole sequence "
                "(multimodal RoPE included); pass no position_ids: ulysses_sp.model_inputs(ulysses_sp.shard_batch(batch, topo)) "
                "gives the whole token ids, the images and the document boundaries"
            )
        ids = kwargs.get("input_ids")
        if args or ids is None or any(kwargs.get(k) is not None for k in ("inputs_embeds", "labels", "mm_encoder_outputs")):
            raise ValueError(
                f"{who} under sequence parallelism takes the whole row's input_ids and images by keyword, and no inputs_embeds, "
                "mm_encoder_outputs or labels (the loss is ulysses_sp.sp_cross_entropy's on the shard_batch's shift_labels)"
            )
        b, s = ids.shape
        cu_seqlens = kwargs.pop("cu_seq_lens_q", None)
        if cu_seqlens is None and topo.layout == "balanced":
            cu_seqlens = torch.tensor([0, s], dtype=torch.int32)
        cu = None if cu_seqlens is None else [int(x) for x in cu_seqlens]
        if cu is not None and cu[-1] != s:
            raise ValueError(f"cu_seq_lens_q ends at {cu[-1]}, the sequence has {s} tokens: pass the whole row's document boundaries")
        if model.config.model_type in VIDEO_AS_IMAGE_TOKENS and kwargs.get("pixel_values_videos") is not None and kwargs.get("mm_token_type_ids") is None:
            raise ValueError(f"{who} ({model.config.model_type}) under sequence parallelism tells its video tokens from its image tokens "
                             "(one id) by mm_token_type_ids (1: image, 2: video), as its processor gives: pass them")
        if kwargs.get("use_audio_in_video"):
            raise ValueError(f"{who} under sequence parallelism takes audio clips apart from videos: use_audio_in_video is not tested yet")
        grouped = kwargs.get("batch_num_images")
        if grouped is not None and any(int(n) > 1 for n in grouped):
            raise ValueError(f"{who} under sequence parallelism takes one image per sample (batch_num_images {[int(n) for n in grouped]}): "
                             "its multi-image samples, whose images are not tiled, are not tested yet")
        _layout.check_seq_len(s, topo.layout, topo.sp_size)
        positions = _whole_positions(model, kwargs)
        if cu is not None:
            positions = _per_document(positions, cu_seqlens)
        positions = positions + _POSITIONS_FROM.get(model.config.model_type, 0)
        name, marker = BIDIRECTIONAL.get(model.config.model_type, ("", (1,)))
        state["causal"] = model.config.model_type == "paligemma"  # its layers' is_causal=False is a default its own mask overrides
        types = kwargs.pop(name, None)  # the model would mask by them: the blocks' job now (on the layers that take them)
        state["blocks"] = None if types is None else image_blocks(types, cu, marker)
        if types is not None and marker == (0,):
            _check_prefixes(state["blocks"], cu or [0, s], s, who)
        encoded = {}
        for kind in ("image", "video", "audio"):
            if kwargs.get(_PIXELS[kind]) is not None:
                encoded[kind] = _to_holders(model, topo, kind, kwargs, _tokens_of(model, kind, kwargs), cu)
        if "video" in encoded and model.config.model_type in VIDEO_AS_IMAGE_TOKENS:
            encoded = _one_stream(model, topo, encoded, kwargs, cu)
        for key in _SPENT if encoded else ():
            kwargs.pop(key, None)
        audio = encoded.pop("audio", None)
        if encoded:
            kwargs["mm_encoder_outputs"] = encoded
        for key, value in kwargs.items():
            if isinstance(value, torch.Tensor) and value.shape == (b, s):
                kwargs[key] = shard_sequence(value, topo, dim=1, cu_seqlens=cu)
        if audio is not None and model.config.model_type in AUDIO_BY_ENCODER:  # its forward merges what get_audio_features gives
            state["audio"] = audio.pooler_output[0]
            kwargs["input_features"], kwargs["input_features_mask"] = state["audio"], True  # (`_encoded_audio`), called given these
        elif audio is not None:  # the model's own merge of its audio, on this rank's tokens (it has no mm_encoder_outputs for audio)
            local = kwargs["input_ids"]
            embeds = model.get_input_embeddings()(local)
            kwargs["inputs_embeds"] = embeds.masked_scatter((local == model.config.audio_token_id)[..., None], audio.pooler_output[0].to(embeds))
        kwargs["position_ids"] = shard_sequence(positions, topo, dim=positions.dim() - 1, cu_seqlens=cu)
        state["cu_seqlens"] = cu_seqlens
        return args, kwargs
    return hook


@dataclass
class EncodedAudio(ModelOutput):
    """What Gemma 4's forward reads of its ``get_audio_features``: feature rows, and which are real."""

    pooler_output: torch.Tensor | None = None
    attention_mask: torch.Tensor | None = None


class _Shadowed:
    """``owner.name`` shadowed by ``fn`` on the instance until ``remove()`` (a hook handle's interface)."""

    def __init__(self, owner, name: str, fn):
        self.owner, self.name = owner, name
        owner.__dict__[name] = fn

    def remove(self) -> None:
        self.owner.__dict__.pop(self.name, None)


def _encoded_audio(model, state: dict) -> _Shadowed:
    """Gemma 4's ``get_audio_features`` answering its forward with this rank's audio rows, which the model hook left in
    ``state`` (each clip encoded on one rank, its rows sent to the ranks holding its tokens); otherwise its own."""
    def get_audio_features(self, input_features, input_features_mask, **kwargs):
        rows = state.pop("audio", None)
        if rows is None:
            return type(self).get_audio_features(self, input_features, input_features_mask, **kwargs)
        return EncodedAudio(pooler_output=rows[None], attention_mask=torch.ones(1, rows.shape[0], dtype=torch.bool, device=rows.device))
    return _Shadowed(model.model, "get_audio_features", types.MethodType(get_audio_features, model.model))  # a copy rebinds it


def _decoder_hook(topo: Topology, state: dict):
    """The document boundaries (or the balanced layout's placement) for the decoder's attention,
    which the model would also have handed its vision tower."""
    def hook(decoder, args, kwargs):
        if "cu_seqlens" not in state:
            raise ValueError(f"{type(decoder).__name__} of a model split by ulysses_sp runs inside that model's forward, not alone")
        _check_mask(kwargs.get("attention_mask"), f"{type(decoder).__name__} was handed")
        kwargs["attention_mask"] = None
        cu_seqlens, blocks = state.pop("cu_seqlens"), state.pop("blocks", None)
        if cu_seqlens is not None:
            kwargs["cu_seq_lens_q"] = cu_seqlens
        if blocks is not None and any(blocks):
            kwargs[coverage.BLOCKS] = blocks
        if state.pop("causal", False):  # PaliGemma's layers say bidirectional (is_causal=False) but its own mask is causal
            kwargs["is_causal"] = True
        return args, kwargs
    return hook


def split_at_decoder(model, decoder: nn.Module, topo: Topology) -> None:
    """Split the sequence at the model's input: install its two hooks (see the module's docstring).

    Args:
        model (nn.Module): the image- or video-text model.
        decoder (nn.Module): its text decoder (`decoder_to_switch`); its hook runs first.
        topo (Topology): the topology.
    """
    unsplit(model)
    state: dict = {}
    model.__dict__[_HOOKS] = [
        model.register_forward_pre_hook(_model_hook(topo, state), with_kwargs=True),
        decoder.register_forward_pre_hook(_decoder_hook(topo, state), with_kwargs=True, prepend=True),
    ]
    if model.config.model_type in AUDIO_BY_ENCODER and getattr(model.model, "audio_tower", None) is not None:
        model.__dict__[_HOOKS].append(_encoded_audio(model, state))


def is_split(model) -> bool:
    """Whether `split_at_decoder` hooks are on ``model``.

    Args:
        model (nn.Module): a transformers model.

    Returns:
        True while the hooks are installed.
    """
    return _HOOKS in model.__dict__


def unsplit(model) -> bool:
    """Remove the hooks of `split_at_decoder`.

    Args:
        model (nn.Module): a transformers model.

    Returns:
        Whether there were any.
    """
    handles = model.__dict__.pop(_HOOKS, [])
    for handle in handles:
        handle.remove()
    return bool(handles)
