"""A CPU fake of flash-attn 2.x's Python API, for testing code that calls flash-attn.

``install(version)`` puts fake ``flash_attn`` and ``flash_attn.flash_attn_interface``
modules into ``sys.modules``. They hold the four private functions
(``_flash_attn_forward``, ``_flash_attn_varlen_forward``, ``_flash_attn_backward``,
``_flash_attn_varlen_backward``) with the signatures and return conventions of that
version, and the public ``flash_attn_func`` / ``flash_attn_varlen_func``.

What is mirrored from flash-attn (v2.6.3 and v2.8.3 ``flash_attn_interface.py``, and
``csrc/flash_attn/flash_api.cpp``, ``src/mask.h``, ``src/softmax.h``):

* the C++ argument checks, raising RuntimeError with flash-attn's own messages; the
  Python wrappers' ``maybe_contiguous`` runs first, so q/k/v/out/dout with a strided last
  dim are copied, not rejected (dq/dk/dv are not copied, so they are checked);
* the host-side window normalisation: a side >= seqlen_k (``max_seqlen_k`` for varlen)
  becomes -1, causal sets right = 0, and a one-sided window gets seqlen_k (again
  ``max_seqlen_k`` for varlen) on its negative side. The mask is bottom-right aligned per
  sequence: key j is visible to query i iff
  ``i + Sk - Sq - left <= j <= i + Sk - Sq + right`` (no mask when both sides are -1);
* a query row that sees no key (or seqlen_k = 0) gets out = 0 and lse = +inf;
* GQA (q head h reads kv head h // (H / Hkv)) and softcap ``c * tanh(s / c)``;
* the backward recomputes P = exp(scores - lse) and uses D = rowsum(dout * out),
  the flash-attn recipe, and returns ``softmax_d`` (D) in the real layout.

Numerics run in fp32 from the fp16/bf16 inputs; outputs are cast back, lse is fp32.
Dropout, ALiBi, paged KV (``block_table``), ``leftpad_k`` and ``seqused_k`` raise
NotImplementedError. Where the real kernel would read or write out of bounds or leave
rows unwritten (bad cu_seqlens, lengths above max_seqlen, an lse of the wrong shape), the
fake raises RuntimeError with a message starting "fake flash-attn:" instead.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.machinery
import inspect
import math
import re
import sys
import types

import torch
import torch.nn.functional as F

__all__ = ["FakeFlashAttn", "install"]

_INF = math.inf
_PRIVATE = ("_flash_attn_forward", "_flash_attn_varlen_forward", "_flash_attn_backward", "_flash_attn_varlen_backward")


# --------------------------------------------------------------------------- checks


def _check(cond: bool, msg: str) -> None:
    """TORCH_CHECK: flash-attn's C++ checks surface in Python as RuntimeError."""
    if not cond:
        raise RuntimeError(msg)


def _check_shape(name: str, t: torch.Tensor, dims: str, *sizes: int) -> None:
    """CHECK_SHAPE, with the macro's message: ``k must have shape (batch_size, ...)``."""
    _check(tuple(t.shape) == sizes, f"{name} must have shape ({dims})")


def _unsupported(dropout_p, **optional) -> None:
    """What the fake does not model: dropout, and the optional tensors (ALiBi, paged KV, ...)."""
    if dropout_p != 0:
        raise NotImplementedError(f"fake flash-attn: dropout_p={dropout_p} is not supported (only 0.0)")
    for name, value in optional.items():
        if value is not None:
            raise NotImplementedError(f"fake flash-attn: {name} is not supported (only None)")


def _maybe_contiguous(x):
    return x.contiguous() if x is not None and x.stride(-1) != 1 else x


def _check_rank(n: int, **tensors) -> None:
    for name, t in tensors.items():
        _check(t.dim() == n, f"fake flash-attn: {name} must be {n}-dimensional, got shape {tuple(t.shape)}")


def _check_dtypes(q, k, v, out=None, dout=None) -> None:
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype, "query and key must have the same dtype")
    _check(v.dtype == q.dtype, "query and value must have the same dtype")
    for name, t in (("out", out), ("dout", dout)):
        _check(t is None or t.dtype == q.dtype, f"query and {name} must have the same dtype")


