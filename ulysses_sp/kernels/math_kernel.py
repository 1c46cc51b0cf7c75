"""``math``: plain softmax attention computed in fp32 (fp64 for fp64 inputs).

It holds the ``[B, H, Sq, Sk]`` scores of a sequence, masked with the contract's explicit
mask (causal, window), so it is the reference and the last resort, never what ``auto``
picks where another kernel runs. It propagates NaN and inf as one-process attention
does, which is why the torch kernel hands it blocks with non-finite inputs; it is also
the torch kernel's soft-capping path, over query tiles.
"""

from __future__ import annotations

import torch

from .common import accumulator_dtype, repeat_kv, tiled_backward, tiled_forward, visible

__all__ = ["MathKernel", "square_forward", "square_backward"]


def _scores(q, k, window, scale, softcap):
    """Capped, masked scores and tanh(scores / softcap) (None without a cap) for the backward."""
    acc = accumulator_dtype(q.dtype)
    q_, k_ = (t.to(acc).transpose(1, 2) for t in (q, repeat_kv(k, q.shape[2])))
    scores = (q_ @ k_.transpose(-1, -2)) * scale
    capped = None
    if softcap:
        capped = torch.tanh(scores / softcap)
        scores = softcap * capped
    mask = visible(q.shape[1], k.shape[1], window, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores, capped


def square_forward(q, k, v, window, scale, softcap):
    scores, _ = _scores(q, k, window, scale, softcap)
    lse = torch.logsumexp(scores, dim=-1)
    v_ = repeat_kv(v, q.shape[2]).to(scores.dtype).transpose(1, 2)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v_
    return out.transpose(1, 2).to(q.dtype), lse


def square_backward(dout, q, k, v, out, lse, window, scale, softcap):
    hq, hk = q.shape[2], k.shape[2]
    scores, capped = _scores(q, k, window, scale, softcap)
    probs = torch.exp(scores - lse.to(scores.dtype).unsqueeze(-1))
    acc = probs.dtype
    q_, k_, v_ = (t.to(acc).transpose(1, 2) for t in (q, repeat_kv(k, hq), repeat_kv(v, hq)))
    do_, o_ = (t.to(acc).transpose(1, 2) for t in (dout, out))
    dv_ = probs.transpose(-1, -2) @ do_
    ds = probs * (do_ @ v_.transpose(-1, -2) - (do_ * o_).sum(-1, keepdim=True)) * scale
    if capped is not None:  # d/dx softcap * tanh(x / softcap) = 1 - tanh^2
        ds = ds * (1 - capped * capped)

    def fold(g):  # [B, Hq, S, D] -> [B, S, Hkv, D], summing each kv head's q group
        return g.unflatten(1, (hk, hq // hk)).sum(2).transpose(1, 2)

    return (ds @ k_).transpose(1, 2).to(q.dtype), fold(ds.transpose(-1, -2) @ q_).to(k.dtype), fold(dv_).to(v.dtype)


class MathKernel:
    name = "math"

    def problem(self, dtype, device, head_dim) -> str | None:
        return None

    def block_forward(self, q, k, v, *, causal, scale, varlen=None, window=None, softcap=0.0):
        return tiled_forward(square_forward, None, q, k, v, causal, scale, varlen, window, softcap)

    def block_backward(self, dout, q, k, v, out, lse, *, causal, scale, varlen=None, window=None, softcap=0.0):
        return tiled_backward(square_backward, None, dout, q, k, v, out, lse, causal, scale, varlen, window, softcap)
