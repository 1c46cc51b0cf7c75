"""The data side of SP: cutting sequences and batches into this rank's shard,
feeding every rank of an SP group the same samples, and the loss over the group.

``shard_sequence`` / ``gather_sequence`` follow ``topo.layout``. ``shard_batch``
prepares a causal-LM batch (padding, labels shifted before sharding, global
position ids, document boundaries of packed input). ``sp_cross_entropy`` is the
token-weighted mean over the whole SP group. ``SequenceParallelSampler`` hands
one SP group's ranks the same samples and different DP groups different ones.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F
from torch.utils.data import DistributedSampler

from . import comm
from . import layout as _layout
from .kernels import accumulator_dtype
from .topology import Topology

__all__ = [
    "shard_sequence",
    "gather_sequence",
    "cu_seqlens_from_position_ids",
    "shard_batch",
    "sp_cross_entropy",
    "model_inputs",
    "target_counts",
    "SequenceParallelSampler",
    "IGNORE_INDEX",
]

IGNORE_INDEX = -100
_OTHER_INPUTS = re.compile(r"^pixel_|^image_|^video_|^input_features(_mask)?$|^feature_attention_mask$|^audio_")
"""Batch keys of images, videos and audio clips: ``pixel_values``, ``pixel_attention_mask``, ``image_grid_thw``, ``pixel_values_videos``,
``input_features``, ..."""


def shard_sequence(x: torch.Tensor, topo: Topology, dim: int = 1, cu_seqlens: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """This rank's shard of the full tensor ``x`` along ``dim``, in ``topo.layout``.

    Local slicing, no communication; differentiable.

    Args:
        x: The whole tensor, the same on every rank of the SP group.
        topo: The topology from `init_sequence_parallel`.
        dim: The sequence dimension.
        cu_seqlens: Global document boundaries ``[0, ..., S]``; needed by the ``balanced``
            layout, which places tokens by document (`shard_batch` returns them).

    Returns:
        The tokens this rank holds, ``x.shape[dim] / sp_size`` of them along ``dim``.

    Raises:
        ValueError: A length along ``dim`` that does not divide by ``sp_size`` (``2 * sp_size``
            for ``zigzag`` and ``balanced``: pad with `pad_to_multiple` first), or ``balanced``
            without ``cu_seqlens``.
    """
    return _layout.shard(x, topo.layout, topo.sp_size, topo.sp_rank, dim, cu_seqlens)


def gather_sequence(x_local: torch.Tensor, topo: Topology, dim: int = 1, cu_seqlens: torch.Tensor | list[int] | None = None) -> torch.Tensor:
    """Inverse of `shard_sequence`: the full tensor in global token order, on every rank.

    Differentiable; the backward sums the gradients of every rank's use of the result and
    returns this rank's shard of the sum (a reduce-scatter), i.e. the gradient of the sum of the
    ranks' losses.

    Args:
        x_local: This rank's shard.
        topo: The topology from `init_sequence_parallel`.
        dim: The sequence dimension.
        cu_seqlens: The global document boundaries the tensor was sharded with (``balanced``).

    Returns:
        The whole tensor, ``sp_size`` times longer along ``dim``.

    Raises:
        ValueError: A shard length the layout cannot hold, or ``balanced`` without ``cu_seqlens``.
    """
    dim = dim % x_local.dim()
    seq_len = x_local.shape[dim] * topo.sp_size
    _layout.check_seq_len(seq_len, topo.layout, topo.sp_size)
    held = [_layout.positions(topo.layout, seq_len, topo.sp_size, r, cu_seqlens) for r in range(topo.sp_size)]  # before any collective
    full = comm.all_gather(x_local, topo.sp_group, dim)
    if topo.layout == "contiguous":
        return full
    return full.index_select(dim, torch.argsort(torch.cat(held)).to(full.device))


def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document boundaries of a packed sequence whose position ids restart at 0 at each document.

    The Hugging Face convention for packed rows (``DataCollatorWithFlattening``).

    Args:
        position_ids: ``[S]`` or ``[B, S]``; every row of a batch must be packed the same way,
            since one ``cu_seqlens`` serves the whole batch.

    Returns:
        ``[0, ..., S]`` (int32): where each document starts, then the length.

    Raises:
        ValueError: Rows packed differently, or positions that do not start at 0.
    """
    pos = position_ids
    if pos.dim() == 2:
        if pos.shape[0] > 1 and not bool((pos == pos[:1]).all()):
            raise ValueError(
                "position_ids differ between the rows of the batch; one cu_seqlens serves the whole batch, "
                "so pack each row the same way or use batch size 1 for packed sequences"
            )
        pos = pos[0]
    if pos.dim() != 1 or pos.numel() == 0 or int(pos[0]) != 0:
        raise ValueError(f"position_ids must be [S] or [B, S] starting at 0, got shape {tuple(position_ids.shape)}")
    starts = torch.nonzero(pos == 0).flatten()
    return torch.cat([starts, starts.new_tensor([pos.numel()])]).to(torch.int32)


