"""FSDP2 (``torch.distributed.fsdp.fully_shard``) with sequence parallelism.

Parameters are sharded over every rank of the topology, DP x SP, as torchtitan's
``dp_shard_cp`` does: the ranks of an SP group hold different tokens of the same samples, so
they are data-parallel for the parameters. What SP changes is the gradient's scale. Each rank's
loss covers only its tokens, so the exact gradient sums over the SP ranks: FSDP2's reduce-scatter
divides by ``gradient_divide_factor`` instead of by the world size.

- Loss ``sp_cross_entropy(..., topo)`` (each SP group's token mean, the default): the DP groups'
  losses are averaged, so the factor is the DP size (the default here).
- Loss normalised over the whole global batch (``count_group=torch.distributed.group.WORLD``,
  what the job and the Trainer use): the exact gradient is the plain sum; pass 1.

``causal_lm_loss`` (the tiled loss) runs through the root module's forward, so FSDP2 gathers the
embeddings and the LM head around it as it does for ``model(...)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from ..topology import Topology

__all__ = ["device_mesh", "apply_fsdp2"]


def device_mesh(topo: Topology) -> DeviceMesh:
    """The 2-D ``DeviceMesh`` ("dp", "sp") over the topology's own process groups.

    Rank = ``dp_rank x sp_size + sp_rank``; `apply_fsdp2` shards over its flattened form, "dp_sp".

    Args:
        topo: The topology from `init_sequence_parallel`.

    Returns:
        The mesh, on the topology's device type.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialised.
        ValueError: A topology that does not cover the world, or one without process groups
            (``Topology.for_planning``).
    """
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_initialized():
        raise RuntimeError("device_mesh needs torch.distributed initialised (init_sequence_parallel first)")
    world = dist.get_world_size()
    if topo.dp_size * topo.sp_size != world:
        raise ValueError(f"the topology covers dp {topo.dp_size} x sp {topo.sp_size} ranks, the world has {world}")
    if topo.dp_group is None or topo.sp_group is None:
        raise ValueError("device_mesh needs a topology with process groups (init_sequence_parallel), not a planning one")
    layout = torch.arange(world).view(topo.dp_size, topo.sp_size)
    return DeviceMesh.from_group([topo.dp_group, topo.sp_group], topo.device.type, mesh=layout, mesh_dim_names=("dp", "sp"))


def apply_fsdp2(model: torch.nn.Module, topo: Topology, *, mesh: DeviceMesh | None = None, layers: Iterable[torch.nn.Module] | None = None,
                gradient_divide_factor: float | None = None, **fully_shard_kwargs: Any) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 over the DP x SP ranks, with the gradient scale SP needs.

    Each decoder layer is one ``fully_shard`` unit; the rest (embeddings, final norm, LM head)
    is the root's. Call it after `apply_sequence_parallel` and before building the optimizer.

    Args:
        model: A model switched by `apply_sequence_parallel`.
        topo: The topology from `init_sequence_parallel`.
        mesh: The mesh to shard over (default: `device_mesh`, flattened); a 1-D mesh is used as
            it is.
        layers: The units to shard (default: ``ulysses_sp.decoder_layers.decoder_layers(model)``).
        gradient_divide_factor: What the summed gradient is divided by (default: the DP size,
            right for ``sp_cross_entropy(..., topo)``; 1 for a loss normalised over the whole
            global batch, ``count_group=WORLD``).
        **fully_shard_kwargs: Passed to ``fully_shard`` (``mp_policy``,
            ``reshard_after_forward``, ``offload_policy``...).

    Returns:
        ``model``, sharded.

    Raises:
        ValueError: A ``gradient_divide_factor`` that is not positive, or no layers to shard.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from ..decoder_layers import decoder_layers

    factor = float(topo.dp_size if gradient_divide_factor is None else gradient_divide_factor)
    if factor <= 0:
        raise ValueError(f"gradient_divide_factor must be > 0, got {factor}")
    units = list(decoder_layers(model) if layers is None else layers)
    if not units:
        raise ValueError(f"apply_fsdp2: no decoder layers found in {type(model).__name__}; pass layers=[...]")
    mesh = device_mesh(topo) if mesh is None else mesh
    shard_mesh = mesh if mesh.ndim == 1 else mesh._flatten("dp_sp")  # a user's 1-D mesh as it is
    for layer in units:
        fully_shard(layer, mesh=shard_mesh, **fully_shard_kwargs)
    fully_shard(model, mesh=shard_mesh, **fully_shard_kwargs)
    gloo = dist.get_backend(shard_mesh.get_group()) == "gloo"
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(factor)
            if gloo:  # gloo has no pre-multiplied sum: a plain sum, then the division
                module.set_force_sum_reduction_for_comms(True)
    return model
