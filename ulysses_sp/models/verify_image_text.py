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

from .image_text import IMAGES_ONLY, NO_AUDIO_YET, STYLES

__all__ = ["shrink_image_text_config", "build", "rows", "one_process_loss", "noise_part"]

_VISION = {  # vision config fields per family in the small copy ("TEXT": the text model's width)
    "qwen2_vl": dict(depth=2, embed_dim=32, num_heads=4, mlp_ratio=2, hidden_size="TEXT"),
    "qwen2_5_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size="TEXT", fullatt_block_indexes=[1]),
    "qwen3_vl": dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size="TEXT", num_position_embeddings=64,
                     deepstack_visual_indexes=[0, 1]),
    "llava": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, projection_dim=32),
    "smolvlm": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
    "internvl": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4),
    "mistral3": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, head_dim=8),
    "gemma4": dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                   position_embedding_size=64),
}
_VISION["idefics3"] = _VISION["gemma3"] = _VISION["paligemma"] = _VISION["smolvlm"]
_VISION["qwen3_vl_moe"] = _VISION["qwen3_vl"]
_VISION["glm4v"] = _VISION["glm4v_moe"] = _VISION["glm46v"] = {k: v for k, v in _VISION["qwen2_5_vl"].items() if k != "fullatt_block_indexes"}
_VISION["qwen3_5"] = _VISION["qwen3_5_moe"] = {k: v for k, v in _VISION["qwen3_vl"].items() if k != "deepstack_visual_indexes"}
BUILDS = tuple(_VISION)
"""The families whose small copies and random images this module makes (LLaVA-NeXT's not yet)."""
_TOKENS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id", "image_start_token_id", "image_end_token_id",
           "boi_token_id", "eoi_token_id")


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
    if STYLES[small.model_type] == "grid" and isinstance(rope, dict):  # absent: the model's default, for the full head dim
        rotary = rope.get("partial_rotary_factor") or 1.0  # GLM-4.5V rotates half of each head
        half = int((getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads) * rotary) // 2
        rope["mrope_section"] = _sections(rope.get("mrope_section") or [1, 1, 2], half)
    vision = small.vision_config
    for name, value in _VISION[small.model_type].items():
        if hasattr(vision, name):
            setattr(vision, name, text.hidden_size if value == "TEXT" else value)
    if STYLES[small.model_type] in ("images", "sized"):  # 4 x 4 tokens (SmolVLM, InternVL, Mistral 3: times their patches per token)
        vision.image_size = _per_side(vision.patch_size, lambda p: p * 4 * _shuffle(small))
    if hasattr(small, "mm_tokens_per_image"):  # Gemma 3 pools the 4 x 4 patches to this many tokens
        small.mm_tokens_per_image = 16
    if small.model_type == "paligemma":  # its projection goes to the text width; an image is its patches' tokens
        small.projection_dim = vision.projection_dim = text.hidden_size
        text.num_image_tokens = (vision.image_size // vision.patch_size) ** 2
    for i, name in enumerate(n for n in _TOKENS if isinstance(getattr(small, n, None), int)):
        for holder in (small, text):
            if isinstance(getattr(holder, name, None), int):
                setattr(holder, name, text.vocab_size - 1 - i)
    if small.model_type in NO_AUDIO_YET:  # its audio is refused under SP: the check runs without the audio tower
        small.audio_config = None
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
    """One image (or video) of 16 tokens: its token ids (Qwen: between its markers; Qwen3-VL's video
    frame by frame, a text token between) and its inputs."""
    style, vision = STYLES[config.model_type], config.vision_config
    token = config.image_token_id if kind == "image" else config.video_token_id
    if config.model_type == "gemma4":  # (4 k) x (4 k) patches pooled k x k: 16 tokens between its markers; each patch's (x, y)
        side, patch = 4 * vision.pooling_kernel_size, vision.patch_size
        ys, xs = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        pixels = torch.rand(1, side * side, 3 * patch * patch, generator=g, dtype=torch.float64)
        where = torch.stack([xs.flatten(), ys.flatten()], -1)[None]
        return [config.boi_token_id] + [token] * 16 + [config.eoi_token_id], {"pixel_values": pixels, "image_position_ids": where}
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
    if kind == "video" and config.model_type.startswith("qwen3"):  # Qwen3-VL's and Qwen3.5's frames, each after a timestamp
        ids = [start] + [token] * 8 + [end] + [0] + [start] + [token] * 8 + [end]
    else:
        ids = [start] + [token] * 16 + [end]
    key = "pixel_values" if kind == "image" else "pixel_values_videos"
    return ids, {key: pixels, f"{kind}_grid_thw": torch.tensor([grid])}


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
    if config.model_type in ("smolvlm", "idefics3") and "pixel_values" in inputs:
        inputs["pixel_values"] = inputs["pixel_values"][None]  # SmolVLM, Idefics3: the images of a row in one [1, N, ...]
    input_ids = torch.tensor([ids])
    visual = (input_ids == config.image_token_id) | (input_ids == getattr(config, "video_token_id", -1))
    out = {"input_ids": input_ids, "labels": input_ids.masked_fill(visual, -100), **inputs}
    if STYLES[config.model_type] == "grid" or config.model_type == "gemma4":
        out["mm_token_type_ids"] = (input_ids == config.image_token_id).int() + 2 * (input_ids == config.video_token_id).int()
    if config.model_type == "gemma3":  # 1 on image tokens, which attend to each other both ways
        out["token_type_ids"] = (input_ids == config.image_token_id).int()
    if config.model_type == "paligemma":  # 0 on the prefix (through the first image and two tokens more, or 3 tokens), 1 after
        image = (input_ids[0] == config.image_token_id).nonzero()
        prefix = int(image[-1 if len(image) <= 16 else 15]) + 3 if len(image) else 3
        out["token_type_ids"] = (torch.arange(input_ids.shape[1]) >= prefix).int()[None]
    return out


def rows(config, sp_size: int, packed: bool, seed: int) -> tuple[dict, list[dict]]:
    """(the batch of one row, its documents' own inputs). Unpacked: one document with an image across
    the first zigzag chunk's end and a video (LLaVA, SmolVLM: an image); packed: three, the middle
    one text only."""
    g = torch.Generator().manual_seed(seed)
    second = "video" if STYLES[config.model_type] == "grid" and config.model_type not in IMAGES_ONLY else "image"
    if packed:
        plans = [[3, "image", 2], [7], [3, second, 4, "image", 2]]
    else:  # 48 P tokens: the image (16 or 18 of them) from 16 on crosses token 24, the first zigzag chunk's end
        plans = [[16, "image", 5, second, max(2, 48 * sp_size - 57)]]
    docs = [_document(config, plan, g) for plan in plans]
    batch = {}
    for key in docs[0].keys() | {k for d in docs for k in d}:
        held = [d[key] for d in docs if key in d]
        batch[key] = torch.cat(held, dim=1 if key in ("input_ids", "labels", "mm_token_type_ids", "token_type_ids") or held[0].dim() == 5 else 0)
    if packed:  # shard_batch drops the targets across documents
        batch["position_ids"] = torch.cat([torch.arange(d["input_ids"].shape[1]) for d in docs])[None]
    return batch, docs


def _loss_sum(ref, doc: dict, device) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = {k: v.to(device) for k, v in doc.items() if k != "labels"}
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