def _check_right_padding(attention_mask: torch.Tensor) -> None:
    if bool((attention_mask[:, 1:] > attention_mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding before real tokens (left or middle padding); ulysses_sp supports "
            "right padding or packed sequences (position_ids restarting at 0): pad on the right"
        )


def shard_batch(batch: dict, topo: Topology, *, pad_token_id: int = 0) -> dict:
    """This rank's part of a causal-LM batch, in ``topo.layout``.

    Labels are shifted by one **before** sharding, so the last token of each shard keeps its
    target; padding, the last token and, in packed input, the last token of each document get
    -100. The sequence is padded at the end to what the layout needs (ids with
    ``pad_token_id``, labels with -100, mask with 0; packed input gets the padding as one more
    document). A rank may end up with padding only: `sp_cross_entropy` handles it.

    Args:
        batch: ``input_ids`` ``[B, S]`` and optionally ``labels``, ``position_ids`` (restarting
            at 0 at each document for packed input) and ``attention_mask`` (1 for tokens, 0 for
            right padding). Images, videos and audio clips (``pixel_values``, ``image_grid_thw``,
            ``input_features``, ...) pass through whole.
        topo: The topology from `init_sequence_parallel`.
        pad_token_id: The id the sequence is padded with.

    Returns:
        The local ``input_ids`` and ``position_ids`` (global positions, so rotary embeddings are
            right on every rank); ``attention_mask`` if given; ``shift_labels`` if labels are
            given; ``cu_seqlens`` (global, the same on every rank) for packed input and always
            under ``balanced``, whose placement they carry (pass them to `gather_sequence`); and,
            for a batch with images or videos, ``multimodal``: what `model_inputs` hands an
            image-text model whole (`ulysses_sp.models.image_text`).

    Raises:
        ValueError: ``input_ids`` that is not 2-D, or an ``attention_mask`` with padding before
            real tokens (pad on the right), or rows of a packed batch packed differently.
    """
    input_ids = batch["input_ids"]
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
    b, s = input_ids.shape
    extra = -s % _layout.required_multiple(topo.layout, topo.sp_size)

    def pad(x, value):
        return F.pad(x, (0, extra), value=value) if extra else x

    out = {"input_ids": pad(input_ids, pad_token_id)}
    mask = batch.get("attention_mask")
    if mask is not None:
        _check_right_padding(mask)
        out["attention_mask"] = pad(mask, 0)
    position_ids = batch.get("position_ids")
    packed = position_ids is not None and bool((position_ids[..., 1:] == 0).any())
    if batch.get("labels") is not None:
        shifted = F.pad(batch["labels"][:, 1:], (0, 1), value=IGNORE_INDEX)
        if mask is not None:  # a padding token is nobody's target
            shifted = shifted.masked_fill(F.pad(mask[:, 1:], (0, 1), value=0) == 0, IGNORE_INDEX)
        if packed:  # nor is a document's first token the previous document's
            shifted = shifted.masked_fill(F.pad(position_ids[..., 1:] == 0, (0, 1), value=False).expand_as(shifted), IGNORE_INDEX)
        out["shift_labels"] = pad(shifted, IGNORE_INDEX)
    if position_ids is None:
        position_ids = torch.arange(s, device=input_ids.device).expand(b, s)
    position_ids = position_ids.expand(b, s)
    tail = torch.arange(extra, device=input_ids.device) + (0 if packed else s)
    out["position_ids"] = torch.cat([position_ids, tail.expand(b, extra).to(position_ids.dtype)], dim=1)
    cu_seqlens = cu_seqlens_from_position_ids(out["position_ids"]) if packed else None
    if cu_seqlens is None and topo.layout == "balanced":  # the placement reads the documents: here, one
        cu_seqlens = torch.tensor([0, s + extra], dtype=torch.int32, device=input_ids.device)
    sharded = {k: shard_sequence(v, topo, cu_seqlens=None if cu_seqlens is None else cu_seqlens.tolist()) for k, v in out.items()}
    if cu_seqlens is not None:
        sharded["cu_seqlens"] = cu_seqlens
    if any(_OTHER_INPUTS.search(k) for k in batch):
        sharded["multimodal"] = _multimodal_inputs(batch, out["input_ids"], pad)
    return sharded


def _multimodal_inputs(batch: dict, input_ids: torch.Tensor, pad) -> dict:
    """What an image- or video-text model switched by ``apply_sequence_parallel`` takes whole: the padded
    token ids, the images and videos (and their grids) as they are, and the other ``[B, S]`` inputs
    (``mm_token_type_ids``, ...) padded with 0. Labels, positions and masks are ulysses_sp's."""
    inputs = {"input_ids": input_ids}
    for key, value in batch.items():
        if key in ("input_ids", "labels", "position_ids", "attention_mask") or value is None:
            continue
        if _OTHER_INPUTS.search(key):
            inputs[key] = value
        elif isinstance(value, torch.Tensor) and value.shape == batch["input_ids"].shape:
            inputs[key] = pad(value, 0)
    return inputs


def sp_cross_entropy(
    logits_local: torch.Tensor, shift_labels_local: torch.Tensor, topo: Topology, *, ignore_index: int = IGNORE_INDEX,
    count_group: torch.distributed.ProcessGroup | None = None,
) -> torch.Tensor:
    """Token-weighted mean cross-entropy over the whole SP group.

    The value, the same on every rank of the group, is the sum of every rank's token losses
    divided by the group's number of valid targets: exactly the loss of the unsharded sequence.
    Its gradient reaches only this rank's logits and equals the unsharded loss's gradient for
    them, so summing parameter gradients over the SP group gives the one-process gradient. One
    all-reduce of two numbers. A rank with no valid target contributes zero; a group with none
    returns 0.

    With data parallelism on top, averaging the SP groups' results over the DP groups gives the
    mean of their losses (each group weighted equally, not by its token count); with
    ``count_group=torch.distributed.group.WORLD`` the value is the token-weighted mean of the
    whole global batch and the exact gradient is the plain sum over every rank (what the
    DeepSpeed integration uses, with ``gradient_scale`` undoing the engine's averaging).

    Args:
        logits_local: This rank's logits, ``[..., V]``.
        shift_labels_local: This rank's ``shift_labels`` from `shard_batch`, ``logits_local.shape[:-1]``.
        topo: The topology from `init_sequence_parallel`.
        ignore_index: The label of tokens without a target.
        count_group: The group whose valid targets
            normalise the loss (default: the SP group).

    Returns:
        The loss, a scalar in float32 (float64 for float64 logits).
    """
    acc = accumulator_dtype(logits_local.dtype)
    summed = F.cross_entropy(
        logits_local.reshape(-1, logits_local.shape[-1]).to(acc), shift_labels_local.reshape(-1), ignore_index=ignore_index, reduction="sum"
    )
    return group_mean(summed, (shift_labels_local != ignore_index).sum(), topo.sp_group if count_group is None else count_group)


def group_mean(summed: torch.Tensor, count: torch.Tensor, group, *, total_count: float | None = None) -> torch.Tensor:
    """``summed`` (this rank's sum) summed over ``group`` and divided by ``count`` summed over it (at
    least 1), or by ``total_count`` when given: the same on every rank, its gradient reaching this
    rank's ``summed`` only. One all-reduce of two numbers."""
    totals = comm.all_reduce_sum(torch.stack([summed.detach().double(), count.double()]), group)
    n = (totals[1].clamp(min=1) if total_count is None else totals.new_tensor(float(total_count))).to(summed.dtype)
    local = summed / n
    return local + (totals[0].to(summed.dtype) / n - local.detach())


def model_inputs(local_batch: dict) -> dict:
    """The keyword arguments of a model switched by `apply_sequence_parallel`, for a `shard_batch` result.

    Args:
        local_batch: What `shard_batch` returned.

    Returns:
        ``input_ids`` and global ``position_ids`` and, for packed input, the document boundaries
            as ``cu_seq_lens_q``. For a batch with images or videos: the whole token ids and the
            images (the model splits the sequence at its text decoder, where it numbers the
            positions) and the boundaries.
    """
    if "multimodal" in local_batch:
        inputs = dict(local_batch["multimodal"])
    else:
        inputs = {"input_ids": local_batch["input_ids"], "position_ids": local_batch.get("position_ids")}
    if local_batch.get("cu_seqlens") is not None:
        inputs["cu_seq_lens_q"] = local_batch["cu_seqlens"]
    return inputs


def target_counts(local_batches: list[dict], group: torch.distributed.ProcessGroup | None, device: torch.device | str) -> torch.Tensor:
    """Valid targets of each `shard_batch` result, summed over ``group``, in one all-reduce.

    With ``group=torch.distributed.group.WORLD``: each micro-batch's count over the global batch,
    the weights of an exact token-weighted loss over accumulation steps and DP groups.

    Args:
        local_batches: `shard_batch` results, each with ``shift_labels``.
        group: The ranks to sum over (None: the world).
        device: Where the counts are reduced (the process group backend's device).

    Returns:
        One count per batch, float64, the same on every rank of ``group``.
    """
    counts = torch.stack([(b["shift_labels"] != IGNORE_INDEX).sum() for b in local_batches]).to(device=device, dtype=torch.float64)
    return comm.all_reduce_sum(counts, group)


class SequenceParallelSampler(DistributedSampler):
    """A ``DistributedSampler`` over data-parallel groups rather than ranks.

    Every rank of one SP group gets the same indices (they share each sample's sequence);
    different DP groups get disjoint ones. ``set_epoch`` behaves as in ``DistributedSampler``.
    Needs no process group of its own: the topology says where this rank stands.

    Args:
        dataset: A map-style dataset (with ``__len__``).
        topo: The topology from `init_sequence_parallel`.
        shuffle: Shuffle the indices, differently each epoch (``set_epoch``).
        seed: The seed of the shuffle, the same on every rank.
        drop_last: Drop the tail that does not split evenly over the DP groups; with False the
            dataset is padded by repeating indices so every DP group gets as many samples.
    """

    def __init__(self, dataset: torch.utils.data.Dataset, topo: Topology, *, shuffle: bool = True, seed: int = 0, drop_last: bool = False):
        super().__init__(dataset, num_replicas=topo.dp_size, rank=topo.dp_rank, shuffle=shuffle, seed=seed, drop_last=drop_last)
