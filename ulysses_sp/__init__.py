"""ulysses-sp: sequence parallelism for long-context transformer training.

>>> topo = ulysses_sp.init_sequence_parallel(sp_size=4)
>>> attn = ulysses_sp.SequenceParallelAttention(topo, backend="auto", layer_idx=0)
>>> out = attn(q, k, v, causal=True)   # q, k, v: this rank's shards [B, S/P, H, D]
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import comm
from . import rl  # noqa: F401  (usp.rl: sequence log-probabilities for DPO and GRPO)
from .attention import SequenceParallelAttention, sp_attention
from .comm import CommCounter
from .data import (
    SequenceParallelSampler,
    cu_seqlens_from_position_ids,
    gather_sequence,
    shard_batch,
    shard_sequence,
    sp_cross_entropy,
    model_inputs,
    target_counts,
)
from .layout import pad_to_multiple
from .loss import causal_lm_loss, sp_linear_cross_entropy
from .registry import get_backend, list_backends, register_backend
from .profile import CPU_GLOO_PROFILE, CPU_GLOO_PROFILE_P4, NVLINK_PROFILE, LinkCost, Profile, default_profile, load_profile
from .spec import AttnSpec, Estimate
from .topology import Topology, init_sequence_parallel

if TYPE_CHECKING:
    from collections.abc import Callable

    from torch import nn
    from transformers import PretrainedConfig

    from .models.verify import VerifyReport

__version__ = "0.1.0"


def apply_sequence_parallel(model: nn.Module, topo: Topology, backend: str | list[str] | Callable[[int], str] = "auto",
                            profile: Profile | None = None, kernel: str = "auto", tiled_mlp: bool | int = False, checkpoint: str = "none",
                            mixer: str = "auto", tiled_norms: bool = False) -> nn.Module:
    """Switch a loaded Hugging Face transformers model to sequence-parallel attention and token mixers.

    Every attention layer gets its own `SequenceParallelAttention` (so ``auto`` chooses per layer);
    the previous attention implementation is kept for `remove_sequence_parallel`, and the KV cache
    is turned off (training and evaluation, not generation). Feed the model
    ``model_inputs(shard_batch(batch, topo))``. Of an image- or video-text model of the families
    ``ulysses_sp.models.image_text.TESTED`` names only the text decoder is switched, and the
    sequence is split at its input. The first forward checks that every attention layer called
    the SP attention and that global ``position_ids`` were passed. Needs the ``hf`` extra.

    Args:
        model: A loaded transformers model (a causal LM, or a tested image-text family).
        topo: The topology from `init_sequence_parallel`.
        backend: One backend name for every attention layer (``auto``: decided per layer and
            shape), a list with one name per attention layer, or a callable ``layer_idx -> name``
            (e.g. ``halo`` for the ``sliding_attention`` layers of ``config.layer_types`` and
            ``ring`` for the others).
        profile: What ``auto`` estimates with (default: the topology's, else the built-in one).
        kernel: The local attention kernel: ``auto``, ``flash_attn``, ``torch`` or ``math``.
        tiled_mlp: ``True`` runs each decoder layer's ``mlp`` over tiles of
            ``max(1024, hidden_size)`` tokens, recomputing each tile in the backward; an int is
            the tile in tokens (`ulysses_sp.tiling`).
        checkpoint: ``none``, ``layers`` (recompute each decoder layer in the backward) or
            ``offload`` (also keep each checkpointed layer input in pinned host memory on CUDA;
            its counters are in ``ulysses_sp.tiling.offload_store(model)``).
        mixer: The strategy for hybrid models' other token mixers (Gated DeltaNet, Mamba2, short
            convolutions): ``auto``, ``halo``, ``ulysses``, ``allgather``, ``state`` (Gated DeltaNet, Kimi Delta Attention, Mamba2), or ``none`` (refuse them).
        tiled_norms: Also run the decoder layers' norms and the final one over tiles (at the
            MLP's tile size), so their float32 intermediates never exist for the whole shard.

    Returns:
        ``model``, switched.

    Raises:
        ValueError: A model SP does not cover, naming each module (attention computed in the
            model's own code, ALiBi, a token mixer without a strategy, positions numbered inside
            the model, an untested image-text or an audio-text model), a per-layer backend list
            of the wrong length, or invalid ``tiled_mlp``, ``checkpoint`` or ``tiled_norms``
            (including ``checkpoint`` with transformers' own gradient checkpointing on).
    """
    from .models.switch import apply_sequence_parallel as apply

    return apply(model, topo, backend=backend, profile=profile, kernel=kernel, tiled_mlp=tiled_mlp, checkpoint=checkpoint, mixer=mixer,
                 tiled_norms=tiled_norms)


def verify_sequence_parallel(model_or_config: nn.Module | PretrainedConfig, topo: Topology, **options: Any) -> VerifyReport:
    """Check that SP computes the one-process loss and gradients for a model's architecture.

    A small copy of the architecture (every kind of layer kept, small widths, float64, random
    weights) runs one forward and backward in one process and under SP on ``topo``, unpacked
    and packed, and the loss and every parameter's gradient are compared. Every rank of the SP
    group must call it. Needs the ``hf`` extra; see `ulysses_sp.models.verify`.

    Args:
        model_or_config: A transformers model or config.
        topo: The topology from `init_sequence_parallel`.
        **options: Keyword arguments of
            ``ulysses_sp.models.verify.verify_sequence_parallel``: ``backend``, ``kernel``
            and ``mixer`` (as `apply_sequence_parallel`'s), ``shrink``, ``seq_len``,
            ``tolerance``, ``packed``, ``seed``, ``raise_on_mismatch``.

    Returns:
        The report: the worst relative errors, the backends and mixers that ran, the time taken.

    Raises:
        SequenceParallelMismatch: An error past the tolerance (an ``AssertionError``), naming the
            worst parameters.
        ValueError: A model SP does not cover.
    """
    from .models.verify import verify_sequence_parallel as verify

    return verify(model_or_config, topo, **options)


def remove_sequence_parallel(model: nn.Module) -> nn.Module:
    """Undo `apply_sequence_parallel`, e.g. to evaluate or generate on whole sequences.

    Restores the previous attention implementation and ``use_cache``, and removes the tiled
    MLPs and norms, the layer checkpointing and the mixers' strategies. A model that is not
    switched is returned as it is.

    Args:
        model: The model given to `apply_sequence_parallel`.

    Returns:
        ``model``.
    """
    from .models.switch import remove_sequence_parallel as remove

    return remove(model)

__all__ = [
    "init_sequence_parallel",
    "apply_sequence_parallel",
    "remove_sequence_parallel",
    "verify_sequence_parallel",
    "Topology",
    "SequenceParallelAttention",
    "sp_attention",
    "shard_sequence",
    "gather_sequence",
    "shard_batch",
    "cu_seqlens_from_position_ids",
    "sp_cross_entropy",
    "model_inputs",
    "target_counts",
    "sp_linear_cross_entropy",
    "causal_lm_loss",
    "SequenceParallelSampler",
    "pad_to_multiple",
    "CommCounter",
    "comm",
    "register_backend",
    "get_backend",
    "list_backends",
    "AttnSpec",
    "Estimate",
    "Profile",
    "LinkCost",
    "load_profile",
    "CPU_GLOO_PROFILE",
    "CPU_GLOO_PROFILE_P4",
    "default_profile",
    "NVLINK_PROFILE",
]
