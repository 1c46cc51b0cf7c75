"""DeepSeek Sparse Attention (DSA) under SP: DeepSeek-V3.2, GLM-5, A.X-K2 and Hy4 (``config.layer_types``
``"indexed_attention"``). Each rank runs the attention module's own forward on its own queries; what the
layer would append to a generation cache, its compressed KV (``kv_lora_rank + qk_rope_head_dim`` values a
token, after its norm and RoPE) and its indexer's keys (``index_head_dim``, ditto), comes back from a
stand-in cache as the whole sequence's, all-gathered in token order (`_GatheredKeys`). So the indexer
scores this rank's queries against every key and takes the same top-k as one process.

The module's ``expand_kv`` is shadowed for the call, so the attention gets the whole latent, not keys and
values expanded to every head; `attend` runs each query over its chosen latents only, the up-projection
absorbed (scores ``(W_uk^T q_nope) . c + q_rot . k_rot``, output ``W_uv (p . c)``), in chunks of queries
recomputed in the backward: ``S/P x index_topk x (kv_lora_rank + qk_rope_head_dim)`` values a chunk at
most, never ``S x heads`` keys. The module gets a mask that holds no memory (one value, expanded); the
indexer's masks (a chunk of queries' rows) and the attention's (each query's chosen keys) come from the
queries' global positions and documents (`_Rows`). GLM-5's and Hy4's shared indexer layers take the
previous layer's choice, rows this rank holds, in global key positions.

Bytes a layer, per rank: ``(P - 1)`` x its tokens x (``kv_lora_rank + qk_rope_head_dim``) in the forward's
all-gather and again in the backward's reduce-scatter, and ``(P - 1)`` x its tokens x ``index_head_dim``
forward only (the indexer takes no gradient); a shared indexer layer gathers no indexer keys.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math

import torch
from torch.utils.checkpoint import checkpoint

from ulysses_sp import layout
from ulysses_sp.data import gather_sequence
from ulysses_sp.mixers.common import PACKING_KWARGS, refuse_unsupported, shadowed_forward
from ulysses_sp.spec import MixerEstimate

__all__ = ["IndexedAttention", "is_indexed_attention", "latent_width"]

CHUNK_ELEMENTS = 1 << 26
"""Chosen latent values `attend` gathers at once (queries x index_topk x latent width x batch): 128 MiB in bf16
(DeepSeek-V3.2: 56 queries a chunk)."""
INDEX_CHUNK_ELEMENTS = 1 << 28
"""Indexer scores computed at once (queries x index_n_heads x sequence x batch): 1 GiB in float32 (DeepSeek-V3.2 at
128k tokens: 32 queries a chunk)."""
_ROWS = "_ulysses_sp_indexed_rows"


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
    gradient) and ``update_indexer`` (the indexer's keys) return the whole sequence's, in token order;
    ``keys`` given: the indexer's keys already gathered (a chunk of queries' call)."""

    def __init__(self, topo, cu_seqlens, keys=None):
        self.topo, self.cu_seqlens, self.keys, self.latent = topo, cu_seqlens, keys, None

    def update(self, k_pass, k_rot, layer_idx, *args, **kwargs):
        """``[B, 1, S/P, kv_lora_rank]`` and ``[B, 1, S/P, rope]``: one all-gather of both, kept whole for `expand_kv`."""
        self.latent = gather_sequence(torch.cat([k_pass, k_rot], dim=-1), self.topo, dim=2, cu_seqlens=self.cu_seqlens)
        return self.latent.split([k_pass.shape[-1], k_rot.shape[-1]], dim=-1)

    def expand_kv(self, kv_nope, k_rot):
        """The module's ``expand_kv`` under the strategy: the whole latent as the key (``[B, 1, S, kv_lora_rank + rope]``)
        and its first part as the value, for `IndexedAttention.attend`; the gathered tensor itself where the module
        passes the parts `update` gave it."""
        latent = self.latent
        same = latent is not None and kv_nope.data_ptr() == latent.data_ptr() and kv_nope.shape[-1] + k_rot.shape[-1] == latent.shape[-1]
        return (latent if same else torch.cat([kv_nope, k_rot], dim=-1)), kv_nope

    def update_indexer(self, keys, layer_idx):
        """``[B, S/P, index_head_dim]``, under the indexer's ``no_grad``: `_KeysGathered` with the whole sequence's."""
        if self.keys is not None:
            return self.keys
        raise _KeysGathered(gather_sequence(keys, self.topo, dim=1, cu_seqlens=self.cu_seqlens))

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class _KeysGathered(Exception):
    """Ends the indexer's first call as soon as its keys are gathered: its scores come chunk by chunk (`_chunked_indexer`)."""

    def __init__(self, keys):
        super().__init__("the indexer's keys, gathered")
        self.keys = keys


