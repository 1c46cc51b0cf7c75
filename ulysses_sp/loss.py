"""The LM head and the loss fused over tiles of tokens: no ``[tokens, vocab]`` logits tensor.

``sp_linear_cross_entropy(hidden, weight, shift_labels, topo)`` has the value and the
gradients (w.r.t. ``hidden``, ``weight`` and ``bias``) of
``sp_cross_entropy(hidden @ weight.T + bias, shift_labels, topo)``: the token-weighted mean
over the SP group (or ``count_group``), whose gradient reaches only this rank's tokens.

How: the number of valid targets of the group is all-reduced first (it depends on the
labels only), so ``1 / count`` is known before any logits exist. Then, one tile of
``chunk_tokens`` tokens at a time, the forward computes the tile's logits (in the
weights' dtype, then fp32), its loss sum, ``(softmax - onehot) / count`` in place of the
logits, and from that the tile's rows of ``grad_hidden`` and its share of ``grad_weight``
(accumulated in fp32) and ``grad_bias``. The tile is dropped before the next one. The
loss sum is all-reduced (one number) and ``sum / count`` returned. Backward does no
matmul: it returns the stored gradients times ``grad_output``. So the loss layer costs
three matmuls (as an unfused forward + backward), all in the forward, and never more
than one tile of logits.

Memory, beyond the inputs: one fp32 tile ``[chunk_tokens, vocab]`` (plus its copy in the
weights' dtype when that is bf16/fp16, for the two gradient matmuls); ``grad_hidden``
(the size of ``hidden``) and ``grad_weight`` in fp32 (the size of ``weight`` in fp32),
held from forward to backward; with bf16 weights also a transient bf16 weight-sized
product per tile. The default ``chunk_tokens`` is ``max(1, 2**26 // vocab)``: a tile
of at most 64 Mi fp32 elements, 256 MiB (512 tokens at a 128k vocabulary). Recomputing
in backward instead would drop the stored ``grad_weight`` but cost a fourth matmul per
tile; the stored gradient is one weight-sized fp32 buffer, small beside the activations
of a long sequence, so the forward computes it.

``causal_lm_loss(model, local_batch, topo)`` runs a Hugging Face causal LM (switched with
``apply_sequence_parallel``) up to its last hidden state and then this loss through the
model's ``lm_head`` module. A model that transforms its logits after the head (Gemma 2's
``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...)
is refused with a ``ValueError`` naming the setting.

DeepSpeed ZeRO-3: the head's weight is a partitioned (empty) parameter outside its module's
forward. ``causal_lm_loss`` therefore calls the ``lm_head`` *module* with its ``forward``
temporarily replaced by the fused loss (an instance attribute, removed afterwards), so
ZeRO-3's pre-forward hook gathers the weight for the tiles and its post-forward hook
releases it; the loss is the module's output, so ZeRO-3's backward hooks gather the
weight again before the fused backward returns the full-shape ``grad_weight``, which then
goes through ZeRO's usual gradient hooks (reduce, partition). Given a DeepSpeed engine (or
any wrapper with ``.module``) instead of the model, the whole forward is routed through
the wrapper's call the same way (the model's ``forward`` temporarily replaced), so the
engine's forward bookkeeping and output hooks run as for ``engine(**batch)``; use the
loss with ``engine.backward`` and ``gradient_scale`` as usual. A model sharded with FSDP2
(``ulysses_sp.integrations.fsdp.apply_fsdp2``) is its own wrapper the same way: the root's
hooks gather the embeddings and the head around the loss. A weight tied to the
input embeddings is the same parameter: its two gradients add up through autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import comm
from .data import IGNORE_INDEX, model_inputs
from .kernels.common import accumulator_dtype
from .topology import Topology

__all__ = ["sp_linear_cross_entropy", "causal_lm_loss", "default_chunk_tokens", "TILE_ELEMENTS"]

TILE_ELEMENTS = 2**26
"""Logits per tile by default: 64 Mi fp32 elements, 256 MiB."""

SPLIT_AT_DECODER = "_ulysses_sp_image_text"
"""The key in an image-text model's ``__dict__`` while `ulysses_sp.models.image_text` splits it at
its text decoder: the fused loss then runs the inner model (which merges the images) and its head."""

LOGIT_TRANSFORMS = (
    "final_logit_softcapping",  # Gemma 2/3: cap * tanh(logits / cap)
    "logit_scale",  # Cohere: logits * scale
    "logits_scaling",  # Granite: logits / scaling
    "output_multiplier",
    "logits_mup_width_multiplier",
    "output_logit_soft_cap",
    "logits_soft_cap",
)
"""Config settings with which a model changes its logits after the LM head."""


def default_chunk_tokens(vocab: int) -> int:
    """Tokens per tile so that a tile's fp32 logits hold at most ``TILE_ELEMENTS`` (256 MiB)."""
    return max(1, TILE_ELEMENTS // max(1, vocab))


class _LinearCrossEntropy(torch.autograd.Function):
    """hidden ``[T, H]``, weight ``[V, H]``, bias ``[V]`` or None, labels ``[T]`` -> the group's mean loss."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, inv_count, chunk, ignore_index, group, needs):
        acc = accumulator_dtype(hidden.dtype)
        need_h, need_w, need_b = needs
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if need_b else None
        loss_sum = torch.zeros((), dtype=acc, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk):
            h, y = hidden[start : start + chunk], labels[start : start + chunk]
            logits = F.linear(h, weight, bias).to(acc)  # the tile, [t, V] fp32
            valid = y != ignore_index
            y_safe = torch.where(valid, y, torch.zeros_like(y))
            lse = torch.logsumexp(logits, dim=-1)
            target = logits.gather(1, y_safe[:, None]).squeeze(1)
            loss_sum += torch.where(valid, lse - target, torch.zeros_like(lse)).sum()
            if not (need_h or need_w or need_b):
                continue
            dlogits = logits.sub_(lse[:, None]).exp_()  # softmax, in place of the logits
            rows = torch.arange(y.shape[0], device=y.device)
            dlogits[rows, y_safe] -= valid.to(acc)
            dlogits.mul_((valid.to(acc) * inv_count)[:, None])  # no-target rows contribute 0
            if need_b:
                grad_b += dlogits.sum(0)
            d = dlogits.to(weight.dtype)
            if need_h:
                torch.mm(d, weight, out=grad_h[start : start + chunk])
            if need_w:
                if d.dtype == acc:
                    grad_w.addmm_(d.t(), h)
                else:
                    grad_w += d.t() @ h
            del logits, dlogits, d
        total = comm.all_reduce_sum(loss_sum.detach().double().reshape(1), group)[0]
        ctx.grads = (grad_h, grad_w, grad_b)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return (total * inv_count).to(acc)

    @staticmethod
    def backward(ctx, grad_out):
        out = []
        for g, dtype in zip(ctx.grads, ctx.dtypes):
            if g is None:
                out.append(None)
                continue
            out.append(g.mul_(grad_out.to(g.dtype)).to(dtype))  # in place: the stored gradients are ours; no host sync
        ctx.grads = None
        return (*out, None, None, None, None, None, None)


def sp_linear_cross_entropy(
    hidden_local: torch.Tensor,
    weight: torch.Tensor,
    shift_labels_local: torch.Tensor,
    topo: Topology,
    *,
    bias: torch.Tensor | None = None,
    chunk_tokens: int | None = None,
    count_group: torch.distributed.ProcessGroup | None = None,
    ignore_index: int = IGNORE_INDEX,
) -> torch.Tensor:
    """`sp_cross_entropy` of ``hidden_local @ weight.T + bias`` without the ``[tokens, vocab]`` logits.

    Value and gradients (``hidden_local``, ``weight``, ``bias``) are those of
    ``sp_cross_entropy(hidden_local @ weight.T + bias, shift_labels_local, topo)``: the same on
    every rank of the group, the gradient reaching only this rank's tokens. The LM head and the
    loss run over tiles of ``chunk_tokens`` tokens, all three matmuls in the forward, so at most
    one tile of logits exists at a time. Two all-reduces of one number each; accumulates in
    float32 (float64 for float64 inputs).

    Args:
        hidden_local: This rank's last hidden states, ``[..., H]`` (e.g. ``[B, S/P, H]``).
        weight: The LM head's weight, ``[V, H]``, the dtype of ``hidden_local`` (possibly tied
            to the input embeddings).
        shift_labels_local: This rank's ``shift_labels`` from `shard_batch`,
            ``hidden_local.shape[:-1]``.
        topo: The topology from `init_sequence_parallel`.
        bias: The LM head's bias, ``[V]``, or None.
        chunk_tokens: Tokens per tile (default: a tile of 2**26 float32 logits, 256 MiB).
        count_group: The group whose valid targets normalise the loss (default: the SP group;
            ``torch.distributed.group.WORLD`` for DeepSpeed, as in `sp_cross_entropy`).
        ignore_index: The label of tokens without a target.

    Returns:
        The group's loss sum over its number of valid targets (0 for a group with none).

    Raises:
        ValueError: Shapes or dtypes that do not match (including a DeepSpeed ZeRO-3 weight
            partitioned outside its module's forward: use `causal_lm_loss`), labels that are
            not integer class indices or are outside ``[0, V)``, or a ``chunk_tokens`` that is
            not a positive int.
    """
    if weight.dim() != 2:
        hint = ""
        if hasattr(weight, "ds_shape"):
            hint = (f" (a DeepSpeed ZeRO-3 parameter of shape {tuple(weight.ds_shape)}, partitioned outside its module's forward: "
                    "use causal_lm_loss, or call this inside the LM head module's forward)")
        raise ValueError(f"weight must be [vocab, hidden], got shape {tuple(weight.shape)}{hint}")
    vocab, width = weight.shape
    if hidden_local.dim() < 1 or hidden_local.shape[-1] != width:
        raise ValueError(
            f"hidden_local must be [..., {width}] to match weight [vocab={vocab}, hidden={width}], got shape {tuple(hidden_local.shape)}"
        )
    if hidden_local.dtype != weight.dtype:
        raise ValueError(f"hidden_local ({hidden_local.dtype}) and weight ({weight.dtype}) must have the same dtype, as for hidden @ weight.T")
    if bias is not None and tuple(bias.shape) != (vocab,):
        raise ValueError(f"bias must be [vocab={vocab}], got shape {tuple(bias.shape)}")
    if tuple(shift_labels_local.shape) != tuple(hidden_local.shape[:-1]):
        raise ValueError(
            f"shift_labels_local must have one label per token of hidden_local, shape {tuple(hidden_local.shape[:-1])}, "
            f"got {tuple(shift_labels_local.shape)} (labels shifted and sharded with shard_batch, the same shard as the hidden states)"
        )
    if shift_labels_local.dtype.is_floating_point or shift_labels_local.dtype == torch.bool:
        raise ValueError(f"shift_labels_local must be integer class indices, got {shift_labels_local.dtype}")
    if chunk_tokens is None:
        chunk_tokens = default_chunk_tokens(vocab)
    elif isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int (tokens per tile of logits), got {chunk_tokens!r}")

    hidden = hidden_local.reshape(-1, width)
    labels = shift_labels_local.reshape(-1).to(device=hidden.device, dtype=torch.long)
    valid = labels != ignore_index
    if hidden.device.type != "meta" and bool(valid.any()) and (int(labels[valid].min()) < 0 or int(labels[valid].max()) >= vocab):
        raise ValueError(f"shift_labels_local holds targets outside [0, {vocab}) other than ignore_index={ignore_index}")
    group = topo.sp_group if count_group is None else count_group
    count = comm.all_reduce_sum(valid.sum().double().reshape(1), group)[0]
    inv_count = 1.0 / count.clamp(min=1.0).to(accumulator_dtype(hidden.dtype))  # stays on the device: no host sync
    grad_on = torch.is_grad_enabled()
    needs = tuple(grad_on and t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _LinearCrossEntropy.apply(hidden, weight, bias, labels, inv_count, chunk_tokens, ignore_index, group, needs)


def _logit_transforms(model) -> list[str]:
    found = []
    configs = [getattr(model, "config", None)]
    configs.append(getattr(configs[0], "text_config", None))
    for cfg in configs:
        for name in LOGIT_TRANSFORMS:
            value = getattr(cfg, name, None) if cfg is not None else None
            if value is not None and value != 1 and f"{name}={value}" not in found:
                found.append(f"{name}={value}")
    for holder in (model, getattr(model, "model", None)):
        value = getattr(holder, "lm_head_multiplier", None)
        if value is not None and value != 1:
            found.append(f"lm_head_multiplier={value}")
    return found


def _decoder(model):
    if SPLIT_AT_DECODER in model.__dict__:  # an image-text model: its inner model merges the images, then runs the text decoder
        return model.model
    get = getattr(model, "get_decoder", None)
    if get is not None:
        try:
            decoder = get()
        except (AttributeError, ValueError, NotImplementedError):
            decoder = None
        if decoder is not None and decoder is not model:
            return decoder
    decoder = getattr(model, "model", None)
    if decoder is None:
        raise ValueError(f"causal_lm_loss: cannot find the base model (get_decoder() or .model) of {type(model).__name__}")
    return decoder


def _head_loss(head, hidden, labels, topo, chunk_tokens, count_group):
    """The fused loss run as ``head``'s forward, so hooks on the head (ZeRO-3) see it."""

    def fused(h):
        return sp_linear_cross_entropy(h, head.weight, labels, topo, bias=getattr(head, "bias", None), chunk_tokens=chunk_tokens, count_group=count_group)

    previous = head.__dict__.get("forward")
    head.forward = fused
    try:
        return head(hidden)
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def _fsdp2_root(model) -> bool:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, FSDPModule)


