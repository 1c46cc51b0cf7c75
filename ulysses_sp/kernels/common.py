"""What every kernel shares: the packed-sequence descriptor, the fp32 merge, and the
per-sequence loop and bottom-right split for kernels that lack a varlen form or a
bottom-right causal mask (each in O(tokens) memory)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

__all__ = ["Varlen", "accumulator_dtype", "merge_partials", "dense_forward", "dense_backward"]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results are kept in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class Varlen:
    """Packed sequences of one kernel call, the same packing for every batch row.

    ``lens_q[n]`` / ``lens_k[n]``: queries and keys of sequence n (0 allowed). ``cu_q`` /
    ``cu_k`` are flash-attn's int32 offsets over the batch flattened into tokens
    (``batch * len(lens) + 1`` entries), built once on the device (:meth:`build`) so no
    call uploads or reads them back."""

    lens_q: tuple[int, ...]
    lens_k: tuple[int, ...]
    batch: int
    cu_q: torch.Tensor
    cu_k: torch.Tensor

    @classmethod
    def build(cls, lens_q, lens_k, batch: int, device) -> "Varlen":
        def offsets(lens):
            return torch.tensor([0, *accumulate(list(lens) * batch)], dtype=torch.int32, device=device)

        return cls(tuple(lens_q), tuple(lens_k), batch, offsets(lens_q), offsets(lens_k))

    @property
    def max_q(self) -> int:
        return max(self.lens_q)

    @property
    def max_k(self) -> int:
        return max(self.lens_k)

    def bounds(self):
        """``(q0, q1, k0, k1)`` of each sequence within one batch row."""
        q_starts, k_starts = [0, *accumulate(self.lens_q)], [0, *accumulate(self.lens_k)]
        return list(zip(q_starts, q_starts[1:], k_starts, k_starts[1:]))


def merge_partials(out, lse, block_out, block_lse):
    """Merge attention over two disjoint key sets given each one's ``(out, lse)``.

    ``out`` is ``[B, S, H, D]``, ``lse`` is ``[B, H, S]``; ``out``/``lse`` may be None for
    the first block. Accumulates in fp32 (fp64 for fp64) and returns the accumulators;
    cast the final ``out`` back to the input dtype once. A row with ``lse = -inf`` (no
    visible key) contributes nothing.
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


def _empty_lse(q: torch.Tensor) -> torch.Tensor:
    b, s, h, _ = q.shape
    return torch.full((b, h, s), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)


def _bottom_right_forward(square, q, k, v, causal, scale):
    """``square(q, k, v, causal, scale)`` handles any shape unmasked and causal only for
    Sq == Sk (top-left = bottom-right there); longer keys split into a visible prefix and
    a square diagonal, merged; longer queries leave their first rows empty."""
    sq, sk = q.shape[1], k.shape[1]
    if not causal or sq == sk:
        return square(q, k, v, causal, scale)
    if sq < sk:
        p = sk - sq
        out, lse = merge_partials(None, None, *square(q, k[:, :p], v[:, :p], False, scale))
        out, lse = merge_partials(out, lse, *square(q, k[:, p:], v[:, p:], True, scale))
        return out.to(q.dtype), lse
    p = sq - sk
    out, lse = q.new_zeros(q.shape), _empty_lse(q)
    out[:, p:], lse[..., p:] = square(q[:, p:], k, v, True, scale)
    return out, lse


def _bottom_right_backward(square, dout, q, k, v, out, lse, causal, scale):
    sq, sk = q.shape[1], k.shape[1]
    if not causal or sq == sk:
        return square(dout, q, k, v, out, lse, causal, scale)
    if sq < sk:
        p = sk - sq
        dq1, dk1, dv1 = square(dout, q, k[:, :p], v[:, :p], out, lse, False, scale)
        dq2, dk2, dv2 = square(dout, q, k[:, p:], v[:, p:], out, lse, True, scale)
        acc = accumulator_dtype(q.dtype)
        return (dq1.to(acc) + dq2).to(q.dtype), torch.cat([dk1, dk2], 1), torch.cat([dv1, dv2], 1)
    p = sq - sk
    dq = torch.zeros_like(q)
    dq[:, p:], dk, dv = square(dout[:, p:], q[:, p:], k, v, out[:, p:], lse[..., p:], True, scale)
    return dq, dk, dv


def dense_forward(square, q, k, v, causal, scale, varlen):
    """Forward of a kernel without a varlen form: one ``square`` call per non-empty
    sequence, written into one output (O(tokens), no per-sequence graph)."""
    if varlen is None:
        return _bottom_right_forward(square, q, k, v, causal, scale)
    out, lse = q.new_zeros(q.shape), _empty_lse(q)
    for q0, q1, k0, k1 in varlen.bounds():
        if q1 > q0 and k1 > k0:
            out[:, q0:q1], lse[..., q0:q1] = _bottom_right_forward(square, q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], causal, scale)
    return out, lse


def dense_backward(square, dout, q, k, v, out, lse, causal, scale, varlen):
    """Backward of :func:`dense_forward`; gradients written in place per sequence."""
    if varlen is None:
        return _bottom_right_backward(square, dout, q, k, v, out, lse, causal, scale)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for q0, q1, k0, k1 in varlen.bounds():
        if q1 > q0 and k1 > k0:
            dq[:, q0:q1], dk[:, k0:k1], dv[:, k0:k1] = _bottom_right_backward(
                square, dout[:, q0:q1], q[:, q0:q1], k[:, k0:k1], v[:, k0:k1], out[:, q0:q1], lse[..., q0:q1], causal, scale
            )
    return dq, dk, dv
