"""DeepSeek Sparse Attention (DSA) under SP: DeepSeek-V3.2, GLM-5, A.X-K2 and Hy4 (``config.layer_types``
``"indexed_attention"``). Each rank runs the attention module's own forward on its own queries; what the
layer would append to a generation cache, its compressed KV (``kv_lora_rank + qk_rope_head_dim`` values a
token, after its norm and RoPE) and its indexer's keys (``index_head_dim``, ditto), comes back from a
stand-in cache as the whole sequence's, all-gathered in token order (`_GatheredKeys`). So the indexer
scores this rank's queries against every key and takes the same top-k as one process, and the module
expands the whole latent to keys and values itself.

The mask the module gets is this rank's rows of the causal mask, by document when packed
(``[B, 1, S_local, S]``); the attention (`attend`) applies it and the indexer's choice. GLM-5's and Hy4's
shared indexer layers take the previous layer's choice, rows this rank holds, in global key positions.

Bytes a layer, per token of the sequence: ``(P - 1) / P`` x (``kv_lora_rank + qk_rope_head_dim``) in the
forward's all-gather and again in the backward's reduce-scatter, and ``(P - 1) / P`` x ``index_head_dim``
forward only (the indexer takes no gradient); a shared indexer layer gathers no indexer keys.
Memory: the module expands the whole latent (``S x heads x (qk_nope + v_head_dim)``) and masks
``S_local x S`` scores, as transformers' eager attention does on one process.
"""

from __future__ import annotations

import inspect
import math

import torch

from ulysses_sp import layout
from ulysses_sp.data import gather_sequence
from ulysses_sp.spec import MixerEstimate

__all__ = ["IndexedAttention", "is_indexed_attention", "latent_width"]

_PACKING_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def is_indexed_attention(module) -> bool:
    """A multi-head latent attention module of DeepSeek Sparse Attention: one with an indexer, or a shared layer reusing
    the previous one's (not DeepSeek-V4's compressor, whose indexer scores compressed entries)."""
    has_choice = getattr(module, "indexer", None) is not None or bool(getattr(module, "skip_topk", False))
    return has_choice and hasattr(module, "kv_a_proj_with_mqa")


def latent_width(module) -> int:
    """Values a token of the compressed KV the module all-gathers: ``kv_lora_rank + qk_rope_head_dim``."""
    return module.kv_lora_rank + module.qk_rope_head_dim


class _GatheredKeys:
    """Stands in for transformers' cache in one DSA attention call: ``update`` (the latent KV, with its
    gradient) and ``update_indexer`` (the indexer's keys) return the whole sequence's, in token order."""

    def __init__(self, topo, cu_seqlens):
        self.topo, self.cu_seqlens = topo, cu_seqlens

    def update(self, k_pass, k_rot, layer_idx, *args, **kwargs):
        """``[B, 1, S_local, kv_lora_rank]`` and ``[B, 1, S_local, rope]``: one all-gather of both."""
        whole = gather_sequence(torch.cat([k_pass, k_rot], dim=-1), self.topo, dim=2, cu_seqlens=self.cu_seqlens)
        return whole.split([k_pass.shape[-1], k_rot.shape[-1]], dim=-1)

    def update_indexer(self, keys, layer_idx):
        """``[B, S_local, index_head_dim]``, under the indexer's ``no_grad``."""
        return gather_sequence(keys, self.topo, dim=1, cu_seqlens=self.cu_seqlens)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class IndexedAttention:
    name = "indexed"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        return None if is_indexed_attention(module) else f"{type(module).__name__} is not DeepSeek Sparse Attention"

    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """The whole latent expanded on every rank; the latent's all-gather (and its gradient's reduce-scatter)
        and the indexer keys' all-gather."""
        moved = (self.topo.sp_size - 1) * batch * seq_local * itemsize
        index = 0 if module.indexer is None else module.indexer.head_dim
        return MixerEstimate(1.0, moved * (latent_width(module) + index), moved * latent_width(module))

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        """The module's own forward on this rank's queries, with the mask of their rows and the stand-in cache."""
        for name in ("cache", "past_key_values"):
            if kwargs.get(name) is not None:
                raise ValueError(f"{type(module).__name__}: a cache (generation) is not supported under sequence parallelism; "
                                 "call remove_sequence_parallel(model) to generate")
        kwargs = {k: v for k, v in kwargs.items() if k not in _PACKING_KWARGS}
        full = seq_local * self.topo.sp_size
        device = (args[0] if args else kwargs["hidden_states"]).device
        mine = layout.positions(self.topo.layout, full, self.topo.sp_size, self.topo.sp_rank, cu_seqlens).to(device)
        keys = torch.arange(full, device=device)
        allowed = keys[None, :] <= mine[:, None]
        if cu_seqlens is not None:
            doc = torch.bucketize(keys, torch.tensor(cu_seqlens[1:], device=device), right=True)
            allowed &= doc[None, :] == doc[mine][:, None]
        names = [p.name for p in inspect.signature(forward).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        given = dict(zip(names, args))
        given.update(kwargs)
        given["attention_mask"] = allowed.expand(batch, 1, seq_local, full)
        given["cache"] = _GatheredKeys(self.topo, cu_seqlens)
        return forward(**given)

    @staticmethod
    def attend(module, query, key, value, mask, scaling, indices, sinks):
        """Softmax attention of this rank's queries ``[B, H, S_local, D]`` over the whole sequence's keys
        ``[B, H, S, D]``, where ``mask`` allows and the indexer chose (``indices`` ``[B, S_local, k]``, global
        key positions), with learned sinks (``s_aux``, one logit a head) where the layer has them; the
        output ``[B, S_local, H, Dv]``, as transformers' eager attention computes it."""
        chosen = torch.zeros(mask.shape[0], mask.shape[2], mask.shape[3], dtype=torch.bool, device=mask.device)
        chosen.scatter_(-1, indices.long(), True)
        allowed = mask & chosen[:, None]
        scores = torch.matmul(query, key.transpose(-1, -2)) * (scaling if scaling is not None else 1 / math.sqrt(query.shape[-1]))
        scores = scores.masked_fill(~allowed, float("-inf"))
        if sinks is not None:  # one more logit a head, unscaled, in the wider of the two dtypes (as eager's concatenation promotes)
            dtype = torch.promote_types(scores.dtype, sinks.dtype)
            scores = torch.cat([scores.to(dtype), sinks.to(dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else None)
        weights = weights[..., :key.shape[2]].to(value.dtype)
        return torch.matmul(weights, value).transpose(1, 2).contiguous()

