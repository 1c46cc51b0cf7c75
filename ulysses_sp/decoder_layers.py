"""Where a Hugging Face model keeps its transformer blocks: what tiling, checkpointing, rank
dropout, FSDP2 and the step memory model work per layer on."""

from __future__ import annotations

__all__ = ["decoder_layers"]


def decoder_layers(model) -> list:
    """The modules that hold one transformer block: transformers' GradientCheckpointingLayer
    subclasses, else classes named ``*DecoderLayer``."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover
        GradientCheckpointingLayer = ()
    found = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and type(m).__name__.endswith("Layer")]
    return found or [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
