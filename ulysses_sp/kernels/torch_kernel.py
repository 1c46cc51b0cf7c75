"""``torch``: PyTorch's own fused attention ops, called directly (no SDPA dispatch).

* CPU: ``_scaled_dot_product_flash_attention_for_cpu`` and its backward: any float dtype,
  GQA without repeating K/V, lse in fp32 (fp64 for fp64). It returns out 0 and lse 0
  rather than NaN for a row holding an inf (torch 2.13), so blocks with non-finite q or
  k go to the math kernel, which propagates NaN as one-process attention does.
* CUDA fp16/bf16: ``_scaled_dot_product_flash_attention`` and its backward (flash-attn 2
  inside torch: GQA without repeating K/V; +inf lse for empty rows, as flash-attn).
* CUDA fp32: ``_scaled_dot_product_efficient_attention`` with ``compute_log_sumexp``; it
  needs K/V repeated to the q heads and pads its lse to a multiple of 32 rows.

The ops take ``[B, H, S, D]``: the ``[B, S, H, D]`` tensors are passed as transposed
views. Their causal masks are top-left aligned and none has a varlen form, so sequences
loop inside the kernel (``common.tiled_forward``), a causal block with more keys than
queries is a visible prefix and a square diagonal, merged, and rows that see no key are
never handed to an op (it would write lse 0 on CPU, where the contract says -inf).

Windows: on CPU and for CUDA fp32 the ops take an additive mask, so the queries go in
tiles of `TILE` rows, each with the contiguous keys its rows can see and a
``[TILE, keys]`` mask (padded to 16 keys for the memory-efficient op, which reads its
rows aligned); memory O(TILE x (TILE + window)). CUDA fp16/bf16 pass the window to
``_flash_attention_forward``/``_backward`` (``window_size_left/right``: flash-attn's
own, which clips a side >= Sk and so is only exact for Sq <= Sk + 1 in a block:
``common.tiled_forward`` cuts taller blocks into tiles of Sk + 1 rows). Soft-capping:
no fused op has it, so soft-capped blocks run the math kernel's square over tiles of
`TILE` query rows (fp32 scores of one tile at a time).

Meta tensors take the CUDA path (those ops have meta kernels), so a meta-device run
shows the CUDA calls' shapes and memory without a GPU. Only a GPU confirms the numbers:
torch's window semantics in ``_flash_attention_forward`` (flash-attn 2's, bottom-right),
and the memory-efficient kernel with a mask that hides whole key blocks from a row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import math_kernel
from .common import accumulator_dtype, last_dim_contiguous, merge_partials, repeat_kv, tiled_backward, tiled_forward, visible

__all__ = ["TorchKernel"]

aten = torch.ops.aten
_CUDA_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TILE = 128
"""Query rows per tile where a window or soft-capping needs explicit masks or scores."""


def _bhsd(*tensors):
    return [t.transpose(1, 2) for t in tensors]


def _finite(q, k) -> bool:
    """Whether q and k hold no inf or NaN: one fp32 sum each, which any of them makes non-finite
    (a pass over the data, ~15x cheaper on CPU than ``isfinite().all()``, which took ~4% of a
    4k-token fwd+bwd). A finite block whose sum overflows (values near 1e38) reads as non-finite
    and goes to the math kernel: slower, still exact."""
    return bool(torch.isfinite(q.sum(dtype=torch.float32) + k.sum(dtype=torch.float32)))


def _fold(g, kv_heads):  # [B, S, Hq, D] gradient of repeated K/V -> [B, S, Hkv, D]
    return g if g.shape[2] == kv_heads else g.unflatten(2, (kv_heads, -1)).sum(3)


def _no_rng(q):
    """philox seed/offset (rng_state/unused) of the CUDA flash op: unused without dropout."""
    return torch.empty(2, dtype=torch.uint64, device=q.device), torch.empty((), dtype=torch.uint64, device=q.device)


def _bias(q, k, window):
    """The window as an additive ``[B, Hq, Sq, Sk]`` mask in q's dtype, rows padded to 16 keys."""
    sq, sk = q.shape[1], k.shape[1]
    bias = q.new_zeros(sq, sk + (-sk % 16))[:, :sk]
    bias.masked_fill_(~visible(sq, sk, window, q.device), float("-inf"))
    return bias.expand(q.shape[0], q.shape[2], sq, sk)


def _op_forward(q, k, v, causal, scale, bias=None):
    """One fused op call, top-left causal mask; ``bias`` (CPU and fp32 only) instead of it."""
    if q.device.type == "cpu":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(*_bhsd(q, k, v), 0.0, causal, attn_mask=bias, scale=scale)
        return out.transpose(1, 2), lse
    if q.dtype == torch.float32:
        hq = q.shape[2]
        out, lse = aten._scaled_dot_product_efficient_attention(*_bhsd(q, repeat_kv(k, hq), repeat_kv(v, hq)), bias, True, 0.0, causal, scale=scale)[:2]
        return out.transpose(1, 2), lse[..., : q.shape[1]]
    out, lse = aten._scaled_dot_product_flash_attention(*_bhsd(q, k, v), 0.0, causal, False, scale=scale)[:2]
    return out.transpose(1, 2), torch.where(torch.isposinf(lse), float("-inf"), lse)


