"""Sequence-level quantities under SP, for preference and RL losses (DPO, GRPO).

A sequence's log-probability is a sum over its tokens, and under SP its tokens lie on several
ranks (a packed row's document may span ranks, and a rank may hold parts of several). So the
per-token log-probabilities are computed from each rank's local logits (`token_logprobs`,
tiled over tokens: never the full-vocabulary log-softmax of a long shard at once) and summed per
sequence over the SP group (`sequence_sums`). Like `ulysses_sp.sp_cross_entropy`, each
value is the same on every rank of the group and its gradient reaches only this rank's tokens, so
summing parameter gradients over the group gives the one-process gradient; a per-rank mean in place
of the group's sum is the bug this guards against.

    local = usp.shard_batch(batch, topo)
    logits = model(**usp.model_inputs(local)).logits
    logps, counts = usp.rl.sequence_logprobs(logits, local, topo)   # [sequences], the same on every rank
"""

from __future__ import annotations

import torch

from . import comm
from .data import IGNORE_INDEX, group_mean, shard_sequence
from .layout import document_bounds
from .kernels.common import accumulator_dtype
from .loss import default_chunk_tokens
from .topology import Topology

__all__ = ["token_logprobs", "sequence_ids", "sequence_sums", "sequence_logprobs", "token_mean"]


class _TokenLogprobs(torch.autograd.Function):
    """log p(label) per token, chunk by chunk over the tokens: the forward keeps one logsumexp per
    token, the backward recomputes each chunk's softmax; neither holds more than a chunk's."""

    @staticmethod
    def forward(ctx, logits, labels, chunk: int, ignore_index: int):
        acc = accumulator_dtype(logits.dtype)
        flat, targets = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        valid = targets != ignore_index
        safe = targets.masked_fill(~valid, 0)
        lse = torch.empty(flat.shape[0], dtype=acc, device=logits.device)
        out = torch.empty(flat.shape[0], dtype=acc, device=logits.device)
        for a in range(0, flat.shape[0], chunk):
            part = flat[a:a + chunk].to(acc)
            lse[a:a + chunk] = torch.logsumexp(part, dim=-1)
            out[a:a + chunk] = part.gather(1, safe[a:a + chunk, None])[:, 0] - lse[a:a + chunk]
        ctx.save_for_backward(logits, safe, valid, lse)
        ctx.chunk = chunk
        return out.masked_fill(~valid, 0).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        logits, safe, valid, lse = ctx.saved_tensors
        flat = logits.reshape(-1, logits.shape[-1])
        g = (grad.reshape(-1) * valid).to(lse.dtype)
        out = torch.empty_like(flat)
        for a in range(0, flat.shape[0], ctx.chunk):
            rows = slice(a, a + ctx.chunk)
            part = -torch.exp(flat[rows].to(lse.dtype) - lse[rows, None]) * g[rows, None]  # d/dlogits of -lse
            part.scatter_add_(1, safe[rows, None], g[rows, None])  # + d/dlogits of the label's logit
            out[rows] = part.to(out.dtype)
        return out.view_as(logits), None, None, None


def token_logprobs(logits_local: torch.Tensor, labels_local: torch.Tensor, *, ignore_index: int = IGNORE_INDEX,
                   chunk_tokens: int | None = None) -> torch.Tensor:
    """``log p(label)`` of each local token, tiled so no full-vocabulary log-softmax is made.

    Args:
        logits_local: this rank's logits ``[B, s, vocab]``.
        labels_local: the ``shift_labels`` of `ulysses_sp.shard_batch` (each token's next
            token) ``[B, s]``.
        ignore_index: the label of tokens without a target.
        chunk_tokens: tokens per tile (default: as the tiled loss).

    Returns:
        ``[B, s]`` in the accumulation dtype (fp32 for bf16 logits), 0 where the label is
        ``ignore_index``; differentiable.
    """
    chunk = chunk_tokens or default_chunk_tokens(logits_local.shape[-1])
    return _TokenLogprobs.apply(logits_local, labels_local, chunk, ignore_index)


