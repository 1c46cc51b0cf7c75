"""DeepSeek-V4's attention under SP (``config.layer_types`` ``"compressed_sparse_attention"``,
``"heavily_compressed_attention"``, ``"sliding_attention"``), unpacked rows. A query sees the ``W`` tokens up
to its own (its sliding window, one K=V head) and the compressed entries of windows of ``m`` tokens (4 with an
overlap of 4 more and an indexer's top-k, or 128) that end at or before it, with learned sinks.

Each rank runs the module's own code on each of its chunks with the ``W - 1`` tokens before it in front (a halo
of the module's input, `ulysses_sp.mixers.halo`'s exchange; its rows' outputs are dropped), and a stand-in cache:

1. `_Collect`: transformers' compressor (and the indexer's) compresses the windows whose last token the chunk
   holds: their tokens, the previous window's for the overlap, lie in the halo. Each window is compressed once, on
   the rank holding its last token, at its own RoPE position.
2. Those entries are all-gathered (the indexer's under ``no_grad``: its choice takes no gradient), padded to the
   most any rank compresses; the backward reduce-scatters their gradient to the rank that made them.
3. The module's forward then runs with its compressor's call answered by every entry of the row (`_every_entry`);
   under CSA the indexer's own code, given them through `_Entries`, scores this chunk's queries against every entry
   in chunks of queries and keeps one process's top-k. `attend` computes each block of queries over the rows in
   its window and its entries (the indexer's picks, or those whose window ended at or before it, the compressor's
   rule), recomputed in the backward: no ``[rows, entries]`` bias or score is ever made.

Packed rows are refused: transformers aligns the compression windows to the row, not to documents.
Bytes a layer, per rank: the halo rows forward (input, RoPE, positions) and the input's gradient back; the
all-gather of ``(P - 1)`` x the entries a rank compresses x (``head_dim``, plus ``index_head_dim`` under CSA)
forward and the reduce-scatter of ``head_dim`` backward: about ``S / (P m)`` entries, not ``S / P`` tokens.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from ulysses_sp import comm, layout
from ulysses_sp.mixers.common import PACKING_KWARGS, refuse_unsupported, shadowed_forward
from ulysses_sp.mixers.halo import _Exchange, _plan, halo_plan
from ulysses_sp.spec import MixerEstimate

__all__ = ["PACKED_REFUSAL", "CompressedAttention", "is_compressed_attention"]

PACKED_REFUSAL = ("packed rows are not supported: DeepSeek-V4 compresses windows aligned to the row's start, not to documents "
                  "(one process mixes documents there too); pass one document a row")

CHUNK_ELEMENTS = 1 << 26
"""Attention scores `attend` computes at once (batch x heads x queries x keys)."""
INDEX_CHUNK_ELEMENTS = 1 << 26
"""Indexer scores computed at once (batch x queries x index_n_heads x entries): 256 MiB in float32, of which its code
makes three (DeepSeek-V4 at 128k tokens: 32 queries a call)."""
_CHUNK = "_ulysses_sp_compressed_chunk"


def is_compressed_attention(module) -> bool:
    """DeepSeek-V4's attention: a sliding window over one K=V head, compressed entries where it has a compressor, sinks."""
    return all(hasattr(module, name) for name in ("compressor", "sinks", "kv_proj", "o_a_proj", "sliding_window"))


def _rate(module) -> int:
    return module.compressor.compress_rate if module.compressor is not None else 0


def _overlapping(module) -> bool:
    """CSA: each entry also takes the previous window's first series, and an indexer chooses among them."""
    return hasattr(module.compressor, "indexer")


def reach(module) -> int:
    """Tokens before its own that a query's output, or an entry its chunk compresses, depends on."""
    m = _rate(module)
    return max(module.sliding_window - 1, 2 * m - 1 if _overlapping(module) else m - 1)


class _Compressed(Exception):
    """Ends a compressor's call in `_Collect` as soon as its entries are made."""

    def __init__(self, entries):
        super().__init__("the chunk's compressed entries")
        self.entries = entries


class _Layers:
    def __init__(self, layer):
        self.layer = layer

    def __getitem__(self, index):
        return self.layer