def _op_backward(dout, q, k, v, out, lse, causal, scale, bias=None):
    if q.device.type == "cpu":
        grads = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            *_bhsd(dout, q, k, v, out), lse.contiguous(), 0.0, causal, attn_mask=bias, scale=scale
        )
        return [g.transpose(1, 2) for g in grads]
    sq, sk = q.shape[1], k.shape[1]
    if q.dtype == torch.float32:
        no_rng = torch.empty((), dtype=torch.int64, device=q.device)  # philox seed/offset: unused without dropout
        hq, hkv = q.shape[2], k.shape[2]
        lse_padded = F.pad(lse, (0, -sq % 32))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            *_bhsd(dout, q, repeat_kv(k, hq), repeat_kv(v, hq)), bias, out.transpose(1, 2), lse_padded, no_rng, no_rng, 0.0,
            [True, True, True, False], causal, scale=scale,
        )
        return dq.transpose(1, 2), _fold(dk.transpose(1, 2), hkv), _fold(dv.transpose(1, 2), hkv)
    lse = torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()  # flash-attn's mark of an empty row
    grads = aten._scaled_dot_product_flash_attention_backward(
        *_bhsd(dout, q, k, v, out), lse, None, None, sq, sk, 0.0, causal, *_no_rng(q), scale=scale
    )
    return [g.transpose(1, 2) for g in grads]


def _causal_forward(q, k, v, causal, scale):
    """The ops' top-left causal mask, bottom-right: Sk > Sq splits into a visible prefix and
    a square diagonal, merged (the tiles never hand it Sq > Sk)."""
    sq, sk = q.shape[1], k.shape[1]
    if not causal or sq == sk:
        return _op_forward(q, k, v, causal, scale)
    p = sk - sq
    out, lse = merge_partials(None, None, *_op_forward(q, k[:, :p], v[:, :p], False, scale))
    out, lse = merge_partials(out, lse, *_op_forward(q, k[:, p:], v[:, p:], True, scale))
    return out.to(q.dtype), lse


def _causal_backward(dout, q, k, v, out, lse, causal, scale):
    sq, sk = q.shape[1], k.shape[1]
    if not causal or sq == sk:
        return _op_backward(dout, q, k, v, out, lse, causal, scale)
    p = sk - sq
    dq1, dk1, dv1 = _op_backward(dout, q, k[:, :p], v[:, :p], out, lse, False, scale)
    dq2, dk2, dv2 = _op_backward(dout, q, k[:, p:], v[:, p:], out, lse, True, scale)
    return (dq1.to(accumulator_dtype(q.dtype)) + dq2).to(q.dtype), torch.cat([dk1, dk2], 1), torch.cat([dv1, dv2], 1)


def _math(q, k, softcap) -> bool:
    """Whether a block goes to the math kernel: soft-capped, or non-finite on CPU."""
    return bool(softcap) or (q.device.type == "cpu" and not _finite(q, k))


def _square_forward(q, k, v, window, scale, softcap):
    if _math(q, k, softcap):
        return math_kernel.square_forward(q, k, v, window, scale, softcap)
    left, right = window
    if left < 0 and right <= 0:  # no mask, or causal
        return _causal_forward(q, k, v, right == 0, scale)
    if q.device.type == "cpu" or q.dtype == torch.float32:
        return _op_forward(q, k, v, False, scale, _bias(q, k, window))
    return aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, False, False, scale=scale, window_size_left=left, window_size_right=right
    )[:2]


def _square_backward(dout, q, k, v, out, lse, window, scale, softcap):
    if _math(q, k, softcap):
        return math_kernel.square_backward(dout, q, k, v, out, lse, window, scale, softcap)
    left, right = window
    if left < 0 and right <= 0:
        return _causal_backward(dout, q, k, v, out, lse, right == 0, scale)
    if q.device.type == "cpu" or q.dtype == torch.float32:
        return _op_backward(dout, q, k, v, out, lse, False, scale, _bias(q, k, window))
    return aten._flash_attention_backward(
        dout, q, k, v, out, lse.contiguous(), None, None, q.shape[1], k.shape[1], 0.0, False, *_no_rng(q),
        scale=scale, window_size_left=left, window_size_right=right,
    )


def _tile(device, dtype, softcap):
    """Rows per query tile of one sequence: all of them where the op masks natively."""

    def rows(sq, sk, window):
        if not softcap and window[0] < 0 and window[1] <= 0:
            return sq
        if not softcap and device.type != "cpu" and dtype != torch.float32:
            return sk + 1  # flash-attn's window is exact up to Sq = Sk + 1
        return TILE

    return rows


class TorchKernel:
    name = "torch"

    def problem(self, dtype, device, head_dim) -> str | None:
        if device.type == "cpu":
            return None
        if device.type in ("cuda", "meta"):
            return None if dtype in _CUDA_DTYPES else f"torch's fused CUDA ops take fp16, bf16 or fp32, not {dtype}"
        return f"torch's fused ops run on CPU or CUDA, not {device.type}"

    def block_forward(self, q, k, v, *, causal, scale, varlen=None, window=None, softcap=0.0):
        tile = _tile(q.device, q.dtype, softcap)
        return tiled_forward(_square_forward, tile, *last_dim_contiguous(q, k, v), causal, scale, varlen, window, softcap)

    def block_backward(self, dout, q, k, v, out, lse, *, causal, scale, varlen=None, window=None, softcap=0.0):
        tile = _tile(q.device, q.dtype, softcap)
        return tiled_backward(_square_backward, tile, *last_dim_contiguous(dout, q, k, v, out), lse, causal, scale, varlen, window, softcap)
