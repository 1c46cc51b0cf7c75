"""What ``verify_sequence_parallel`` needs for an image-text model of the tested families
(``image_text.STYLES``): a small copy of its architecture, and random images placed in token rows
so that one straddles a shard boundary and, packed, a document holds none.

The copy keeps the families' grouping sizes (patch, merge, temporal patch) and shrinks the widths,
depths and image sizes; the placeholder token ids are moved into the small vocabulary.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from .image_text import AUDIO, AUDIO_BY_ENCODER, STYLES, VIDEO_AS_IMAGE_TOKENS

__all__ = ["shrink_image_text_config", "build", "rows", "one_process_loss", "noise_part"]

_VISION = {  # vision config fields per family in the small copy ("TEXT": the text model's width)
    "qwen2_vl": dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, hidden_size="TEXT"),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size="TEXT", fullatt_block_indexes=[1]),
    "qwen3_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size="TEXT", num_position_embeddings=64,
                     deepstack_visual_indexes=[0, 1]),
    "llava": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, projection_dim=32),
    "llava_next": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, projection_dim=32, image_size=16,
                       patch_size=8),
    "smolvlm": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
    "internvl": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
    "mistral3": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, head_dim=8),
    "gemma4": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                   position_embedding_size=64),
    "kimi_k25": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, pos_emb_height=16, pos_emb_width=16),
}
_VISION["idefics3"] = _VISION["gemma3"] = _VISION["paligemma"] = _VISION["smolvlm"]
_VISION["qwen3_vl_moe"] = _VISION["qwen3_vl"]
_VISION["llava_next_video"] = _VISION["llava_onevision"] = _VISION["llava_next"]
_VISION["glm4v"] = _VISION["glm4v_moe"] = _VISION["glm46v"] = {k: v for k, v in _VISION["qwen2_5_vl"].items() if k != "fullatt_block_indexes"}
_VISION["qwen3_5"] = _VISION["qwen3_5_moe"] = {k: v for k, v in _VISION["qwen3_vl"].items() if k != "deepstack_visual_indexes"}
_VISION["qwen2_5_omni_thinker"], _VISION["qwen3_omni_moe_thinker"] = _VISION["qwen2_5_vl"], _VISION["qwen3_vl"]
_AUDIO_TOWER = dict(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, output_dim="TEXT", downsample_hidden_size=8)
"""The Omni thinkers' audio tower in the small copy (mel bins and windows kept)."""
BUILDS = tuple(_VISION)
"""The families whose small copies and random images this module makes."""
_TILES = [[16, 16], [16, 32], [32, 16], [32, 32]]
"""LLaVA-NeXT's and LLaVA-OneVision's anyres grids in the small copy: tiles of 16 x 16 pixels, 2 x 2 patches."""
_VIDEO_RUNS = ("llava_next_video", "llava_onevision")
"""Families whose video is one run of placeholders: ``[1, frames, C, H, W]``."""
_ROW_OF_IMAGES = ("smolvlm", "idefics3")
"""Families that take a row's images as one ``[1, N, C, H, W]``."""
_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "image_start_token_id", "image_end_token_id",
           "boi_token_id", "eoi_token_id", "image_token_index", "video_token_index", "audio_token_id", "audio_token_index", "audio_start_token_id",
           "audio_end_token_id")


