"""What the per-layer strategies (halo, ulysses) share: the calls they refuse by name."""

from __future__ import annotations

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")


def refuse_unsupported(module, kwargs: dict, strategy: str) -> None:
    """A padding ``attention_mask`` or a generation cache in a mixer call: ``ValueError`` naming the fix."""
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(f"{type(module).__name__}: a padding attention_mask is not supported by the {strategy} mixer; pad on the right "
                         "with ulysses_sp.shard_batch and drop attention_mask")
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        raise ValueError(f"{type(module).__name__}: a cache (generation) is not supported under sequence parallelism; "
                         "call remove_sequence_parallel(model) to generate")