def _check_sizes(batch: int, head_size: int, heads: int, heads_k: int, forward: bool, multiple_of_8: bool) -> None:
    """Batch, head-dim and head-count checks, in mha_fwd / mha_bwd order."""
    _check(batch > 0, "batch size must be positive")
    if forward:
        _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
        if multiple_of_8:
            _check(head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8")
    else:
        _check(head_size % 8 == 0, "head_size should be a multiple of 8")
        _check(head_size <= 256, "FlashAttention backward only supports head dimension at most 256")
    _check(heads_k > 0 and heads % heads_k == 0, "Number of heads in key/value must divide number of heads in query")


def _check_grads(dq, dk, dv, q, k, v, dims_q: str, dims_k: str) -> list[torch.Tensor]:
    """The given dq/dk/dv buffers (checked like mha_bwd), or new ones."""
    grads = []
    for name, g, like, dims in (("dq", dq, q, dims_q), ("dk", dk, k, dims_k), ("dv", dv, v, dims_k)):
        if g is None:
            g = torch.empty_like(like)
        else:
            _check(g.dtype == q.dtype, f"{name} must have the same dtype as q")
            _check(g.stride(-1) == 1, f"{name} must have contiguous last dimension")
            _check_shape(name, g, dims, *like.shape)
        grads.append(g)
    return grads


def _check_cu_seqlens(cu_q, cu_k) -> int:
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _check(cu.dtype == torch.int32, f"{name} must have dtype int32")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        _check(cu.is_contiguous(), f"{name} must be contiguous")
    return cu_q.numel() - 1


def _bounds(cu: torch.Tensor, total: int, max_seqlen: int, name: str) -> list[int]:
    """cu_seqlens read on the host; the fake refuses what would be out of bounds on a GPU."""
    c = cu.tolist()
    ok = c[0] >= 0 and c[-1] <= total and all(a <= b for a, b in zip(c, c[1:]))
    _check(ok, f"fake flash-attn: cu_seqlens_{name} must be non-decreasing within [0, total_{name}={total}], got {c}")
    longest = max(b - a for a, b in zip(c, c[1:]))
    _check(longest <= max_seqlen, f"fake flash-attn: a sequence of length {longest} exceeds max_seqlen_{name}="
           f"{max_seqlen} (the real kernel sizes its grid by max_seqlen and may skip part of it)")
    return c


def _check_lse(lse: torch.Tensor, *shape: int) -> None:
    """flash-attn reads lse through a raw pointer: a wrong shape/dtype/layout is garbage there."""
    _check(lse.dtype == torch.float32 and tuple(lse.shape) == shape and lse.is_contiguous(),
           f"fake flash-attn: softmax_lse must be a contiguous fp32 tensor of shape {shape}, "
           f"got {lse.dtype} {tuple(lse.shape)}")


# --------------------------------------------------------------------------- numerics


def _window(causal: bool, left: int, right: int, seqlen_k: int) -> tuple[int, int]:
    """The (left, right) the kernel masks with: mha_*fwd/bwd, then set_params_fprop.

    ``seqlen_k`` is ``max_seqlen_k`` for varlen calls, as in the C++ (not each sequence's
    own length). After this both sides are -1 (no mask) or both are >= 0.
    """
    if left >= seqlen_k:
        left = -1
    if right >= seqlen_k:
        right = -1
    if causal:
        right = 0
    if left < 0 and right >= 0:
        left = seqlen_k
    if left >= 0 and right < 0:
        right = seqlen_k
    return left, right


def _keep(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor | None:
    """[sq, sk] visibility of mask.h (bottom-right aligned); None when nothing is masked."""
    left, right = window
    if left < 0 and right < 0:
        return None
    diag = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    return (j >= diag - left) & (j <= diag + right)


def _heads_first(q, k, v):
    """fp32 [N, H, S, D] views, k/v repeated so q head h meets kv head h // (H / Hkv)."""
    group = q.shape[2] // k.shape[2]
    return (q.float().transpose(1, 2), k.float().repeat_interleave(group, 2).transpose(1, 2),
            v.float().repeat_interleave(group, 2).transpose(1, 2))


def _scores(q, k, scale, softcap, keep):
    """Masked (and soft-capped) scores, plus tanh(s / softcap) for the backward's chain rule."""
    s = scale * (q @ k.transpose(-1, -2))
    t = None
    if softcap > 0:
        t = torch.tanh(s / softcap)
        s = softcap * t
    if keep is not None:
        s = s.masked_fill(~keep, -_INF)
    return s, t


def _forward_core(q, k, v, scale, softcap, keep):
    """q [N, Sq, H, D], k/v [N, Sk, Hkv, D] -> out fp32 [N, Sq, H, D], lse fp32 [N, H, Sq]."""
    qf, kf, vf = _heads_first(q, k, v)
    s, _ = _scores(qf, kf, scale, softcap, keep)
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(lse == -_INF, _INF)  # softmax.h: a row summing to 0 stores +inf
    p = torch.exp(s - lse[..., None])  # exactly 0 on those rows
    return (p @ vf).transpose(1, 2), lse


def _backward_core(dout, q, k, v, out, lse, scale, softcap, keep):
    """flash-attn's backward recipe; returns fp32 dq, dk, dv (GQA groups summed) and D."""
    qf, kf, vf = _heads_first(q, k, v)
    do, o = dout.float().transpose(1, 2), out.float().transpose(1, 2)
    s, t = _scores(qf, kf, scale, softcap, keep)
    p = torch.exp(s - lse[..., None])  # 0 where masked and on lse = +inf rows
    delta = (do * o).sum(-1)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vf.transpose(-1, -2) - delta[..., None])
    if t is not None:
        ds = ds * (1 - t * t)
    dq = scale * (ds @ kf)
    dk = scale * (ds.transpose(-1, -2) @ qf)
    n, h, sk, d = dk.shape
    hkv = k.shape[2]
    dk = dk.view(n, hkv, h // hkv, sk, d).sum(2)
    dv = dv.view(n, hkv, h // hkv, sk, d).sum(2)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2), delta


def _round128(x: int) -> int:
    return (x + 127) // 128 * 128


def _pad_to(t: torch.Tensor, d: int) -> torch.Tensor:
    return F.pad(t, (0, d - t.shape[-1])) if t.shape[-1] != d else t


def _dense_forward(q, k, v, dropout_p, scale, causal, window, softcap, alibi_slopes, return_softmax, legacy):
    """mha_fwd. Returns out (q's dtype, head dim rounded up to 8 for legacy) and lse [B, H, Sq]."""
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    _check_dtypes(q, k, v)
    _check_rank(4, q=q, k=k, v=v)
    (b, sq, h, d), (sk, hkv) = q.shape, k.shape[1:3]
    _check_sizes(b, d, h, hkv, forward=True, multiple_of_8=not legacy)
    dims = "batch_size, seqlen_k, num_heads_k, " + ("head_size_og" if legacy else "head_size")
    _check_shape("k", k, dims, b, sk, hkv, d)
    _check_shape("v", v, dims, b, sk, hkv, d)
    _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    keep = _keep(sq, sk, _window(causal, *window, sk), q.device)
    out, lse = _forward_core(q, k, v, scale, softcap, keep)
    return _pad_to(out.to(q.dtype), -(-d // 8) * 8), lse


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap,
                    alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k, zero_tensors, legacy):
    """mha_varlen_fwd, one sequence of cu_seqlens at a time. Returns out and lse [H, total_q]."""
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes, block_table=block_table,
                 leftpad_k=leftpad_k, seqused_k=seqused_k)
    q, k, v = [_maybe_contiguous(x) for x in (q, k, v)]
    _check_dtypes(q, k, v)
    batch = _check_cu_seqlens(cu_q, cu_k)
    _check_rank(3, q=q, k=k, v=v)
    (total_q, h, d), (total_k, hkv) = q.shape, k.shape[:2]
    _check_sizes(batch, d, h, hkv, forward=True, multiple_of_8=not legacy)
    dims = "total_k, num_heads_k, " + ("head_size_og" if legacy else "head_size")
    _check_shape("k", k, dims, total_k, hkv, d)
    _check_shape("v", v, dims, total_k, hkv, d)
    _check_shape("cu_seqlens_q", cu_q, "batch_size + 1", batch + 1)
    _check_shape("cu_seqlens_k", cu_k, "batch_size + 1", batch + 1)
    _check(not return_softmax, "return_softmax is only supported when p_dropout > 0.0")
    cq, ck = _bounds(cu_q, total_q, max_q, "q"), _bounds(cu_k, total_k, max_k, "k")
    # Rows outside every sequence: the kernel never writes them (zero_tensors pre-fills 0 / -inf).
    out = torch.zeros(q.shape, device=q.device)
    lse = torch.full((h, total_q), -_INF, device=q.device)
    if max_k <= 0:  # the C++ skips the kernel and marks every row empty
        lse.fill_(_INF)
    else:
        window = _window(causal, *window, max_k)
        for i in range(batch):
            (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
            if q1 > q0:
                o, l = _forward_core(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], scale, softcap,
                                     _keep(q1 - q0, k1 - k0, window, q.device))
                out[q0:q1], lse[:, q0:q1] = o[0], l[0]
    return _pad_to(out.to(q.dtype), -(-d // 8) * 8), lse


def _check_backward(dout, q, k, v, out, lse, dq, dk, dv, batch, legacy, lse_shape, varlen):
    """mha_bwd / mha_varlen_bwd checks after the dtypes; returns the dq, dk, dv to fill."""
    d = q.shape[-1]
    _check_sizes(batch, d, q.shape[-2], k.shape[-2], forward=False, multiple_of_8=True)
    if legacy:  # 2.6 takes an unpadded dout
        _check(d == -(-dout.shape[-1] // 8) * 8, "head_size must be head_size_og rounded to a multiple of 8")
    rows_q, rows_k = ("total_q", "total_k") if varlen else ("batch_size, seqlen_q", "batch_size, seqlen_k")
    dims_q, dims_k = f"{rows_q}, num_heads, head_size", f"{rows_k}, num_heads_k, head_size"
    shape_k = (*q.shape[:-3], *k.shape[-3:-1], d)  # q's batch (dense), k's rows and heads
    _check_shape("k", k, dims_k, *shape_k)
    _check_shape("v", v, dims_k, *shape_k)
    _check_shape("out", out, dims_q, *q.shape)
    _check_shape("dout", dout, dims_q + "_og" * legacy, *q.shape[:-1], dout.shape[-1] if legacy else d)
    _check_lse(lse, *lse_shape)
    return _check_grads(dq, dk, dv, q, k, v, dims_q, dims_k)


def _dense_backward(dout, q, k, v, out, lse, dq, dk, dv, dropout_p, scale, causal, window, softcap,
                    alibi_slopes, legacy):
    """mha_bwd: fills dq, dk, dv (given or new) and returns them with softmax_d [B, H, Sq rounded]."""
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    _check_dtypes(q, k, v, out, dout)
    _check_rank(4, q=q, k=k, v=v, out=out, dout=dout)
    (b, sq, h, d), sk = q.shape, k.shape[1]
    dq, dk, dv = _check_backward(dout, q, k, v, out, lse, dq, dk, dv, b, legacy, (b, h, sq), varlen=False)
    keep = _keep(sq, sk, _window(causal, *window, sk), q.device)
    gq, gk, gv, delta = _backward_core(_pad_to(dout, d), q, k, v, out, lse, scale, softcap, keep)
    for g, val in ((dq, gq), (dk, gk), (dv, gv)):
        g.copy_(val)
    softmax_d = torch.zeros(b, h, _round128(sq), device=q.device)
    softmax_d[..., :sq] = delta
    return dq, dk, dv, softmax_d


def _varlen_backward(dout, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, max_q, max_k, dropout_p, scale,
                     causal, window, softcap, alibi_slopes, legacy):
    """mha_varlen_bwd, one sequence at a time; softmax_d is [H, total_q + 128 * batch]."""
    _unsupported(dropout_p=dropout_p, alibi_slopes=alibi_slopes)
    dout, q, k, v, out = [_maybe_contiguous(x) for x in (dout, q, k, v, out)]
    _check_dtypes(q, k, v, out, dout)
    batch = _check_cu_seqlens(cu_q, cu_k)
    _check_rank(3, q=q, k=k, v=v, out=out, dout=dout)
    (total_q, h, d), total_k = q.shape, k.shape[0]
    dq, dk, dv = _check_backward(dout, q, k, v, out, lse, dq, dk, dv, batch, legacy, (h, total_q), varlen=True)
    _check_shape("cu_seqlens_q", cu_q, "batch_size + 1", batch + 1)
    _check_shape("cu_seqlens_k", cu_k, "batch_size + 1", batch + 1)
    cq, ck = _bounds(cu_q, total_q, max_q, "q"), _bounds(cu_k, total_k, max_k, "k")
    dout = _pad_to(dout, d)
    grads = [torch.zeros(t.shape, device=q.device) for t in (q, k, v)]
    softmax_d = torch.zeros(h, total_q + 128 * batch, device=q.device)
    delta = (dout.float() * out.float()).sum(-1).T  # the dot(dO, O) pre-pass covers every row
    window = _window(causal, *window, max_k)
    for i in range(batch):
        (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
        softmax_d[:, q0 + 128 * i:q1 + 128 * i] = delta[:, q0:q1]
        if q1 > q0 and k1 > k0:
            res = _backward_core(dout[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                 out[None, q0:q1], lse[None, :, q0:q1], scale, softcap,
                                 _keep(q1 - q0, k1 - k0, window, q.device))
            for g, val, (a, z) in zip(grads, res, ((q0, q1), (k0, k1), (k0, k1))):
                g[a:z] = val[0]
    for g, val in zip((dq, dk, dv), grads):
        g.copy_(val)
    return dq, dk, dv, softmax_d


def _no_s_dmask(q):
    """S_dmask when return_softmax is off: empty in 2.7+ (2.6 returns None)."""
    return torch.empty((0,), dtype=q.dtype, device=q.device)


def _rng_state(q):
    return torch.zeros(2, dtype=torch.int64, device=q.device)


# --------------------------------------------------------------------------- private APIs


class _Modern:
    """2.7+ private functions: window_size_left/right, 4-value forwards, and backwards that
    write dq/dk/dv in place and return only softmax_d. Head dims must be multiples of 8."""

    @staticmethod
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                            softcap, alibi_slopes, return_softmax):
        out, lse = _dense_forward(q, k, v, dropout_p, softmax_scale, causal, (window_size_left, window_size_right),
                                  softcap, alibi_slopes, return_softmax, legacy=False)
        return out, lse, _no_s_dmask(q), _rng_state(q)

    @staticmethod
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size_left=-1, window_size_right=-1, softcap=0.0,
                                   alibi_slopes=None, return_softmax=False, block_table=None, leftpad_k=None,
                                   seqused_k=None, zero_tensors=False):
        out, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, (window_size_left, window_size_right), softcap,
                                   alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k, zero_tensors,
                                   legacy=False)
        return out, lse, _no_s_dmask(q), _rng_state(q)

    @staticmethod
    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                             rng_state=None):
        return _dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                               (window_size_left, window_size_right), softcap, alibi_slopes, legacy=False)[3]

    @staticmethod
    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                    window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                    zero_tensors=False):
        return _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
                                (window_size_left, window_size_right), softcap, alibi_slopes, legacy=False)[3]


class _Legacy:
    """2.6.3 private functions: one window_size tuple; forwards pad the head dim in C++ and
    return (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state), S_dmask None unless
    return_softmax; backwards take padded q/k/v/out (dout may be unpadded), write into the
    dq/dk/dv given and return (dq, dk, dv, softmax_d)."""

    @staticmethod
    def _flash_attn_forward(q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                            return_softmax):
        out_padded, lse = _dense_forward(q, k, v, dropout_p, softmax_scale, causal, tuple(window_size), softcap,
                                         alibi_slopes, return_softmax, legacy=True)
        return _Legacy._outputs(q, k, v, out_padded, lse)

    @staticmethod
    def _flash_attn_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
                                   softmax_scale, causal, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                                   return_softmax=False, block_table=None, leftpad_k=None, seqused_k=None):
        out_padded, lse = _varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                          dropout_p, softmax_scale, causal, tuple(window_size), softcap,
                                          alibi_slopes, return_softmax, block_table, leftpad_k, seqused_k,
                                          False, legacy=True)
        return _Legacy._outputs(q, k, v, out_padded, lse)

    @staticmethod
    def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             window_size, softcap, alibi_slopes, deterministic, rng_state=None):
        return _dense_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                               tuple(window_size), softcap, alibi_slopes, legacy=True)

    @staticmethod
    def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size,
                                    softcap, alibi_slopes, deterministic, rng_state=None):
        return _varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, tuple(window_size),
                                softcap, alibi_slopes, legacy=True)

    @staticmethod
    def _outputs(q, k, v, out_padded, lse):
        """The 8 values of 2.6's forwards: q/k/v padded like out_padded (the inputs themselves
        when the head dim is already a multiple of 8), and out as a view of out_padded."""
        d, d_padded = q.shape[-1], out_padded.shape[-1]
        q, k, v = [_pad_to(_maybe_contiguous(x), d_padded) for x in (q, k, v)]
        out = out_padded[..., :d] if d != d_padded else out_padded
        return out, q, k, v, out_padded, lse, None, _rng_state(q)


