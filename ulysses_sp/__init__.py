"""ulysses-sp: sequence parallelism for long-context transformer training.

>>> topo = ulysses_sp.init_sequence_parallel(sp_size=4)
>>> attn = ulysses_sp.SequenceParallelAttention(topo, backend="auto", layer_idx=0)
>>> out = attn(q, k, v, causal=True)   # q, k, v: this rank's shards [B, S/P, H, D]
"""

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

__version__ = "0.1.0"


def apply_sequence_parallel(model, topo, backend: str = "auto", profile=None, kernel: str = "auto", tiled_mlp=False, checkpoint: str = "none",
                            mixer: str = "auto", tiled_norms: bool = False):
    """Switch a Hugging Face transformers model to sequence-parallel attention and token mixers
    (needs the ``hf`` extra), optionally with tiled MLPs and norms and per-layer checkpointing; see
    :mod:`ulysses_sp.integrations.transformers`."""
    from .integrations.transformers import apply_sequence_parallel as apply

    return apply(model, topo, backend=backend, profile=profile, kernel=kernel, tiled_mlp=tiled_mlp, checkpoint=checkpoint, mixer=mixer,
                 tiled_norms=tiled_norms)


def verify_sequence_parallel(model_or_config, topo, **options):
    """Check on a small copy of the architecture that SP gives the one-process loss and
    gradients (needs the ``hf`` extra); see :mod:`ulysses_sp.integrations.verify`."""
    from .integrations.verify import verify_sequence_parallel as verify

    return verify(model_or_config, topo, **options)


def remove_sequence_parallel(model):
    """Undo :func:`apply_sequence_parallel`."""
    from .integrations.transformers import remove_sequence_parallel as remove

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
