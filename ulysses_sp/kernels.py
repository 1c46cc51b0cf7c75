"""Local (single-rank) attention kernels, all in the ``[B, S, H, D]`` layout.

* :func:`local_attention` is differentiable and is what a backend calls when it
  holds whole sequences (Ulysses after its all-to-all).
* :func:`attention_with_lse` / :func:`attention_with_lse_backward` return and
  consume the log-sum-exp, for backends that assemble attention from blocks
  (ring, all-gather) in their own ``autograd.Function``; :func:`merge_partials`
  merges block results in fp32.

Kernel choice: flash-attn's functions on CUDA for fp16/bf16 when installed;
on CPU the ATen flash kernel (``_scaled_dot_product_flash_attention_for_cpu``
and its backward: exact against SDPA, GQA without repeating K/V, lse in fp32 or
fp64 for fp64 inputs); SDPA or plain math otherwise.

Causal masks are top-left aligned (query i sees keys 0..i) even when the
query and key lengths differ, as in the CPU kernel.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "local_attention",
    "attention_with_lse",
    "attention_with_lse_backward",
    "merge_partials",
    "blocks_forward",
    "blocks_backward",
    "accumulator_dtype",
    "flash_attn_available",
]


def flash_attn_available() -> bool:
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return torch.cuda.is_available()


def _use_flash_attn(q: torch.Tensor) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and flash_attn_available()


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])


def _check_nonempty(q: torch.Tensor, k: torch.Tensor) -> None:
    # The CPU kernel dies with SIGFPE on an empty sequence; fail in Python instead.
    if q.shape[1] == 0 or k.shape[1] == 0:
        raise ValueError(f"attention needs non-empty sequences, got q {tuple(q.shape)} and k {tuple(k.shape)}")


def _repeat_kv(k: torch.Tensor, q_heads: int) -> torch.Tensor:
    return k if k.shape[2] == q_heads else k.repeat_interleave(q_heads // k.shape[2], dim=2)


def local_attention(q_bshd, k_bshd, v_bshd, *, causal: bool, scale: float | None = None) -> torch.Tensor:
    """Softmax attention of whole sequences; q heads may be a multiple of kv heads (GQA)."""
    _check_nonempty(q_bshd, k_bshd)
    scale = _scale(q_bshd, scale)
    if _use_flash_attn(q_bshd):
        from flash_attn import flash_attn_func

        return flash_attn_func(q_bshd, k_bshd, v_bshd, softmax_scale=scale, causal=causal)
    if q_bshd.device.type == "cpu" and not _cpu_flash_ok(q_bshd, k_bshd):
        return _math_with_lse(q_bshd, k_bshd, v_bshd, causal, scale)[0]
    q_bhsd, k_bhsd, v_bhsd = (t.transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd))
    if q_bshd.device.type == "cpu":
        out_bhsd, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q_bhsd, k_bhsd, v_bhsd, 0.0, causal, scale=scale
        )
    else:
        hq = q_bshd.shape[2]
        k_bhsd, v_bhsd = (_repeat_kv(t, hq).transpose(1, 2) for t in (k_bshd, v_bshd))
        out_bhsd = F.scaled_dot_product_attention(q_bhsd, k_bhsd, v_bhsd, is_causal=causal, scale=scale)
    return out_bhsd.transpose(1, 2)


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where query i may see key j (top-left aligned)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _math_with_lse(q, k, v, causal, scale):
    """Plain math in fp32 (fp64 for fp64): O(Sq*Sk) memory; the fallback off-CPU."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    hq = q.shape[2]
    q_, k_, v_ = (t.to(acc).transpose(1, 2) for t in (q, _repeat_kv(k, hq), _repeat_kv(v, hq)))
    scores = (q_ @ k_.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(q.shape[1], k.shape[1], q.device), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.exp(scores - lse.unsqueeze(-1)) @ v_
    return out.transpose(1, 2).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal, scale):
    acc = lse.dtype
    b, sq, hq, d = q.shape
    hk = k.shape[2]
    q_, k_, v_ = (t.to(acc).transpose(1, 2) for t in (q, _repeat_kv(k, hq), _repeat_kv(v, hq)))
    do_, o_ = (t.to(acc).transpose(1, 2) for t in (dout, out))
    scores = (q_ @ k_.transpose(-1, -2)) * scale
    if causal:
        scores = scores.masked_fill(~_causal_mask(sq, k.shape[1], q.device), float("-inf"))
    probs = torch.exp(scores - lse.unsqueeze(-1))
    dv_ = probs.transpose(-1, -2) @ do_
    dp = do_ @ v_.transpose(-1, -2)
    ds = probs * (dp - (do_ * o_).sum(-1, keepdim=True)) * scale
    dq_ = ds @ k_
    dk_ = ds.transpose(-1, -2) @ q_

    def fold(g):  # [B, Hq, S, D] -> [B, S, Hkv, D], summing each kv head's q group
        return g.unflatten(1, (hk, hq // hk)).sum(2).transpose(1, 2)

    return dq_.transpose(1, 2).to(q.dtype), fold(dk_).to(k.dtype), fold(dv_).to(v.dtype)


def _cpu_flash_ok(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The CPU flash op returns out 0 and lse 0, not NaN, for a query row holding an inf
    (seen with torch 2.13): non-finite q or k take the math path, which propagates NaN.
    The check reads q and k once, against the S_q x S_k work of the block; the math path
    holds S_q x S_k scores, so a long sequence with an inf may run out of memory instead."""
    return q.device.type == "cpu" and bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())


@torch.no_grad()
def attention_with_lse(q_bshd, k_bshd, v_bshd, *, causal: bool, scale: float | None = None):
    """``(out_bshd, lse_bhs)``; lse is the natural log-sum-exp of the scaled scores,
    fp32 (fp64 for fp64 inputs). Not differentiable: pair with the backward below."""
    _check_nonempty(q_bshd, k_bshd)
    scale = _scale(q_bshd, scale)
    if _cpu_flash_ok(q_bshd, k_bshd):
        out_bhsd, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            *(t.transpose(1, 2) for t in (q_bshd, k_bshd, v_bshd)), 0.0, causal, scale=scale
        )
        return out_bhsd.transpose(1, 2), lse
    return _math_with_lse(q_bshd, k_bshd, v_bshd, causal, scale)


@torch.no_grad()
def attention_with_lse_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, *, causal: bool, scale: float | None = None):
    """``(dq, dk, dv)`` in ``[B, S, H, D]`` from the saved forward results."""
    scale = _scale(q_bshd, scale)
    if _cpu_flash_ok(q_bshd, k_bshd):
        grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *(t.transpose(1, 2) for t in (dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd)), lse_bhs, 0.0, causal, scale=scale
        )
        return tuple(g.transpose(1, 2) for g in grads)
    return _math_backward(dout_bshd, q_bshd, k_bshd, v_bshd, out_bshd, lse_bhs, causal, scale)


def merge_partials(out, lse, block_out, block_lse):
    """Merge attention over two disjoint key sets given each one's ``(out, lse)``.

    ``out`` is ``[B, S, H, D]``, ``lse`` is ``[B, H, S]``; ``out``/``lse`` may be
    None for the first block. Accumulates in fp32 (fp64 for fp64) and returns
    the accumulators; cast the final ``out`` back to the input dtype once.
    A row with ``lse = -inf`` (no visible key) contributes nothing.
    """
    acc = accumulator_dtype(block_out.dtype)
    block_out, block_lse = block_out.to(acc), block_lse.to(acc)
    if out is None:
        return block_out, block_lse
    new_lse = torch.logaddexp(lse, block_lse)
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    return out * w_old + block_out * w_new, new_lse


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results are kept in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def blocks_forward(q, k, v, segments, scale: float, out_acc, lse_acc) -> None:
    """Attend query ranges of ``q`` to key ranges of ``k``/``v`` (``layout.block_segments``:
    ``(q0, q1, k0, k1, diagonal)``) and merge the results into ``out_acc``
    ``[B, Sq, H, D]`` / ``lse_acc`` ``[B, H, Sq]`` in place. fp16/bf16 blocks are computed
    from fp32 copies: the kernel returns its input dtype, and rounding every partial result
    before the merge made the error grow with the number of blocks (up to 2.4x at P=4)."""
    q, k, v = (t.to(out_acc.dtype) for t in (q, k, v))
    for q0, q1, k0, k1, diagonal in segments:
        o, lse = attention_with_lse(q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal=diagonal, scale=scale)
        out_acc[:, q0:q1], lse_acc[..., q0:q1] = merge_partials(out_acc[:, q0:q1], lse_acc[..., q0:q1], o, lse)


def blocks_backward(dout, q, k, v, out, lse, segments, scale: float, dq_acc, dk_acc, dv_acc) -> None:
    """Gradients of :func:`blocks_forward` given the final ``out``/``lse`` of every
    query row, added in place to ``dq_acc``, ``dk_acc``, ``dv_acc``; in their dtype, as the forward."""
    dout, q, k, v, out = (t.to(dq_acc.dtype) for t in (dout, q, k, v, out))
    for q0, q1, k0, k1, diagonal in segments:
        dq, dk, dv = attention_with_lse_backward(
            dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1], lse[..., q0:q1].contiguous(),
            causal=diagonal, scale=scale,
        )
        dq_acc[:, q0:q1] += dq
        dk_acc[:, k0:k1] += dk
        dv_acc[:, k0:k1] += dv