def _drop_param(fn, name: str):
    """``fn`` without parameter ``name`` (2.7.0-2.7.2 varlen functions lack zero_tensors)."""
    sig = inspect.signature(fn)
    narrowed = sig.replace(parameters=[p for p in sig.parameters.values() if p.name != name])

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        narrowed.bind(*args, **kwargs)  # TypeError, as the real function would raise
        return fn(*args, **kwargs)

    wrapper.__signature__ = narrowed
    return wrapper


# --------------------------------------------------------------------------- public API


class _FlashAttnFunc(torch.autograd.Function):
    """FlashAttnFunc / FlashAttnVarlenFunc over the fake's private functions. 2.7+ pads the
    head dim to a multiple of 8 here (2.6 does it in C++); both save the padded tensors for
    the private backward and slice the gradients back."""

    @staticmethod
    def forward(ctx, q, k, v, fake, varlen, dropout_p, softmax_scale, causal, window_size, softcap,
                alibi_slopes, deterministic, return_softmax):
        fa, legacy = fake.interface, fake.legacy
        if softmax_scale is None:
            softmax_scale = q.shape[-1] ** (-0.5)
        d = q.shape[-1]
        if not legacy:
            q, k, v = [_pad_to(x, -(-d // 8) * 8) for x in (q, k, v)]
        window = (tuple(window_size),) if legacy else tuple(window_size)
        args = (dropout_p, softmax_scale, causal, *window, softcap, alibi_slopes, return_softmax and dropout_p > 0)
        if varlen is None:
            res = fa._flash_attn_forward(q, k, v, *args)
        else:
            res = fa._flash_attn_varlen_forward(q, k, v, *varlen[:4], *args, block_table=varlen[4])
        if legacy:
            out, q, k, v, out_padded, lse, s_dmask, rng_state = res
        else:
            out_padded, lse, s_dmask, rng_state = res
            out = out_padded[..., :d]
        ctx.save_for_backward(q, k, v, out_padded, lse, rng_state, *(varlen[:2] if varlen else ()))
        ctx.args = (fake, varlen[2:4] if varlen else None, dropout_p, softmax_scale, causal, window, softcap,
                    alibi_slopes, deterministic)
        return (out, lse, s_dmask) if return_softmax else out

    @staticmethod
    def backward(ctx, dout, *_):
        q, k, v, out, lse, rng_state, *cu_seqlens = ctx.saved_tensors
        fake, max_seqlens, dropout_p, scale, causal, window, softcap, alibi_slopes, deterministic = ctx.args
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        dout_padded = dout if fake.legacy else _pad_to(dout, q.shape[-1])
        args = (dropout_p, scale, causal, *window, softcap, alibi_slopes, deterministic)
        if cu_seqlens:
            fake.interface._flash_attn_varlen_backward(dout_padded, q, k, v, out, lse, dq, dk, dv, *cu_seqlens,
                                                       *max_seqlens, *args, rng_state=rng_state)
        else:
            fake.interface._flash_attn_backward(dout_padded, q, k, v, out, lse, dq, dk, dv, *args,
                                                rng_state=rng_state)
        d = dout.shape[-1]
        return (dq[..., :d], dk[..., :d], dv[..., :d]) + (None,) * 10


def _public(fake: FakeFlashAttn):
    """flash_attn_func and flash_attn_varlen_func (same signatures in 2.6.3 and 2.8.3)."""

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                        softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False):
        """q [B, Sq, H, D], k/v [B, Sk, Hkv, D] -> out [B, Sq, H, D]; with return_attn_probs
        (out, softmax_lse [B, H, Sq], S_dmask). Differentiable in q, k, v."""
        return _FlashAttnFunc.apply(q, k, v, fake, None, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_attn_probs)

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                               alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
        """q [total_q, H, D], k/v [total_k, Hkv, D], int32 cu_seqlens [batch + 1] -> out
        [total_q, H, D]; with return_attn_probs (out, softmax_lse [H, total_q], S_dmask)."""
        varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, block_table)
        return _FlashAttnFunc.apply(q, k, v, fake, varlen, dropout_p, softmax_scale, causal, window_size, softcap,
                                    alibi_slopes, deterministic, return_attn_probs)

    return flash_attn_func, flash_attn_varlen_func


# --------------------------------------------------------------------------- installing


def _parse_version(version: str) -> tuple[int, int]:
    m = re.fullmatch(r"2\.(\d+)\.(\d+)(?:\.post\d+)?", str(version))
    minor_patch = (int(m[1]), int(m[2])) if m else None
    if minor_patch is None or not (minor_patch == (6, 3) or minor_patch[0] in (7, 8)):
        raise ValueError(f"fake flash-attn supports versions 2.6.3, 2.7.x and 2.8.x, not {version!r}")
    return minor_patch


def _module(name: str, package: bool = False) -> types.ModuleType:
    """A module with a spec, so importlib.util.find_spec() finds it while installed."""
    module = types.ModuleType(name, "CPU fake of flash-attn (ulysses_sp.testing.fake_flash_attn).")
    module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=package)
    module.__fake__ = True  # what a caller checks before handing it CPU tensors (sp-bench's peers)
    if package:
        module.__path__ = []
    return module