def _sections(sections: list[int], half: int) -> list[int]:
    """Multimodal RoPE's sections rescaled to sum to ``half`` (the small head dim's half), each at least 1."""
    total = sum(sections)
    out = [max(1, s * half // total) for s in sections]
    out[-1] += half - sum(out)
    return out


def shrink_image_text_config(config, shrink_text):
    """A small copy of an image-text ``config``: the text config through ``shrink_text`` (the text
    models' `shrink_config`, without its layer scan: 2 layers), the vision config's widths and
    depth, images of a few patches, and the placeholder ids at the top of the small vocabulary."""
    small = copy.deepcopy(config)
    text = shrink_text(small.text_config)
    small.text_config = text
    rope = getattr(text, "rope_parameters", None)
    if STYLES[small.model_type] == "grid" and isinstance(rope, dict) and small.model_type != "kimi_k25":  # Kimi: DeepSeek's 1-D RoPE
        rotary = rope.get("partial_rotary_factor") or 1.0  # GLM-4.5V rotates half of each head
        half = int((getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) * rotary) // 2
        rope["mrope_section"] = _sections(rope.get("mrope_section") or [1, 1, 2], half)
    vision = small.vision_config
    for name, value in _VISION[small.model_type].items():
        if hasattr(vision, name):
            setattr(vision, name, text.hidden_size if value == "TEXT" else value)
    if STYLES[small.model_type] in ("images", "sized"):  # 4 x 4 tokens (SmolVLM, InternVL, Mistral 3: times their patches per token)
        vision.image_size = _per_side(vision.patch_size, lambda p: p * 4 * _shuffle(small))
    if hasattr(small, "image_grid_pinpoints"):  # LLaVA-NeXT, -Video, OneVision: anyres tiles of 2 x 2 patches
        small.image_grid_pinpoints = _TILES
    if hasattr(small, "mm_tokens_per_image"):  # Gemma 3 pools the 4 x 4 patches to this many tokens
        small.mm_tokens_per_image = 16
    if small.model_type == "paligemma":  # its projection goes to the text width; an image is its patches' tokens
        small.projection_dim = vision.projection_dim = text.hidden_size
        text.num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    if small.model_type in AUDIO and getattr(small, "vision_start_token_id", None) is None:  # the Omni thinkers' configs leave their
        small.vision_start_token_id, small.vision_end_token_id = 0, 1  # vision markers to the checkpoint's; placed with the others below
    for i, name in enumerate(n for n in _TOKENS if isinstance(getattr(small, n, None), int)):
        for holder in (small, text):
            if isinstance(getattr(holder, name, None), int):
                setattr(holder, name, text.vocab_size - 1 - i)
    if small.model_type in AUDIO_BY_ENCODER:  # Gemma 4's audio tower casts to float32 and then meets fp64 (transformers 5.25):
        small.audio_config = None  # the check runs without it (tests/vlm_cases.py holds its audio, float32 lifted to fp64)
    for name, value in _AUDIO_TOWER.items() if small.model_type in AUDIO else ():
        if hasattr(small.audio_config, name):
            setattr(small.audio_config, name, text.hidden_size if value == "TEXT" else value)
    if hasattr(small, "projection_hidden_size"):  # Kimi-K2.5's projector normalizes the vision tower's width
        small.projection_hidden_size = vision.hidden_size
    small.text_config.use_cache = False
    return small


def _shuffle(config) -> int:
    """Patches a token spans along a side: SmolVLM's ``scale_factor``, InternVL's ``1 / downsample_ratio``, Mistral 3's
    ``spatial_merge_size``, else 1."""
    return getattr(config, "scale_factor", None) or getattr(config, "spatial_merge_size", None) or round(1 / getattr(config, "downsample_ratio", 1))


def _per_side(size, fn):
    """``fn`` of a size given as an int or, InternVL's, as ``[height, width]``."""
    return [fn(x) for x in size] if isinstance(size, (list, tuple)) else fn(size)


def build(config, device, seed: int):
    import transformers

    torch.manual_seed(seed)  # experts as a loop of matmuls: grouped_mm takes no fp64
    model = transformers.AutoModelForImageTextToText.from_config(config, experts_implementation="eager")
    return model.to(device=device, dtype=torch.float64).train()


def _item(config, kind: str, g: torch.Generator) -> tuple[list[int], dict]:
    """One image (or video) of 16 tokens: its token ids (Qwen: between its markers; Qwen3-VL's and Qwen3.5's
    video frame by frame, a text token between; the Omni thinkers' in one run) and its inputs; or an audio clip's."""
    style, vision = STYLES[config.model_type], config.vision_config
    token = _id(config, kind)
    if kind == "audio":  # a clip of mel frames, its tokens between its markers: 16 (Qwen2.5-Omni) or 13 (Qwen3-Omni)
        frames, tokens = _clip(config)
        features = torch.randn(1, config.audio_config.num_mel_bins, frames, generator=g, dtype=torch.float64)
        end = getattr(config, "audio_end_token_id", None)  # Qwen3-Omni's thinker config names none: a text token in its place
        ids = [config.audio_start_token_id] + [_id(config, "audio")] * tokens + [0 if end is None else end]
        return ids, {"input_features": features, "feature_attention_mask": torch.ones(1, frames, dtype=torch.long)}
    if config.model_type == "kimi_k25":  # MoonViT: 8 x 8 patches of 3 x p x p pixels, merged 2 x 2: 16 tokens between its markers
        (mh, mw), patch = vision.merge_kernel_size, vision.patch_size  # (a video: 2 such frames, averaged in time)
        grid = [1 if kind == "image" else 2, 4 * mh, 4 * mw]
        pixels = torch.randn(grid[0] * grid[1] * grid[2], 3, patch, patch, generator=g, dtype=torch.float64)
        ids = [config.vision_start_token_id] + [token] * 16 + [config.vision_end_token_id]
        return ids, {"pixel_values" if kind == "image" else "pixel_values_videos": pixels, f"{kind}_grid_thw": torch.tensor([grid])}
    if config.model_type == "gemma4":  # (4 k) x (4 k) patches pooled k x k: 16 tokens between its markers; each patch's (x, y);
        k, patch = vision.pooling_kernel_size, vision.patch_size  # a video: 2 frames of (4 k) x (2 k) patches, 8 tokens each
        frames, height = (1, 4 * k) if kind == "image" else (2, 2 * k)
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(4 * k), indexing="ij")
        pixels = torch.rand(frames, 4 * k * height, 3 * patch * patch, generator=g, dtype=torch.float64)
        where = torch.stack([xs.flatten(), ys.flatten()], -1).repeat(frames, 1, 1)
        run = [config.boi_token_id] + [token] * (16 // frames) + [config.eoi_token_id]
        if kind == "image":
            return run, {"pixel_values": pixels, "image_position_ids": where}
        return run + [0] + run, {"pixel_values_videos": pixels, "video_position_ids": where, "num_frames_per_video": torch.tensor([2])}
    if style == "runs":  # LLaVA-NeXT, -Video, OneVision: an image of 16 x 32 pixels, a base tile and two anyres tiles of 2 x 2
        if kind == "image":  # patches, pooled 2 x 2 to one token; 4 + 2 rows of 4 and a newline each: 14 tokens
            pixels = torch.randn(1, 3, 3, 16, 16, generator=g, dtype=torch.float64)
            return [token] * 14, {"pixel_values": pixels, "image_sizes": torch.tensor([[16, 32]])}
        frames = 15 if config.model_type == "llava_onevision" else 16  # a video's frames pooled to a token each (OneVision: a
        pixels = torch.randn(1, frames, 3, 16, 16, generator=g, dtype=torch.float64)  # newline token after them): 16 tokens
        return [token] * 16, {"pixel_values_videos": pixels}
    if style == "sized":  # Mistral 3: 4 rows of 4 tokens, a break token (text) after each row but the last
        side = vision.patch_size * 4 * config.spatial_merge_size
        pixels = torch.randn(1, 3, side, side, generator=g, dtype=torch.float64)
        return [token] * 4 + ([0] + [token] * 4) * 3, {"pixel_values": pixels, "image_sizes": torch.tensor([[side, side]])}
    if style == "images":
        side, patch = (x[0] if isinstance(x, (list, tuple)) else x for x in (vision.image_size, vision.patch_size))  # square
        pixels = torch.randn(1, 3, side, side, generator=g, dtype=torch.float64)
        per_side = side // patch // _shuffle(config)
        extra = 1 if getattr(config, "vision_feature_select_strategy", "default") == "full" else 0
        return [token] * (per_side * per_side + extra), {"pixel_values": pixels}
    m, t = vision.spatial_merge_size, vision.temporal_patch_size
    grid = [1, 4 * m, 4 * m] if kind == "image" else [2, 2 * m, 4 * m]
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 3 * t * vision.patch_size ** 2, generator=g, dtype=torch.float64)
    start, end = (getattr(config, f"vision_{x}_token_id", None) or getattr(config, f"image_{x}_token_id") for x in ("start", "end"))  # GLM: image_*
    if kind == "video" and config.model_type.startswith("qwen3") and config.model_type not in AUDIO:  # frames after timestamps
        ids = [start] + [token] * 8 + [end] + [0] + [start] + [token] * 8 + [end]
    else:
        ids = [start] + [token] * 16 + [end]
    key = "pixel_values" if kind == "image" else "pixel_values_videos"
    timing = {"video_second_per_grid": torch.tensor([0.5])} if kind == "video" and config.model_type in AUDIO else {}  # Omni numbers time
    return ids, {key: pixels, f"{kind}_grid_thw": torch.tensor([grid]), **timing}


def _id(config, kind: str) -> int | None:
    """The placeholder id of an ``"image"``, ``"video"`` or ``"audio"`` token (Qwen2.5-Omni names them ``*_token_index``), or None."""
    return getattr(config, f"{kind}_token_id", None) or getattr(config, f"{kind}_token_index", None)


def _clip(config) -> tuple[int, int]:
    """(mel frames, tokens) of an audio clip: two halvings of 64 frames (Qwen2.5-Omni), or one window of
    ``2 * n_window`` frames, 13 tokens (Qwen3-Omni)."""
    if config.model_type == "qwen3_omni_moe_thinker":
        return 2 * config.audio_config.n_window, 13
    return 64, 16


def _document(config, parts: list, g: torch.Generator) -> dict:
    """Token ids and inputs of a document of text runs (ints: their lengths) and items ("image", "video")."""
    text_top = config.text_config.vocab_size - 1 - len(_TOKENS)
    ids, inputs = [], {}
    for part in parts:
        if isinstance(part, int):
            ids += torch.randint(0, text_top, (part,), generator=g).tolist()
            continue
        item, visual = _item(config, part, g)
        ids += item
        for key, value in visual.items():
            inputs[key] = torch.cat([inputs[key], value]) if key in inputs else value
    if config.model_type in _ROW_OF_IMAGES and "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"][None]  # SmolVLM, Idefics3: the images of a row in one [1, N, ...]
    input_ids = torch.tensor([ids])
    placeholders = [_id(config, kind) for kind in ("image", "video", "audio")]
    visual = torch.isin(input_ids, torch.tensor([t for t in placeholders if t is not None]))
    out = {"input_ids": input_ids, "labels": input_ids.masked_fill(visual, -100), **inputs}
    if STYLES[config.model_type] == "grid" or config.model_type == "gemma4":
        out["mm_token_type_ids"] = (input_ids == _id(config, "image")).int() + 2 * (input_ids == _id(config, "video")).int()
    if config.model_type == "gemma3":  # 1 on image tokens, which attend to each other both ways
        out["token_type_ids"] = (input_ids == config.image_token_id).int()
    if config.model_type == "paligemma":  # 0 on the prefix (through the first image and two tokens more, or 3 tokens), 1 after
        image = (input_ids[0] == config.image_token_id).nonzero()
        prefix = int(image[-1 if len(image) <= 16 else 15]) + 3 if len(image) else 3
        out["token_type_ids"] = (torch.arange(input_ids.shape[1]) >= prefix).int()[None]
    return out


