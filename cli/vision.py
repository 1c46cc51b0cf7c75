"""``sp-bench plan --images N`` on an image-text model's config: the vision tower's share of work per
rank. Each image is encoded on one rank of the SP group (``ulysses_sp.models.image_text.owners``: by patches, the
largest first to the least loaded rank) and its feature rows go to the ranks holding its tokens.

FLOPs are 6 per vision parameter (tower and projector, counted on a meta-device build) per patch,
plus attention within each image, 12 x layers x patches x width per patch; forward and backward.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["VisionShare", "vision_share", "describe"]


@dataclass
class VisionShare:
    family: str
    images: int
    image_size: tuple[int, int]
    patches: int
    """Per image."""
    tokens: int
    """Per image, in the text sequence."""
    per_rank_images: list[int]
    per_rank_patches: list[int]
    flops_per_image: float
    sent_bytes: float
    """Feature bytes a rank sends, for images placed evenly along the sequence: an owned image's
    tokens held elsewhere, (P-1)/P of them."""


def _size(text: str | None, default: tuple[int, int]) -> tuple[int, int]:
    if not text:
        return default
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--image-size {text!r}: give HEIGHTxWIDTH in pixels, e.g. 448x448") from None
    return h, w


def vision_share(config: dict, *, images: int, image_size: str | None, sp_size: int, dtype_bytes: int) -> VisionShare:
    import torch
    import transformers

    from ulysses_sp.models.image_text import STYLES, owners, text_decoder

    model_type = config.get("model_type")
    if model_type not in STYLES:
        raise ValueError(f"--images plans the vision tower of the image-text families ulysses_sp switches ({', '.join(sorted(STYLES))}); "
                         f"this config's model_type is {model_type!r}")
    hf = transformers.AutoConfig.for_model(**config)
    vision = hf.vision_config
    p = vision.patch_size
    if STYLES[model_type] == "grid":  # the processor resizes to multiples of patch x merge
        m = vision.spatial_merge_size
        h, w = (max(p * m, round(x / (p * m)) * p * m) for x in _size(image_size, (448, 448)))
        patches, tokens = (h // p) * (w // p), (h // p) * (w // p) // (m * m)
    else:
        side = vision.image_size
        h, w = _size(image_size, (side, side))
        if (h, w) != (side, side):
            raise ValueError(f"{model_type} encodes images of {side}x{side} pixels (its processor resizes or tiles to that); "
                             f"--image-size {image_size} does not apply")
        patches = (side // p) ** 2
        scale = getattr(hf, "scale_factor", 1) or 1
        tokens = patches // (scale * scale) + (1 if getattr(hf, "vision_feature_select_strategy", "default") == "full" else 0)
    with torch.device("meta"):
        model = transformers.AutoModelForImageTextToText.from_config(hf)
    text = {id(q) for q in text_decoder(model).parameters()} | {id(q) for q in model.get_output_embeddings().parameters()}
    params = sum(q.numel() for q in model.parameters() if id(q) not in text)
    width = getattr(vision, "embed_dim", None) or vision.hidden_size
    layers = getattr(vision, "depth", None) or vision.num_hidden_layers
    flops = 6.0 * params * patches + 12.0 * layers * patches * patches * width
    owner = owners([patches] * images, sp_size)
    per_rank = [owner.count(r) for r in range(sp_size)]
    hidden = hf.get_text_config().hidden_size
    return VisionShare(model_type, images, (h, w), patches, tokens, per_rank, [n * patches for n in per_rank], flops,
                       max(per_rank) * tokens * (sp_size - 1) / sp_size * hidden * dtype_bytes)


def describe(share: VisionShare, seq_len: int) -> list[str]:
    n, p = share.images, len(share.per_rank_images)
    busiest = max(share.per_rank_images)
    mean = n / p
    lines = [f"vision tower ({share.family}): {n} images of {share.image_size[0]}x{share.image_size[1]} pixels, {share.patches} patches "
             f"and {share.tokens} tokens each ({n * share.tokens} of the {seq_len} tokens)"]
    if n * share.tokens > seq_len:
        lines.append(f"  the images' {n * share.tokens} tokens do not fit in --seq {seq_len}")
    lines.append(f"  each image encoded on one rank: the busiest rank {busiest} images, {busiest * share.patches} patches, "
                 f"{busiest * share.flops_per_image / 1e12:.2f} TFLOP forward+backward ({busiest / n:.1%} of one process's "
                 f"{n * share.flops_per_image / 1e12:.2f}; over the mean {busiest / mean if mean else 0:.2f})")
    lines.append(f"  features to the ranks holding their tokens: about {share.sent_bytes / 2**20:.1f} MiB sent by the busiest rank")
    return lines