class FakeFlashAttn:
    """The fake modules of one flash-attn version, and a record of the calls made to them.

    ``version``: the version string (``flash_attn.__version__``); ``legacy``: 2.6
    signatures; ``calls``: a Counter of calls by function name (public and private, the
    private ones the public functions make included); ``package`` / ``interface``: the
    ``flash_attn`` and ``flash_attn.flash_attn_interface`` modules.
    """

    def __init__(self, version: str = "2.8.3"):
        minor_patch = _parse_version(version)
        self.version = version
        self.legacy = minor_patch[0] == 6
        self.calls: collections.Counter = collections.Counter()
        self.package = _module("flash_attn", package=True)
        self.interface = _module("flash_attn.flash_attn_interface")
        self.package.__version__ = version
        self.package.flash_attn_interface = self.interface
        impl = _Legacy if self.legacy else _Modern
        for name in _PRIVATE:
            fn = getattr(impl, name)
            if not self.legacy and minor_patch < (7, 3) and "varlen" in name:
                fn = _drop_param(fn, "zero_tensors")  # added in 2.7.3
            setattr(self.interface, name, self._counted(fn))
        for fn in _public(self):
            setattr(self.interface, fn.__name__, self._counted(fn))
            setattr(self.package, fn.__name__, getattr(self.interface, fn.__name__))

    def reset(self) -> None:
        """Forget the calls counted so far."""
        self.calls.clear()

    def _counted(self, fn):
        return _Counted(fn, self.calls)