def rows(config, sp_size: int, packed: bool, seed: int) -> tuple[dict, list[dict]]:
    """(the batch of one row, its documents' own inputs). Unpacked: one document with an image across
    the first zigzag chunk's end and a video (LLaVA, SmolVLM: an image; the Omni thinkers: an audio
    clip); packed: three, the middle one text only (the Omni thinkers: the first holds a video)."""
    g = torch.Generator().manual_seed(seed)
    videos = STYLES[config.model_type] == "grid" and config.model_type not in VIDEO_AS_IMAGE_TOKENS or config.model_type in ("gemma4", *_VIDEO_RUNS)
    second = "video" if videos else "image"
    first, second = (second, "audio") if config.model_type in AUDIO else ("image", second)  # the Omni thinkers: a video and a clip too
    if packed:
        plans = [[3, first, 2], [7], [3, second, 4, "image", 2]]
    else:  # 48 P tokens: the image (14 to 18 of them) from 16 on crosses token 24, the first zigzag chunk's end
        plans = [[16, "image", 5, second, max(2, 48 * sp_size - 57)]]
    docs = [_document(config, plan, g) for plan in plans]
    batch = {}
    for key in docs[0].keys() | {k for d in docs for k in d}:
        held = [d[key] for d in docs if key in d]
        rowwise = key in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids") or key == "pixel_values" and config.model_type in _ROW_OF_IMAGES
        batch[key] = torch.cat(held, dim=1 if rowwise else 0)
    if packed:  # shard_batch drops the targets across documents
        batch["position_ids"] = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    return batch, docs


def _loss_sum(ref, doc: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = {k: v.to(device) for k, v in doc.items() if k != "labels"}
    if ref.config.model_type in AUDIO:  # the Omni thinkers number their 3-D positions only given a mask, as their processor gives
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    logits = ref(**inputs).logits
    labels = doc["labels"].to(device)
    return F.cross_entropy(logits[0, :-1], labels[0, 1:], ignore_index=-100, reduction="none"), labels[0, 1:] != -100


def one_process_loss(ref, docs: list[dict], device) -> torch.Tensor:
    """The mean next-token loss of one process, each document run on its own with its images."""
    total, count = 0, 0
    for doc in docs:
        losses, valid = _loss_sum(ref, doc, device)
        total, count = total + losses.sum(), count + int(valid.sum())
    return total / count


def noise_part(ref, doc: dict, device, part: str):
    """The loss summed over the ``part`` (whole, first or second half) of one document's targets."""
    losses, _ = _loss_sum(ref, doc, device)
    half = losses.numel() // 2
    return {"whole": losses, "first": losses[:half], "second": losses[half:]}[part].sum()
