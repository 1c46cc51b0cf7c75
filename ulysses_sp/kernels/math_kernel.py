"""``math``: plain softmax attention computed in fp32 (fp64 for fp64 inputs).

It holds the ``[B, H, Sq, Sk]`` scores of a call, so it is the reference and the last
resort, never what ``auto`` picks where another kernel runs. It propagates NaN and
inf as one-process attention does, which is why the torch kernel hands it blocks with
non-finite inputs.
"""

from __future__ import annotations

import torch

from .common import accumulator_dtype, dense_backward, dense_forward

__all__ = ["MathKernel", "square_forward", "square_backward"]


def _repeat_kv(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    return t if t.shape[2] == q_heads else t.repeat_interleave(q_heads // t.shape[2], dim=2)


def _scores(q, k, causal, scale):
    acc = accumulator_dtype(q.dtype)
    q_, k_ = (t.to(acc).transpose(1, 2) for t in (q, _repeat_kv(k, q.shape[2])))
    scores = (q_ @ k_.transpose(-1, -2)) * scale
    if causal:  # Sq == Sk here (dense_forward splits the rest)
        mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def square_forward(q, k, v, causal, scale):
    scores = _scores(q, k, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    v_ = _repeat_kv(v, q.shape[2]).to(scores.dtype).transpose(1, 2)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v_
    return out.transpose(1, 2).to(q.dtype), lse


def square_backward(dout, q, k, v, out, lse, causal, scale):
    hq, hk = q.shape[2], k.shape[2]
    probs = torch.exp(_scores(q, k, causal, scale) - lse.to(accumulator_dtype(q.dtype)).unsqueeze(-1))
    acc = probs.dtype
    q_, k_, v_ = (t.to(acc).transpose(1, 2) for t in (q, _repeat_kv(k, hq), _repeat_kv(v, hq)))
    do_, o_ = (t.to(acc).transpose(1, 2) for t in (dout, out))
    dv_ = probs.transpose(-1, -2) @ do_
    ds = probs * (do_ @ v_.transpose(-1, -2) - (do_ * o_).sum(-1, keepdim=True)) * scale

    def fold(g):  # [B, Hq, S, D] -> [B, S, Hkv, D], summing each kv head's q group
        return g.unflatten(1, (hk, hq // hk)).sum(2).transpose(1, 2)

    return (ds @ k_).transpose(1, 2).to(q.dtype), fold(ds.transpose(-1, -2) @ q_).to(k.dtype), fold(dv_).to(v.dtype)


class MathKernel:
    name = "math"

    def problem(self, dtype, device, head_dim) -> str | None:
        return None

    def block_forward(self, q, k, v, *, causal, scale, varlen=None):
        return dense_forward(square_forward, q, k, v, causal, scale, varlen)

    def block_backward(self, dout, q, k, v, out, lse, *, causal, scale, varlen=None):
        return dense_backward(square_backward, dout, q, k, v, out, lse, causal, scale, varlen)
