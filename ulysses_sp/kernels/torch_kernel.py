"""``torch``: PyTorch's own fused attention ops, called directly (no SDPA dispatch).

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward: any float dtype,
  GQA without repeating K/V, lse in fp32 (fp64 for fp64). It returns out 0 and lse 0
  rather than NaN for a row holding an inf (torch 2.13), so blocks with non-finite q or
  k go to the math kernel, which propagates NaN as one-process attention does.
* CUDA fp16/bf16: ``_scaled_dot_product_flash_attention`` and its backward (flash-attn 2
  inside torch: GQA without repeating K/V; +inf lse for empty rows, as flash-attn).
* CUDA fp32: ``_scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``; it
  needs K/V repeated to the q heads and pads its lse to a multiple of 32 rows.

Meta tensors take the CUDA path (those ops have meta kernels), so a meta-device run
shows the CUDA calls' shapes and memory without a GPU. The ops take ``[B, H, S, D]``:
the ``[B, S, H, D]`` tensors are passed as transposed views. Their causal masks are top-left aligned, and none has a varlen form, so the
shared per-sequence loop and bottom-right split (``common.dense_forward``) wrap them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import math_kernel
from .common import dense_backward, dense_forward

__all__ = ["TorchKernel"]

aten = torch.ops.aten
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _bhsd(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def _finite(q, k) -> bool:
    return bool(torch.isfinite(q).all()) and bool(torch.isfinite(k).all())


def _repeat_kv(t, q_heads):
    return t if t.shape[2] == q_heads else t.repeat_interleave(q_heads // t.shape[2], dim=2)


def _fold(g, kv_heads):  # [B, S, Hq, D] gradient of repeated K/V -> [B, S, Hkv, D]
    return g if g.shape[2] == kv_heads else g.unflatten(2, (kv_heads, -1)).sum(3)


def _square_forward(q, k, v, causal, scale):
    if q.device.type == "cpu":
        if not _finite(q, k):
            return math_kernel.square_forward(q, k, v, causal, scale)
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(*_bhsd(q, k, v), 0.0, causal, scale=scale)
        return out.transpose(1, 2), lse
    if q.dtype == torch.float32:
        hq = q.shape[2]
        out, lse = aten._scaled_dot_product_efficient_attention(*_bhsd(q, _repeat_kv(k, hq), _repeat_kv(v, hq)), None, True, 0.0, causal, scale=scale)[:2]
        return out.transpose(1, 2), lse[..., : q.shape[1]]
    out, lse = aten._scaled_dot_product_flash_attention(*_bhsd(q, k, v), 0.0, causal, False, scale=scale)[:2]
    return out.transpose(1, 2), torch.where(torch.isposinf(lse), float("-inf"), lse)


def _square_backward(dout, q, k, v, out, lse, causal, scale):
    if q.device.type == "cpu":
        if not _finite(q, k):
            return math_kernel.square_backward(dout, q, k, v, out, lse, causal, scale)
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(*_bhsd(dout, q, k, v, out), lse.contiguous(), 0.0, causal, scale=scale)
        return [g.transpose(1, 2) for g in grads]
    sq, sk = q.shape[1], k.shape[1]
    if q.dtype == torch.float32:
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed/offset: unused without dropout
        hq, hkv = q.shape[2], k.shape[2]
        lse_padded = F.pad(lse, (0, -sq % 32))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            *_bhsd(dout, q, _repeat_kv(k, hq), _repeat_kv(v, hq)), None, out.transpose(1, 2), lse_padded, no_rng, no_rng, 0.0,
            [True, True, True, False], causal, scale=scale,
        )
        return dq.transpose(1, 2), _fold(dk.transpose(1, 2), hkv), _fold(dv.transpose(1, 2), hkv)
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()  # flash-attn's mark of an empty row
    rng_state, unused = torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)
    grads = aten._scaled_dot_product_flash_attention_backward(
        *_bhsd(dout, q, k, v, out), lse, None, None, sq, sk, 0.0, causal, rng_state, unused, scale=scale
    )
    return [g.transpose(1, 2) for g in grads]


class TorchKernel:
    name = "torch"

    def problem(self, dtype, device, head_dim) -> str | None:
        if device.type == "cpu":
            return None
        if device.type in ("cuda", "meta"):
            return None if dtype in _CUDA_DTYPES else f"torch's fused CUDA ops take fp16, bf16 or fp32, not {dtype}"
        return f"torch's fused ops run on CPU or CUDA, not {device.type}"

    def block_forward(self, q, k, v, *, causal, scale, varlen=None):
        return dense_forward(_square_forward, q, k, v, causal, scale, varlen)

    def block_backward(self, dout, q, k, v, out, lse, *, causal, scale, varlen=None):
        return dense_backward(_square_backward, dout, q, k, v, out, lse, causal, scale, varlen)
