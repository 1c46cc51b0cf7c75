"""The one-process reference: plain softmax attention with an explicit mask, in fp64.

Written independently of ulysses_sp.kernels so the two cannot share a bug.
"""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, *, causal=True, scale=None, cu_seqlens=None, diagonal=0, window=None, softcap=0.0, sinks=None, blocks=None):
    """q, k, v: full sequences [B, S, H, D]. ``diagonal`` shifts the causal mask
    (tests use it to show a wrong mask is caught); ``window``: query i sees keys
    i - window < j <= i; ``softcap``: scores become softcap * tanh(scores / softcap); ``sinks``:
    one logit per q head, a column of every row's softmax with no value (GPT-OSS's eager code);
    ``blocks``: global (start, end) runs whose tokens also see each other's later tokens, as
    transformers' Gemma 3 masks (full layers: causal OR same block; sliding: window AND that).
    Packed documents (``cu_seqlens``) attend within themselves: each is computed on its own,
    which is the block-diagonal mask without the S x S scores of a row of a thousand documents."""
    if cu_seqlens is not None:
        bounds = [int(x) for x in cu_seqlens]
        if bounds[0] != 0 or bounds[-1] != q.shape[1] or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(f"cu_seqlens {bounds} do not cover the {q.shape[1]} tokens in order")
        options = dict(causal=causal, scale=scale, diagonal=diagonal, window=window, softcap=softcap, sinks=sinks)
        return torch.cat([reference_attention(q[:, a:b], k[:, a:b], v[:, a:b], **options,
                                               blocks=[(c - a, d - a) for c, d in blocks or () if a <= c < b])
                          for a, b in zip(bounds, bounds[1:])], dim=1)
    b, s, hq, d = q.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    groups = hq // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    allowed = torch.ones(s, s, dtype=torch.bool)
    if causal:
        allowed = allowed.tril(diagonal)
    for start, end in blocks or ():
        allowed[start:end, start:end] = True
    if window is not None:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).triu(1 - window)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        column = sinks.to(scores.dtype)[None, :, None, None].expand(b, hq, s, 1)
        return torch.einsum("bhqk,bkhd->bqhd", torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1], v)
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