class _Collect:
    """Stands in for transformers' cache in a compressor's call on a chunk's rows ``[lo, end)`` (global tokens, the
    chunk ``[start, end)`` after its halo): it hands over the windows whose last token the chunk holds, the first at
    its own position, and the previous window's overlap series, as a cache holding the row before them would.

    The entries it ends the call with carry a 0 from every parameter of the compressor and from the chunk's rows,
    made inside the call (where ZeRO-3 has gathered them): on a rank that compresses no window the parameters still
    get a gradient (DeepSpeed reduces the same set on every rank), and on every rank the entries' all-gather is
    backpropagated (a reduce-scatter) before the halo's exchange (point to point): one order of collectives."""

    def __init__(self, lo: int, start: int, end: int, compressor):
        rate = compressor.compress_rate
        self.layers, self.compressor, self.rate = _Layers(self), compressor, rate
        self.first = (start // rate) * rate
        self.a, self.b, self.zero = self.first - lo, (end // rate) * rate - lo, 0

    def store_compression_weights(self, name, kv, gate):
        self.kv, self.gate = kv, gate
        if torch.is_grad_enabled():
            self.zero = sum((t.reshape(-1)[:1] * 0).sum() for t in (kv, gate, self.compressor.position_bias))
        return kv[:, self.a : self.b], gate[:, self.a : self.b], self.first

    def update_overlap_state(self, name, chunk_kv, chunk_gate, head_dim):
        """The previous window's first series (kv, and gate with its position bias, as the compressor adds it)."""
        if self.first == 0:
            return None, None
        kv, gate = (t[:, self.a - self.rate : self.a] for t in (self.kv, self.gate))
        gate = (gate.unsqueeze(1) + self.compressor.position_bias)[:, 0]
        return kv[..., :head_dim], gate[..., :head_dim]

    def update_compressor_states(self, name, compressed):
        if torch.is_grad_enabled():
            self.zero = self.zero + (self.compressor.kv_norm(compressed[:, :0]).sum() * 0)  # its norm, run on nothing
        raise _Compressed(compressed + self.zero)


class _Entries:
    """Stands in for transformers' cache in the module's call on a chunk: the keys as they are (the chunk's rows); for
    the indexer, every one of its compressed keys of the row, gathered, and nothing of the chunk's own to compress."""

    def __init__(self, entries: dict):
        self.layers, self.entries = _Layers(self), entries

    def update(self, key, value, *args, **kwargs):
        return key, value

    def store_compression_weights(self, name, kv, gate):
        return kv[:, :0], gate[:, :0], 0

    def update_compressor_states(self, name, compressed):
        return self.entries[name]


@dataclass
class _Chunk:
    """What `attend` needs of the chunk in the module's call: its rows' global tokens and positions, and the indexer's
    choice for them (compressed sparse layers); ``longest``: the most rows any rank's chunk has (with its halo)."""

    tokens: torch.Tensor
    positions: torch.Tensor
    longest: int
    picks: torch.Tensor | None = None


def _chunked_indexer(own, heads: int, entries: int, longest: int, hidden_states, q_residual, position_ids, cache, layer_idx):
    """The indexer's choice for a chunk's queries by its own code, over pieces of queries (its scores are
    ``[B, c, index_n_heads, entries]`` in float32). As many calls on every rank (ZeRO-3 gathers the indexer's weights
    at each, a collective), whatever this chunk's length: as many as the ``longest`` chunk needs; a piece left without
    a query reruns the last one, its answer dropped."""
    batch, n = hidden_states.shape[:2]
    calls = -(-longest // max(1, INDEX_CHUNK_ELEMENTS // max(1, batch * heads * entries)))
    cuts = [i * n // calls for i in range(calls + 1)]
    picks = []
    for a, b in zip(cuts, cuts[1:]):
        rows = slice(a, b) if b > a else slice(n - 1, n)
        pick = own(hidden_states[:, rows], q_residual[:, rows], position_ids[:, rows], cache, layer_idx)
        picks.append(pick if b > a else pick[:, :0])
    return torch.cat(picks, dim=1)


def _every_entry(compressor, chunk: _Chunk, entries: dict, hidden_states, q_residual, position_ids, cache, layer_idx):
    """The compressor's call in the module's forward on a chunk: every entry of the row and no bias (``[rows, entries]``,
    dense: `attend` makes each block's); under CSA the indexer's choice for the chunk's queries, kept for `attend`."""
    if "indexer" in entries:
        indexer = compressor.indexer
        with torch.no_grad():  # its choice takes no gradient
            chunk.picks = _chunked_indexer(indexer.forward, indexer.num_heads, entries["indexer"].shape[1], chunk.longest, hidden_states, q_residual,
                                           position_ids, cache, layer_idx)
    return entries["compressor"].unsqueeze(1), None


def _window_attention(query, keys, values, window_bias, entries, entry_bias, picks, scaling, sinks):
    """transformers' DeepSeek-V4 eager attention for a block of queries ``[B, H, c, D]``, over the keys that can count:
    its window's rows (``keys``, ``values`` ``[B, 1, L, D]``, ``window_bias`` ``[c, L]``) and the compressed entries
    (``[B, T, D]``: all of them, ``entry_bias`` ``[B, c, T]``; or those the indexer ``picks`` ``[B, c, k]``, -1 for
    none, ``entry_bias`` ``[B, c, k]``), with an unscaled sink logit a head and the maximum subtracted: ``[B, H, c, D]``."""
    logits = [torch.matmul(query, keys.transpose(2, 3)) * scaling + window_bias]
    if entries is not None:
        if picks is not None:  # each query's own entries
            chosen = entries[torch.arange(entries.shape[0], device=entries.device)[:, None, None], picks.clamp(min=0)]  # [B, c, k, D]
            logits.append(torch.einsum("bhcd,bckd->bhck", query, chosen) * scaling + entry_bias[:, None])
        else:
            logits.append(torch.matmul(query, entries[:, None].transpose(2, 3)) * scaling + entry_bias[:, None])
    logits.append(sinks.reshape(1, -1, 1, 1).expand(query.shape[0], -1, query.shape[2], -1))
    logits = torch.cat(logits, dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1, dtype=logits.dtype).to(values.dtype)
    out = torch.matmul(probs[..., : keys.shape[2]], values)
    if entries is not None:
        weights = probs[..., keys.shape[2] : -1]
        out = out + (torch.einsum("bhck,bckd->bhcd", weights, chosen) if picks is not None else torch.matmul(weights, entries[:, None]))
    return out


class CompressedAttention:
    name = "compressed"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        return None if is_compressed_attention(module) else f"{type(module).__name__} is not DeepSeek-V4's attention"

    def owned(self, module, seq_local: int, bounds=None) -> list[list[int]]:
        """The windows each rank compresses (those whose last token it holds), in its chunks' order."""
        m, p = _rate(module), self.topo.sp_size
        if not m:
            return [[] for _ in range(p)]
        table = layout.chunk_table(self.topo.layout, p, seq_local * p, bounds)
        chunk = seq_local // len(table[0])
        return [[w for c in row for w in range(c * chunk // m, (c + 1) * chunk // m)] for row in table]

    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """The slowest rank's rows with their halos; its halo rows of the input forward and their gradients back, and
        the entries' all-gather forward (their gradient's reduce-scatter back)."""
        p = self.topo.sp_size
        table = layout.chunk_table(self.topo.layout, p, seq_local * p)
        plans = [_plan(table, r, seq_local // len(table[r]), reach(module), "cpu") for r in range(p)]
        halo = max(sum(n for _, n in plan.recvs) for plan in plans) * batch * hidden * itemsize
        most = max(map(len, self.owned(module, seq_local)))
        width = module.compressor.head_dim if module.compressor is not None else 0
        index = module.compressor.indexer.head_dim if _overlapping(module) else 0
        moved = (p - 1) * batch * most * itemsize
        return MixerEstimate(max(sum(len(rows) for rows, _, _ in plan.chunks) for plan in plans) / (p * seq_local),
                             halo + moved * (width + index), halo + moved * width)

    def _order(self, module, seq_local: int, bounds, device) -> tuple[int, torch.Tensor]:
        """The most windows a rank compresses, and where each window's entry lies in the padded all-gather."""
        def make():
            owned = self.owned(module, seq_local, bounds)
            most = max(map(len, owned))
            slot = {w: r * most + i for r, windows in enumerate(owned) for i, w in enumerate(windows)}
            return most, torch.tensor([slot[w] for w in range(len(slot))], dtype=torch.long, device=device)

        return self.topo.cached(("compressed-order", self.topo.layout, self.topo.sp_size, seq_local, tuple(bounds), _rate(module), str(device)), make)

    def _gather(self, parts: list, most: int, order: torch.Tensor) -> torch.Tensor:
        """Every rank's entries (``parts``: this rank's, chunk by chunk), in window order: one all-gather, padded to the
        ``most`` any rank holds."""
        mine = torch.cat(parts, dim=1)
        if not most:  # a row shorter than a window: no entries anywhere
            return mine
        padded = torch.nn.functional.pad(mine, (0, 0, 0, most - mine.shape[1]))
        return comm.all_gather(padded, self.topo.sp_group, dim=1).index_select(1, order)

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens):
        """The module's own forward on each chunk with its halo in front, with the stand-in caches (`_Collect`, then
        `_Entries`) and its compressor's forward shadowed for the call (`_every_entry`); the halo rows' outputs dropped."""
        refuse_unsupported(module, kwargs, self.name)
        bounds = layout.document_bounds(cu_seqlens, seq_local * self.topo.sp_size)  # one document: the balanced layout's, unpacked
        if len(bounds) > 2:
            raise ValueError(f"{type(module).__name__} ({self.name} strategy): {PACKED_REFUSAL}")
        names = [p.name for p in inspect.signature(forward).parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        given = dict(zip(names, args))
        given.update(kwargs)
        dropped = ("attention_mask", "cache", "past_key_values", *PACKING_KWARGS)  # the masks come from the chunk's tokens and the compressor
        given = {k: v for k, v in given.items() if k not in dropped}
        x, positions, rope = given.pop("hidden_states"), given.pop("position_ids"), given.pop("position_embeddings")
        cos, sin = rope[module.rope_layer_type]
        plan = halo_plan(self.topo, seq_local, bounds, reach(module), x.device)

        def with_halo(t):
            """``t`` with the halo rows received after this rank's (differentiable)."""
            return torch.cat([t, _Exchange.apply(t, self.topo.sp_group, plan)], dim=1) if self.topo.sp_size > 1 else t

        source, pos_source, rope_source = with_halo(x), with_halo(positions), with_halo(torch.cat([cos, sin], dim=-1).detach())
        chunks = [(ids, lo, start, lo + len(ids)) for ids, lo, start in plan.chunks]
        compressor, entries = module.compressor, {}
        if compressor is not None:
            makers = {"compressor": compressor, **({"indexer": compressor.indexer} if _overlapping(module) else {})}
            parts = {name: [] for name in makers}
            for ids, lo, start, end in chunks:
                ext, pos = source.index_select(1, ids), pos_source.index_select(1, ids)
                for name, maker in makers.items():
                    with torch.no_grad() if name == "indexer" else contextlib.nullcontext():  # the indexer's choice takes no gradient
                        try:
                            maker(ext, None, pos, _Collect(lo, start, end, maker), module.layer_idx)
                        except _Compressed as made:
                            parts[name].append(made.entries)
            most, order = self._order(module, seq_local, bounds, x.device)
            entries["compressor"] = self._gather(parts["compressor"], most, order)
            if "indexer" in makers:
                with torch.no_grad():
                    entries["indexer"] = self._gather(parts["indexer"], most, order)
        outs = []
        for ids, lo, start, end in chunks:
            chunk = _Chunk(torch.arange(lo, end, device=x.device), pos_source.index_select(1, ids), seq_local // len(chunks) + reach(module))
            halves = rope_source.index_select(1, ids).chunk(2, dim=-1)
            call = dict(given, hidden_states=source.index_select(1, ids), position_ids=chunk.positions,
                        position_embeddings={module.rope_layer_type: halves}, attention_mask=None, cache=_Entries(entries))
            module.__dict__[_CHUNK] = chunk
            every = contextlib.nullcontext() if compressor is None else shadowed_forward(compressor, functools.partial(_every_entry, compressor, chunk, entries))
            try:
                with every:
                    outs.append(forward(**call)[0][:, start - lo :])
            finally:
                module.__dict__.pop(_CHUNK, None)
        return torch.cat(outs, dim=1), None

    @staticmethod
    def attend(module, query, key, value, mask, scaling, indices, sinks):
        """A chunk's queries ``[B, H, n, D]`` (its halo's first) over its rows and the row's compressed entries (``key`` =
        ``value``: ``[B, 1, n + entries, D]``), in blocks of queries recomputed in the backward, each query over the rows
        in its window and the entries it may see (those whose window ended at or before it; under CSA, of those, the
        indexer's choice), with the module's sinks: ``[B, n, H, D]``, as transformers' eager attention computes it over
        every row and entry with its masks. ``mask`` is None (the module's call is given none)."""
        chunk, window = module.__dict__[_CHUNK], module.sliding_window
        batch, heads, n = query.shape[:3]
        entries = key[:, 0, n:] if key.shape[2] > n else None
        width = window + (0 if entries is None else chunk.picks.shape[-1] if chunk.picks is not None else entries.shape[1])
        step = max(1, min(window, CHUNK_ELEMENTS // max(1, batch * heads * width)))
        outs = []
        for a in range(0, n, step):
            b, lo = min(a + step, n), max(0, a - window + 1)
            distance = chunk.tokens[a:b, None] - chunk.tokens[None, lo:b]
            window_bias = torch.zeros(distance.shape, dtype=query.dtype, device=query.device).masked_fill((distance < 0) | (distance >= window), float("-inf"))
            picks = entry_bias = None
            if entries is not None and chunk.picks is not None:
                picks = chunk.picks[:, a:b]
                entry_bias = torch.zeros(picks.shape, dtype=query.dtype, device=query.device).masked_fill(picks < 0, float("-inf"))
            elif entries is not None:  # every entry whose window ended at or before the query
                ready = (chunk.positions[:, a:b, None] + 1) // module.compressor.compress_rate
                late = torch.arange(entries.shape[1], device=query.device) >= ready
                entry_bias = torch.zeros(late.shape, dtype=query.dtype, device=query.device).masked_fill(late, float("-inf"))
            part = (query[:, :, a:b], key[:, :, lo:b], value[:, :, lo:b], window_bias, entries, entry_bias, picks, scaling, sinks if sinks is not None else module.sinks)
            outs.append(checkpoint(_window_attention, *part, use_reentrant=False) if torch.is_grad_enabled() else _window_attention(*part))
        return torch.cat(outs, dim=2).transpose(1, 2).contiguous()
