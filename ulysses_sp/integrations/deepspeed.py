"""DeepSpeed: the ``mpu`` for ``deepspeed.initialize``, the loss scale that makes ZeRO's
gradient reduction exact, and a drop-in ``DistributedAttention``.

ZeRO reduces gradients over every rank (DP x SP) but scales them differently per
stage (measured with deepspeed 0.19.8, see ``gradient_scale``). ``sp_cross_entropy(..., count_group=WORLD)`` makes each rank's
loss its tokens' share of the global batch's token-weighted mean, so the exact
gradient is the plain **sum** over all ranks; multiplying the loss by
``gradient_scale(engine, topo)`` undoes whatever averaging the engine applies.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .. import comm
from ..topology import Topology, destroy_gloo_groups_at_exit

if TYPE_CHECKING:
    import deepspeed

__all__ = ["SequenceParallelMPU", "gradient_scale", "DistributedAttention", "use_cpu_accelerator_if_needed"]


def use_cpu_accelerator_if_needed() -> None:
    """Without CUDA, make DeepSpeed use its CPU accelerator and skip building its shared-memory op.

    Call before DeepSpeed starts its communication; DeepSpeed then falls back to gloo. Its CPU
    communication backend would otherwise compile a shared-memory all-reduce with g++ on first
    use (tens of seconds, again for every new install path) under a lock file in
    ``~/.cache/torch_extensions`` that a rank killed mid-build leaves behind, and every later
    DeepSpeed start on the machine then waits on it forever. Only DeepSpeed's inference
    all-reduce uses that op, so training loses nothing. With CUDA it does nothing.
    """
    if torch.cuda.is_available():
        return
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # the dict DeepSpeed reads (it persists edits)


class SequenceParallelMPU:
    """The model-parallel unit (``mpu``) that ``deepspeed.initialize`` takes, built from a topology.

    Model (tensor) parallelism is 1: each rank its own group. The sequence-parallel group is the
    topology's. What DeepSpeed calls the data-parallel group, over which ZeRO shards and reduces,
    and the sequence-data-parallel group are every rank (DP x SP): the ranks of an SP group hold
    different tokens of the same samples. Samplers use ``topo.dp_rank`` and ``topo.dp_size``.
    Use it with `gradient_scale` and ``sp_cross_entropy(..., count_group=WORLD)``.

    Args:
        topo: The topology from `init_sequence_parallel`. Construct on every rank: it creates one
            single-rank group per rank, collectively.
    """

    def __init__(self, topo: Topology):
        self.topo = topo
        self._model_group = None
        for r in range(topo.world_size):
            group = dist.new_group([r], timeout=topo.timeout)
            if r == topo.rank:
                self._model_group = group

    # model (tensor) parallel: none
    def get_model_parallel_group(self):
        return self._model_group

    def get_model_parallel_rank(self) -> int:
        return 0

    def get_model_parallel_world_size(self) -> int:
        return 1

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.topo.rank

    # "data parallel" as DeepSpeed means it: the ranks ZeRO shards over. ZeRO-3 reduces
    # gradients over this group, so it must hold every rank (DP x SP), as DeepSpeed's own SP
    # mpu does; with only the topology's DP group, ZeRO-3 never summed over the SP ranks
    # (each rank kept its own partial gradient). Samplers use topo.dp_rank / topo.dp_size.
    def get_data_parallel_group(self):
        return dist.group.WORLD

    def get_data_parallel_rank(self) -> int:
        return self.topo.rank

    def get_data_parallel_world_size(self) -> int:
        return self.topo.world_size

    def get_data_parallel_group_ranks(self) -> list[int]:
        return list(range(self.topo.world_size))

    # sequence parallel: ranks that share one sequence
    def get_sequence_parallel_group(self):
        return self.topo.sp_group

    def get_sequence_parallel_rank(self) -> int:
        return self.topo.sp_rank

    def get_sequence_parallel_world_size(self) -> int:
        return self.topo.sp_size

    # sequence x data parallel: what ZeRO reduces and shards over
    def get_sequence_data_parallel_group(self):
        return dist.group.WORLD

    def get_sequence_data_parallel_rank(self) -> int:
        return self.topo.rank

    def get_sequence_data_parallel_world_size(self) -> int:
        return self.topo.world_size


def gradient_scale(engine: deepspeed.DeepSpeedEngine, topo: Topology) -> float:
    """The factor for the loss so that the gradient DeepSpeed applies is the plain sum over ranks.

    With ``sp_cross_entropy(..., count_group=WORLD)`` each rank's loss is its tokens' share of the
    global batch's token-weighted mean, so the exact gradient is the sum over every rank. Measured
    on deepspeed 0.19.8 with `SequenceParallelMPU` (``tests/test_deepspeed.py`` checks it): ZeRO 0,
    1 and 2 (reduce-scatter on or off) and ZeRO 3 without reduce-scatter sum the gradient over the
    SP ranks and average it over the DP groups; ZeRO 3 with reduce-scatter (its default) averages
    over every rank.

    Args:
        engine: The engine ``deepspeed.initialize`` returned (with ``mpu=SequenceParallelMPU(topo)``).
        topo: The topology from `init_sequence_parallel`.

    Returns:
        ``dp_size x sp_size`` for ZeRO 3 with reduce-scatter, else ``dp_size``.
    """
    if engine.zero_optimization_stage() == 3 and engine.zero_reduce_scatter():
        return float(topo.dp_size * topo.sp_size)
    return float(topo.dp_size)


class DistributedAttention(nn.Module):
    """Drop-in for ``deepspeed.sequence.layer.DistributedAttention`` on ulysses-sp's fused all-to-all.

    Change the import, keep the call: ``attn(query, key, value, batch_dim_idx)`` takes this
    rank's contiguous sequence shards and ``local_attention(q, k, v, *args, **kwargs)`` sees whole
    sequences and ``heads / P`` heads, in the same layout. The query heads must divide by P; KV
    heads may instead divide P (they are then replicated as little as needed).

    Args:
        local_attention: The attention over whole sequences, called with ``heads / P`` heads.
        sequence_process_group: The SP group (``topo.sp_group``).
        scatter_idx: The head dimension; only 2 (``[s, b, h, d]`` or ``[b, s, h, d]``).
        gather_idx: Accepted for DeepSpeed's signature; the layout comes from ``batch_dim_idx``.
        sp_stream: Accepted for DeepSpeed's signature; unused.
        num_kv_heads: Accepted for DeepSpeed's signature; read from ``key`` instead.

    Raises:
        ValueError: A ``scatter_idx`` other than 2.
    """

    def __init__(self, local_attention: Callable[..., torch.Tensor], sequence_process_group: dist.ProcessGroup, scatter_idx: int = 2,
                 gather_idx: int = 0, sp_stream: Any = None, num_kv_heads: int | None = None):
        super().__init__()
        if scatter_idx != 2:
            raise ValueError(f"DistributedAttention scatters heads (scatter_idx=2), got scatter_idx={scatter_idx}")
        self.local_attn, self.spg = local_attention, sequence_process_group
        if "gloo" in str(dist.get_backend(sequence_process_group)).lower():
            destroy_gloo_groups_at_exit()
        self.gather_idx = gather_idx

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, batch_dim_idx: int, rotary_pos_emb: None = None,
                *args: Any, **kwargs: Any) -> torch.Tensor:
        """Attention of this rank's shards over the whole sequence.

        Args:
            query: This rank's queries, ``[s, b, h, d]`` or ``[b, s, h, d]``.
            key: This rank's keys, the same layout.
            value: This rank's values, the same layout.
            batch_dim_idx: 0 for ``[b, s, h, d]``, 1 for ``[s, b, h, d]``.
            rotary_pos_emb: Not supported: apply rotary embeddings with global positions before.
            *args: Passed on to ``local_attention``.
            **kwargs: Passed on to ``local_attention``.

        Returns:
            This rank's output shard, in the inputs' layout.

        Raises:
            ValueError: Another ``batch_dim_idx``, ``rotary_pos_emb`` given, or heads that do not
                split over the group.
        """
        if batch_dim_idx not in (0, 1):
            raise ValueError(f"batch_dim_idx must be 0 ([b, s, h, d]) or 1 ([s, b, h, d]), got {batch_dim_idx}")
        if rotary_pos_emb is not None:
            raise ValueError("rotary_pos_emb is not supported: apply rotary embeddings with global positions before the call")
        p = comm.group_size(self.spg)
        problem = comm.head_scatter_problem(query.shape[2], key.shape[2], p)
        if problem:
            raise ValueError(f"DistributedAttention: {problem}")

        def to_bshd(t):
            return t if batch_dim_idx == 0 else t.transpose(0, 1)

        k, v = comm.replicate_kv_for_scatter(to_bshd(key), to_bshd(value), p)
        table = [[r] for r in range(p)]
        q_h, k_h, v_h = comm.seq_to_heads([to_bshd(query), k, v], self.spg, table)
        context = to_bshd(self.local_attn(*(to_bshd(t) for t in (q_h, k_h, v_h)), *args, **kwargs))
        (out,) = comm.heads_to_seq([context], self.spg, table)
        return to_bshd(out)