class _Rows:
    """This rank's queries: their global positions, and each key's document (packed rows), for their masks."""

    def __init__(self, mine: torch.Tensor, full: int, cu_seqlens):
        self.mine = mine
        keys = torch.arange(full, device=mine.device)
        self.doc = None if cu_seqlens is None else torch.bucketize(keys, torch.tensor(cu_seqlens[1:], device=mine.device), right=True)

    def allowed(self, a: int, b: int, keys: torch.Tensor) -> torch.Tensor:
        """Whether queries ``a:b`` may see ``keys`` (global positions: ``[n]``, every query the same, giving ``[c, n]``;
        or ``[B, c, k]``, each query's own): earlier, in the same document."""
        mine = self.mine[a:b][:, None] if keys.dim() == 1 else self.mine[a:b][None, :, None]
        ok = keys <= mine
        if self.doc is not None:
            ok &= self.doc[keys] == self.doc[mine]
        return ok


def _chunked_indexer(indexer, own, rows: _Rows, gathering: _GatheredKeys, hidden_states, q_resid, position_embeddings, attention_mask,
                     *args, cache=None, **kwargs):
    """The indexer's choice for this rank's queries, by its own code, over chunks of queries: its scores
    (``[B, c, index_n_heads, S]`` in float32) never for all of them at once. Its keys come gathered once."""
    try:
        own(hidden_states, q_resid, position_embeddings, attention_mask, *args, cache=gathering, **kwargs)
        raise RuntimeError(f"{type(indexer).__name__} did not hand its keys to its cache: the indexed strategy cannot run it")
    except _KeysGathered as gathered:
        keys = gathered.keys
    batch, local, full = hidden_states.shape[0], hidden_states.shape[1], keys.shape[1]
    step = max(1, INDEX_CHUNK_ELEMENTS // max(1, batch * indexer.n_heads * full))
    every_key = torch.arange(full, device=keys.device)
    picks = []
    for a in range(0, local, step):
        b = min(a + step, local)
        mask = rows.allowed(a, b, every_key).expand(batch, -1, -1)
        cut = tuple(t[:, a:b] for t in position_embeddings)
        picks.append(own(hidden_states[:, a:b], q_resid[:, a:b], cut, mask, *args, cache=_GatheredKeys(None, None, keys), **kwargs))
    return torch.cat(picks, dim=1)


class IndexedAttention:
    name = "indexed"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        return None if is_indexed_attention(module) else f"{type(module).__name__} is not DeepSeek Sparse Attention"

    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """The attention's compute on this rank's queries; the latent's all-gather (and its gradient's
        reduce-scatter) and the indexer keys' all-gather."""
        moved = (self.topo.sp_size - 1) * batch * seq_local * itemsize
        index = 0 if module.indexer is None else module.indexer.head_dim
        return MixerEstimate(1.0 / self.topo.sp_size, moved * (latent_width(module) + index), moved * latent_width(module))

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        """The module's own forward on this rank's queries, with the stand-in cache, its ``expand_kv`` and its
        indexer's forward shadowed for the call, and a mask that costs no memory (the masks come from `_Rows`)."""
        refuse_unsupported(module, kwargs, self.name)
        kwargs = {k: v for k, v in kwargs.items() if k not in PACKING_KWARGS}  # the masks come from the rows' documents
        full = seq_local * self.topo.sp_size
        device = (args[0] if args else kwargs["hidden_states"]).device
        rows = _Rows(layout.positions(self.topo.layout, full, self.topo.sp_size, self.topo.sp_rank, cu_seqlens).to(device), full, cu_seqlens)
        names = [p.name for p in inspect.signature(forward).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        given = dict(zip(names, args))
        given.update(kwargs)
        given["attention_mask"] = torch.ones((), dtype=torch.bool, device=device).expand(batch, 1, seq_local, full)
        given["cache"] = cache = _GatheredKeys(self.topo, cu_seqlens)
        module.__dict__["expand_kv"] = cache.expand_kv  # the attention gets the latent, not keys and values for every head
        module.__dict__[_ROWS] = rows
        indexer = getattr(module, "indexer", None)
        chunked = contextlib.nullcontext() if indexer is None else shadowed_forward(indexer, functools.partial(_chunked_indexer, indexer, indexer.forward, rows, cache))
        try:
            with chunked:
                return forward(**given)
        finally:
            module.__dict__.pop("expand_kv", None)
            module.__dict__.pop(_ROWS, None)

    @staticmethod
    def attend(module, query, key, value, mask, scaling, indices, sinks):
        """This rank's queries ``[B, H, S/P, qk_nope + qk_rope]`` over the latents the indexer chose for each
        (``indices`` ``[B, S/P, k]``, global positions; ``key`` ``[B, 1, S, kv_lora_rank + rope]`` and ``value``
        its first ``kv_lora_rank``, from `_GatheredKeys.expand_kv`), those earlier in the query's document (a short row's
        top-k holds others too), with learned sinks (``s_aux``, one logit a head) where the layer has them: the
        output ``[B, S/P, H, v_head_dim]``, as transformers' eager attention computes it on the expanded keys and
        values. ``mask`` is the call's placeholder."""
        if module.kv_b_proj.bias is not None:
            raise ValueError(f"{type(module).__name__}: a kv_b_proj with a bias is not supported by the indexed strategy")
        rows = module.__dict__[_ROWS]
        heads, nope, rank = query.shape[1], module.qk_nope_head_dim, module.kv_lora_rank
        weight = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, rank)
        latent, scale, indices = key[:, 0], scaling if scaling is not None else 1 / math.sqrt(query.shape[-1]), indices.long()
        step = max(1, CHUNK_ELEMENTS // max(1, indices.shape[0] * indices.shape[2] * latent.shape[-1]))
        outs = []
        for a in range(0, query.shape[2], step):
            b = min(a + step, query.shape[2])
            part = (query[:, :, a:b], indices[:, a:b], rows.allowed(a, b, indices[:, a:b]), latent, weight, nope, scale, sinks)
            outs.append(checkpoint(_chosen_attention, *part, use_reentrant=False) if torch.is_grad_enabled() else _chosen_attention(*part))
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous()


def _chosen_attention(query, indices, valid, latent, weight, nope: int, scale: float, sinks):
    """One chunk of queries over their chosen latents, ``kv_b_proj``'s ``weight`` (``[H, nope + v, rank]``) absorbed:
    ``[B, H, c, v_head_dim]``."""
    rank = weight.shape[-1]
    q_latent, q_rot, w_uv = torch.einsum("bhcn,hnr->bhcr", query[..., :nope], weight[:, :nope]), query[..., nope:], weight[:, nope:]
    rows = torch.arange(latent.shape[0], device=latent.device)[:, None, None]
    chosen = latent[rows, indices]  # [B, c, k, rank + rope]
    scores = (torch.einsum("bhcr,bckr->bhck", q_latent, chosen[..., :rank]) + torch.einsum("bhcr,bckr->bhck", q_rot, chosen[..., rank:])) * scale
    scores = scores.masked_fill(~valid[:, None], float("-inf"))
    if sinks is not None:  # one more logit a head, unscaled, in the wider of the two dtypes (as eager's concatenation promotes)
        dtype = torch.promote_types(scores.dtype, sinks.dtype)
        scores = torch.cat([scores.to(dtype), sinks.to(dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)], dim=-1)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32 if scores.dtype in (torch.float16, torch.bfloat16) else None)
    weights = weights[..., :indices.shape[-1]].to(latent.dtype)
    return torch.einsum("bhcr,hvr->bhcv", torch.einsum("bhck,bckr->bhcr", weights, chosen[..., :rank]), w_uv)  # the value's absorbed