def causal_lm_loss(model: torch.nn.Module, local_batch: dict, topo: Topology, *, chunk_tokens: int | None = None,
                   count_group: torch.distributed.ProcessGroup | None = None) -> torch.Tensor:
    """The loss of a Hugging Face causal LM on this rank's batch, without materialising its logits.

    In value and gradients ``sp_cross_entropy(model(**model_inputs(local_batch)).logits,
    local_batch["shift_labels"], topo)``: the base model runs up to its last hidden state, then
    `sp_linear_cross_entropy` runs as the forward of the LM head module
    (``model.get_output_embeddings()``), so hooks on the head (DeepSpeed ZeRO-3's gather and
    release of its weight) see it. A DeepSpeed engine, or any wrapper with ``.module``, runs the
    whole forward through its own call; so does a model sharded with FSDP2.

    Args:
        model: A causal LM switched by `apply_sequence_parallel`, or a DeepSpeed engine (or
            another wrapper with ``.module``) around one.
        local_batch: This rank's batch from `shard_batch`, with ``shift_labels``.
        topo: The topology from `init_sequence_parallel`.
        chunk_tokens: Tokens per tile of logits (default: 256 MiB of float32 logits).
        count_group: The group whose valid targets normalise the loss (default: the SP group).

    Returns:
        The loss, the same on every rank of the group.

    Raises:
        ValueError: A model that transforms its logits after the LM head (Gemma 2's
            ``final_logit_softcapping``, Cohere's ``logit_scale``, ...: use `sp_cross_entropy`
            on the logits), one without a linear output embedding or a base model, or a batch
            without ``shift_labels``.
    """
    wrapper = None
    if not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None), torch.nn.Module):
        wrapper, model = model, model.module
    elif _fsdp2_root(model):
        wrapper = model  # its forward hooks gather the root's parameters (embeddings, final norm, head) around the loss
    transforms = _logit_transforms(model)
    if transforms:
        raise ValueError(
            f"causal_lm_loss: {type(model).__name__} transforms its logits after the LM head ({', '.join(transforms)}); "
            "the fused loss does not apply it: use sp_cross_entropy(model(...).logits, ...) for this model"
        )
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        raise ValueError(f"causal_lm_loss: {type(model).__name__} has no linear output embedding (get_output_embeddings() with a [vocab, hidden] weight)")
    if "shift_labels" not in local_batch:
        raise ValueError("causal_lm_loss: local_batch has no 'shift_labels' (give shard_batch a batch with 'labels')")
    base = _decoder(model)
    inputs = model_inputs(local_batch)

    def forward(**kwargs):
        out = base(**kwargs)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return _head_loss(head, hidden, local_batch["shift_labels"], topo, chunk_tokens, count_group)

    # called through the model itself when nothing wraps it: its forward hooks (the mixers' context,
    # the coverage checks) run as for model(**inputs)
    if wrapper is None:
        wrapper = model
    previous = model.__dict__.get("forward")
    model.forward = forward
    try:
        return wrapper(**inputs)
    finally:
        if previous is None:
            del model.forward
        else:
            model.forward = previous