def sequence_ids(local_batch: dict, topo: Topology) -> tuple[torch.Tensor, int]:
    """The sequence each local token belongs to, and the number of sequences.

    Row ``b``'s documents are sequences ``b * D .. b * D + D - 1`` for a packed batch of ``D``
    documents per row (``cu_seqlens``, the same for every row; the padding is a document of its
    own); row ``b`` is sequence ``b`` otherwise.

    Args:
        local_batch: this rank's batch from `ulysses_sp.shard_batch`.
        topo: the topology.

    Returns:
        The ids ``[B, s]`` and the number of sequences.
    """
    ids = local_batch["input_ids"]
    b, s = ids.shape[0], ids.shape[1] * topo.sp_size
    cu = local_batch.get("cu_seqlens")
    bounds = document_bounds(cu, s)
    per_row = len(bounds) - 1
    lengths = torch.tensor([hi - lo for lo, hi in zip(bounds, bounds[1:])])
    whole = torch.arange(b)[:, None] * per_row + torch.repeat_interleave(torch.arange(per_row), lengths)[None]
    local = shard_sequence(whole, topo, dim=1, cu_seqlens=None if cu is None else list(bounds))
    return local.to(ids.device), b * per_row


def sequence_sums(values_local: torch.Tensor, ids_local: torch.Tensor, num_sequences: int, topo: Topology) -> torch.Tensor:
    """Each sequence's sum of per-token values over the whole SP group (one all-reduce).

    Args:
        values_local: this rank's per-token values ``[B, s]``.
        ids_local: the sequence of each token (`sequence_ids`).
        num_sequences: the number of sequences.
        topo: the topology.

    Returns:
        ``[num_sequences]``, the same on every rank; differentiable, its gradient reaching this
        rank's values only.
    """
    local = values_local.new_zeros(num_sequences).index_add(0, ids_local.reshape(-1), values_local.reshape(-1))
    total = comm.all_reduce_sum(local.detach(), topo.sp_group) if topo.sp_size > 1 else local.detach()
    return local + (total - local.detach())


def sequence_logprobs(logits_local: torch.Tensor, local_batch: dict, topo: Topology, *, ignore_index: int = IGNORE_INDEX,
                      chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's summed log-probability of its targets over the SP group, and its target count.

    Divide one by the other for a length-normalised (IPO-style) log-probability.

    Args:
        logits_local: this rank's logits ``[B, s, vocab]``.
        local_batch: this rank's batch from `ulysses_sp.shard_batch`.
        topo: the topology.
        ignore_index: the label of tokens without a target.
        chunk_tokens: tokens per tile of the log-softmax (default: as the tiled loss).

    Returns:
        Both ``[sequences]`` (`sequence_ids`), the same on every rank of the SP group; the
        first is differentiable.
    """
    labels = local_batch["shift_labels"]
    logps = token_logprobs(logits_local, labels, ignore_index=ignore_index, chunk_tokens=chunk_tokens)
    ids, n = sequence_ids(local_batch, topo)
    counts = sequence_sums((labels != ignore_index).to(logps.dtype), ids, n, topo).detach()
    return sequence_sums(logps, ids, n, topo), counts


def token_mean(values_local: torch.Tensor, mask_local: torch.Tensor, topo: Topology, *, count_group=None,
               count: float | None = None) -> torch.Tensor:
    """The mean of per-token values over the masked tokens of the whole SP group.

    Args:
        values_local: this rank's per-token values ``[B, s]``.
        mask_local: which tokens count ``[B, s]``.
        topo: the topology.
        count_group (ProcessGroup | None): a wider group to count over (e.g. the world, for a mean over DP too).
        count: divide the sum by this instead (the tokens of every micro-batch of an accumulation
            window, counted beforehand with `ulysses_sp.data.target_counts`, as TRL's DAPO
            loss does).

    Returns:
        A scalar, the same on every rank; its gradient reaches this rank's values only
        (`ulysses_sp.data.group_mean`).
    """
    mask = mask_local.to(values_local.dtype)
    return group_mean((values_local * mask).sum(), mask.sum(), topo.sp_group if count_group is None else count_group, total_count=count)
