"""What the per-layer strategies share: the calls they refuse by name, the packing keywords that the
strategies running whole documents (allgather) or building their own masks (indexed) drop, and a
submodule's forward shadowed for one call (indexed, compressed), and a module's parameter count under ZeRO-3 too."""

from __future__ import annotations

import contextlib

_CACHE_KWARGS = ("cache", "cache_params", "past_key_values")
PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
"""The global packed row's boundaries, as transformers' attention keywords."""


def refuse_unsupported(module, kwargs: dict, strategy: str) -> None:
    """A padding ``attention_mask`` or a generation cache in a mixer call: ``ValueError`` naming the fix."""
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool(mask.all()):
        raise ValueError(f"{type(module).__name__}: a padding attention_mask is not supported by the {strategy} mixer; pad on the right "
                         "with ulysses_sp.shard_batch and drop attention_mask")
    if any(kwargs.get(k) is not None for k in _CACHE_KWARGS):
        raise ValueError(f"{type(module).__name__}: a cache (generation) is not supported under sequence parallelism; "
                         "call remove_sequence_parallel(model) to generate")


@contextlib.contextmanager
def shadowed_forward(module, replacement):
    """``module.forward`` is ``replacement`` inside the block, and after it what it was: an instance forward that
    others installed (accelerate's hooks, Hub kernels) is put back, not dropped."""
    saved = module.__dict__.get("forward")
    module.__dict__["forward"] = replacement
    try:
        yield
    finally:
        if saved is None:
            module.__dict__.pop("forward", None)
        else:
            module.__dict__["forward"] = saved


def parameter_count(module) -> int:
    """The module's parameters, counted whole also under DeepSpeed ZeRO-3 (whose partitioned parameters hold an empty
    tensor outside their module's call, their size in ``ds_numel``)."""
    return sum(getattr(p, "ds_numel", p.numel()) for p in module.parameters())
