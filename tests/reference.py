"""The one-process reference: plain softmax attention with an explicit mask, in fp64.

Written independently of ulysses_sp.kernels so the two cannot share a bug.
"""

from __future__ import annotations

import math

import torch


def reference_attention(q, k, v, *, causal=True, scale=None, cu_seqlens=None, diagonal=0, window=None, softcap=0.0):
    """q, k, v: full sequences [B, S, H, D]. ``diagonal`` shifts the causal mask
    (tests use it to show a wrong mask is caught); ``window``: query i sees keys
    i - window < j <= i; ``softcap``: scores become softcap * tanh(scores / softcap)."""
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
    if window is not None:
        allowed = allowed & torch.ones(s, s, dtype=torch.bool).triu(1 - window)
    if cu_seqlens is not None:
        doc = torch.zeros(s, dtype=torch.long)
        for i, (start, end) in enumerate(zip(cu_seqlens[:-1], cu_seqlens[1:])):
            doc[start:end] = i
        allowed = allowed & (doc[:, None] == doc[None, :])
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)
