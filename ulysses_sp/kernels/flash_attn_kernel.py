"""``flash_attn``: flash-attn 2.x through its private forward/backward functions.

The private functions return the log-sum-exp that block-wise backends merge with,
and take the final out/lse in the backward. Their signatures changed in 2.7: 2.6 takes
``window_size=(left, right)`` and returns 8 values (padded copies of q, k, v and out
among them); 2.7 and later take ``window_size_left``/``window_size_right``, return
4 values, and write dq/dk/dv into the buffers given. Which one is installed is read
from ``flash_attn.__version__`` once per imported module.

``import flash_attn`` happens at use, never at import, and nothing here checks the
device: flash-attn itself rejects what it cannot run, and a fake module put in
``sys.modules`` (``ulysses_sp.testing.fake_flash_attn``) runs this code on CPU tensors.
Head dims are padded to a multiple of 8 as flash-attn's own wrappers do; lse of an
empty row, +inf in flash-attn, is -inf in the kernel contract (and back).

Windows and soft-capping go to flash-attn as they are (its ``window_size`` is the
contract's, bottom-right aligned, within each packed sequence), except where flash-attn's
host code reads a window differently: it clips a side >= seqlen_k (``max_seqlen_k`` for
varlen) to -1 and gives a one-sided window seqlen_k on its open side, which wrongly
bounds rows of a sequence with Sq > seqlen_k + 1 (a non-causal window open to the right
or wider than seqlen_k). Such calls run per sequence in query tiles of Sk + 1 rows over
the keys each tile sees (``common.tiled_forward``), where both readings agree.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from .common import last_dim_contiguous, tiled_backward, tiled_forward

__all__ = ["FlashAttnKernel"]

_DTYPES = (torch.float16, torch.bfloat16)


def _pad8(t: torch.Tensor) -> torch.Tensor:
    return F.pad(t, (0, -t.shape[-1] % 8)) if t.shape[-1] % 8 else t


def _to_contract(lse):
    return torch.where(torch.isposinf(lse), float("-inf"), lse)


def _to_flash(lse):
    return torch.where(torch.isneginf(lse), float("inf"), lse).contiguous()


def _exact(causal, window, max_q, max_k) -> bool:
    """Whether flash-attn's reading of ``window`` (see the module docstring) is the contract's
    for every sequence of a call whose longest ones have ``max_q`` queries, ``max_k`` keys."""
    left, right = window
    return causal or max_q <= max_k + 1 or 0 <= right < max_k or (right < 0 and (left < 0 or left >= max_k))


def _tile(sq, sk, window):
    return sk + 1  # within Sq <= Sk + 1, flash-attn's window is the contract's


def _tokens(t: torch.Tensor) -> torch.Tensor:
    """``[B, S, H, D]`` -> varlen ``[B*S, H, D]`` (a view for one batch row)."""
    return t[0] if t.shape[0] == 1 else t.reshape(-1, *t.shape[2:])


class FlashAttnKernel:
    name = "flash_attn"

    def __init__(self) -> None:
        self._loaded = None  # (flash_attn module, what _interface returns)

    def problem(self, dtype, device, head_dim) -> str | None:
        try:
            self._interface()
        except ImportError:
            return "flash-attn is not installed (pip install flash-attn, or the `cuda` extra)"
        if dtype not in _DTYPES:
            return f"flash-attn takes fp16 or bf16, not {dtype}"
        if head_dim > 256:
            return f"flash-attn takes head dims up to 256, not {head_dim}"
        return None

    def _interface(self):
        """(flash_attn_interface, ``args(window, softcap)``: the window/softcap arguments, where a
        forward returns the lse): 2.7+ ``left, right, softcap`` and (out, lse, ...); 2.6
        ``(left, right), softcap`` and (out, q, k, v, out_padded, lse, ...)."""
        import flash_attn

        if self._loaded is None or self._loaded[0] is not flash_attn:
            from flash_attn import flash_attn_interface

            version = tuple(int(x) for x in re.match(r"(\d+)\.(\d+)", flash_attn.__version__).groups())
            if version[0] != 2:
                raise ImportError(f"ulysses-sp's flash_attn kernel needs flash-attn 2.x, found {flash_attn.__version__}")
            if version >= (2, 7):
                self._loaded = (flash_attn, flash_attn_interface, lambda w, c: (*w, c), 1)
            else:
                self._loaded = (flash_attn, flash_attn_interface, lambda w, c: (tuple(w), c), 5)
        return self._loaded[1:]

    def _square_forward(self, q, k, v, window, scale, softcap, causal=False):
        fa, args, lse_at = self._interface()
        res = fa._flash_attn_forward(_pad8(q), _pad8(k), _pad8(v), 0.0, scale, causal, *args(window, softcap), None, False)
        return res[0][..., : q.shape[-1]], _to_contract(res[lse_at])

    def _square_backward(self, dout, q, k, v, out, lse, window, scale, softcap, causal=False):
        fa, args, _ = self._interface()
        padded = [_pad8(t) for t in (dout, q, k, v, out)]
        grads = [torch.empty_like(t) for t in padded[1:4]]
        fa._flash_attn_backward(*padded, _to_flash(lse), *grads, 0.0, scale, causal, *args(window, softcap), None, False, None)
        return [g[..., : q.shape[-1]] for g in grads]

    def block_forward(self, q, k, v, *, causal, scale, varlen=None, window=None, softcap=0.0):
        q, k, v = last_dim_contiguous(q, k, v)
        window = window or (-1, -1)
        if not _exact(causal, window, *((varlen.max_q, varlen.max_k) if varlen else (q.shape[1], k.shape[1]))):
            return tiled_forward(self._square_forward, _tile, q, k, v, causal, scale, varlen, window, softcap)
        if varlen is None:
            return self._square_forward(q, k, v, window, scale, softcap, causal)
        fa, args, lse_at = self._interface()
        b, sq, d = q.shape[0], q.shape[1], q.shape[-1]
        res = fa._flash_attn_varlen_forward(
            _pad8(_tokens(q)), _pad8(_tokens(k)), _pad8(_tokens(v)), varlen.cu_q, varlen.cu_k, varlen.max_q, varlen.max_k,
            0.0, scale, causal, *args(window, softcap), None, False,
        )
        out, lse = res[0], res[lse_at]  # lse is [H, B*Sq] for varlen calls
        return out[..., :d].view(b, sq, *out.shape[1:-1], d), _to_contract(lse).view(-1, b, sq).transpose(0, 1)

    def block_backward(self, dout, q, k, v, out, lse, *, causal, scale, varlen=None, window=None, softcap=0.0):
        dout, q, k, v, out = last_dim_contiguous(dout, q, k, v, out)
        window = window or (-1, -1)
        if not _exact(causal, window, *((varlen.max_q, varlen.max_k) if varlen else (q.shape[1], k.shape[1]))):
            return tiled_backward(self._square_backward, _tile, dout, q, k, v, out, lse, causal, scale, varlen, window, softcap)
        if varlen is None:
            return self._square_backward(dout, q, k, v, out, lse, window, scale, softcap, causal)
        fa, args, _ = self._interface()
        b, sq, sk, d = q.shape[0], q.shape[1], k.shape[1], q.shape[-1]
        padded = [_pad8(_tokens(t)) for t in (dout, q, k, v, out)]
        grads = [torch.empty_like(t) for t in padded[1:4]]
        lse_tokens = _to_flash(lse.transpose(0, 1).reshape(lse.shape[1], -1))
        fa._flash_attn_varlen_backward(
            *padded, lse_tokens, *grads, varlen.cu_q, varlen.cu_k, varlen.max_q, varlen.max_k, 0.0, scale, causal,
            *args(window, softcap), None, False, None,
        )
        dq, dk, dv = (g[..., :d] for g in grads)
        return dq.view(b, sq, *dq.shape[1:]), dk.view(b, sk, *dk.shape[1:]), dv.view(b, sk, *dv.shape[1:])