class _Counted:
    """``fn``, counting its calls. Not a plain function, like flash-attn 2.7+'s private functions
    (``torch.library`` custom ops, whose Python function is ``_init_fn``): callers that read
    their defaults, as ring-flash-attn does with ``inspect.getfullargspec``, find them there."""

    def __init__(self, fn, calls):
        self._init_fn = self.__wrapped__ = fn
        self.__name__, self.__doc__, self._calls = fn.__name__, fn.__doc__, calls

    def __call__(self, *args, **kwargs):
        self._calls[self.__name__] += 1
        return self._init_fn(*args, **kwargs)


_ABSENT = object()


@contextlib.contextmanager
def install(version: str = "2.8.3"):
    """Put a fake ``flash_attn`` and ``flash_attn.flash_attn_interface`` into sys.modules for
    the ``with`` block and yield its FakeFlashAttn; what was there before (or its absence)
    is restored on exit, exceptions included."""
    fake = FakeFlashAttn(version)
    modules = {"flash_attn": fake.package, "flash_attn.flash_attn_interface": fake.interface}
    saved = {name: sys.modules.get(name, _ABSENT) for name in modules}
    sys.modules.update(modules)
    try:
        yield fake
    finally:
        for name, old in saved.items():
            if old is _ABSENT:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = old
