"""What every kernel shares: the packed-sequence descriptor, the fp32 merge, the mask of
the contract (causal and sliding windows, bottom-right aligned) and the loop over
sequences and query tiles for kernels that lack a varlen form or that mask with
explicit tensors (each in O(tokens) memory beyond one tile)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate

import torch

__all__ = ["Varlen", "accumulator_dtype", "last_dim_contiguous", "merge_partials", "merge_into", "add_sink", "sink_grad", "repeat_kv", "sliding_band", "check_options", "visible", "tiled_forward", "tiled_backward"]


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Partial results are kept in fp32, or fp64 for fp64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True, eq=False)
class Varlen:
    """Packed sequences of one kernel call, the same packing for every batch row.

    ``lens_q[n]`` / ``lens_k[n]``: queries and keys of sequence n (0 allowed). ``cu_q`` /
    ``cu_k`` are flash-attn's int32 offsets over the batch flattened into tokens
    (``batch * len(lens) + 1`` entries), built once on the device (`build`) so no
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
    the first block. Accumulates in fp32 (fp64 for fp64) and returns new accumulators
    (`merge_into` updates them in place); cast the final ``out`` back to the input
    dtype once. A row with ``lse = -inf`` (no visible key) contributes nothing.
    """
    acc = accumulator_dtype(block_out.dtype)
    if out is None:
        return block_out.to(acc), block_lse.to(acc)
    out, lse = out.clone(), lse.clone()
    merge_into(out, lse, block_out, block_lse)
    return out, lse


def merge_into(out, lse, block_out, block_lse) -> None:
    """`merge_partials` into the fp32 accumulators ``out`` ``[B, S, H, D]`` / ``lse``
    ``[B, H, S]`` (views allowed) in place: one fused scale-and-add over ``out``, no
    out-sized temporary beyond ``block_out``'s fp32 copy."""
    new_lse = torch.logaddexp(lse, block_lse.to(lse.dtype))
    ref = torch.where(torch.isneginf(new_lse), torch.zeros_like(new_lse), new_lse)
    w_old = torch.exp(lse - ref).transpose(1, 2).unsqueeze(-1)
    w_new = torch.exp(block_lse - ref).transpose(1, 2).unsqueeze(-1)
    out.mul_(w_old).addcmul_(block_out.to(out.dtype), w_new)
    lse.copy_(new_lse)


def add_sink(out, lse, sinks):
    """Fold learned attention sinks (GPT-OSS's ``s_aux``: one logit per head, no value) into the
    final ``out`` ``[B, S, H, D]`` and ``lse`` ``[B, H, S]`` of every query row: the sink joins each
    row's softmax denominator once, so ``lse' = logaddexp(lse, sink)`` and ``out' = out * exp(lse - lse')``.
    Returns ``(out', lse')`` in their dtypes. A kernel's backward from these final values is exact
    for q, k and v: the sink's column has no value, so it adds nothing to ``dO V^T``, and the
    row's ``rowsum(dO * O)`` is that of the sink-inclusive output (`sink_grad` gives the sink's)."""
    new_lse = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    scale = torch.exp(lse - new_lse).transpose(1, 2).unsqueeze(-1)
    return (out.to(scale.dtype) * scale).to(out.dtype), new_lse


def sink_grad(dout, out, lse, sinks):
    """The gradient of `add_sink`'s ``sinks`` ``[H]`` from this rank's rows: the sink's softmax share
    times the row's ``-rowsum(dO * O)``, summed over the rows, ``-sum_i exp(sink - lse_i) <dO_i, O_i>``
    (``out`` and ``lse`` the sink-inclusive ones). Rows held by other ranks add theirs when the
    replicated parameter's gradient is summed over the group."""
    acc = lse.dtype
    delta = (dout.to(acc) * out.to(acc)).sum(-1)  # [B, S, H]
    share = torch.exp(sinks.to(acc)[None, None, :] - lse.transpose(1, 2))
    return -(share * delta).sum((0, 1)).to(sinks.dtype)


def last_dim_contiguous(*tensors) -> list[torch.Tensor]:
    """The fused ops (torch's, flash-attn's C interface) read each row's last dimension as
    contiguous: given a strided one (a view that transposed D, as a convolution's output can be),
    torch's CPU op returns wrong values without an error and flash-attn refuses it. Such a tensor
    is copied first, as flash-attn's own Python wrappers do; others pass as they are."""
    return [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]


def repeat_kv(t: torch.Tensor, q_heads: int) -> torch.Tensor:
    """``[B, S, Hkv, D]`` K or V repeated to the q heads (GQA) for ops that take one head count."""
    return t if t.shape[2] == q_heads else t.repeat_interleave(q_heads // t.shape[2], dim=2)


def sliding_band(window, causal: bool) -> tuple[int, int] | None:
    """Hugging Face's sliding window W (query i sees keys i - W < j <= i) as the kernels'
    band ``(W - 1, 0)``; None for None. ValueError unless W is an int >= 1 on a causal mask."""
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1 or not causal:
        raise ValueError(
            f"window must be an int >= 1 with causal=True (query i sees keys i - window < j <= i), got window={window!r} with causal={causal}"
        )
    return (window - 1, 0)


def check_options(window, softcap) -> None:
    """ValueError unless ``window`` is None or (left, right) of ints >= -1 and ``softcap`` a finite float >= 0."""
    if window is not None and not (
        isinstance(window, (tuple, list)) and len(window) == 2 and all(isinstance(w, int) and w >= -1 for w in window)
    ):
        raise ValueError(f"window must be None or (left, right), ints >= -1 (-1: unbounded), got {window!r}")
    if isinstance(softcap, bool) or not (isinstance(softcap, (int, float)) and math.isfinite(softcap) and softcap >= 0):
        raise ValueError(f"softcap must be a finite float >= 0 (0: off), got {softcap!r}")


def _empty_lse(q: torch.Tensor) -> torch.Tensor:
    b, s, h, _ = q.shape
    return torch.full((b, h, s), float("-inf"), dtype=accumulator_dtype(q.dtype), device=q.device)


def _unbounded_sides(sq: int, sk: int, left: int, right: int) -> tuple[int, int]:
    """(left, right) with -1 for a side that bounds no row of an Sq x Sk block."""
    return (-1 if left >= sk - 1 else left), (-1 if right >= sq - 1 else right)


def visible(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor | None:
    """``[Sq, Sk]`` bool mask of the contract (no causal flag: it is ``right = 0``): query i
    sees key j iff ``i + Sk - Sq - left <= j <= i + Sk - Sq + right``, a side -1 unbounded;
    None when nothing is masked."""
    left, right = window
    if left < 0 and right < 0:
        return None
    d = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    return (d >= -left if left >= 0 else True) & (d <= right if right >= 0 else True)


def _tiles(sq: int, sk: int, causal: bool, window, tile):
    """Query tiles of one sequence: ``(a, b, c, e, tile_window)`` for query rows [a, b) and the
    keys [c, e) they can see, ``tile_window`` the same mask in the tile's own bottom-right
    terms. Rows that see no key (only top rows can: the last row always sees the last key)
    are left out, so a kernel never meets an empty row. ``tile(sq, sk, window)``: rows per
    tile (None: one tile)."""
    if sq == 0 or sk == 0:
        return
    left, right = window if window is not None else (-1, -1)
    left, right = _unbounded_sides(sq, sk, left, 0 if causal else right)
    first = 0 if right < 0 else max(0, sq - sk - right)
    rows = tile(sq, sk, (left, right)) if tile else sq
    for a in range(first, sq, rows):
        b = min(a + rows, sq)
        c = 0 if left < 0 else max(0, a + sk - sq - left)
        e = sk if right < 0 else min(sk, b + sk - sq + right)
        shift = (sq - b) - (sk - e)  # the tile's diagonal sits this far right of the block's
        yield a, b, c, e, _unbounded_sides(b - a, e - c, left if left < 0 else left + shift, right if right < 0 else right - shift)


def _plan(q, k, causal, window, varlen, tile):
    """Per sequence of the block: its bounds ``(q0, q1, k0, k1)`` and its `_tiles`; and
    the only tile ``(q0, q1, k0, k1, window)`` if there is one and it sees every key (then
    nothing is sliced or copied but rows, and with every row too not even those: nor on
    a device whose tensors cannot be sliced here, FakeTensorMode CUDA)."""
    bounds = varlen.bounds() if varlen is not None else [(0, q.shape[1], 0, k.shape[1])]
    plan = [(s, list(_tiles(s[1] - s[0], s[3] - s[2], causal, window, tile))) for s in bounds]
    spans = [(q0 + a, q0 + b, k0 + c, k0 + e, w) for (q0, _, k0, _), tiles in plan for a, b, c, e, w in tiles]
    return plan, spans[0] if len(spans) == 1 and spans[0][2:4] == (0, k.shape[1]) else None


def tiled_forward(square, tile, q, k, v, causal, scale, varlen, window, softcap):
    """The contract from ``square(q, k, v, window, scale, softcap) -> (out, lse)``, which
    computes one dense block (no causal flag: ``window`` says it all) whose every row sees
    a key: one call per sequence and query tile, written into one output (no graph)."""
    plan, single = _plan(q, k, causal, window, varlen, tile)
    if single is not None and single[:2] == (0, q.shape[1]):
        return square(q, k, v, single[4], scale, softcap)
    out, lse = q.new_zeros(q.shape), _empty_lse(q)
    for (q0, _, k0, _), tiles in plan:
        for a, b, c, e, w in tiles:
            rows, keys = slice(q0 + a, q0 + b), slice(k0 + c, k0 + e)
            out[:, rows], lse[..., rows] = square(q[:, rows], k[:, keys], v[:, keys], w, scale, softcap)
    return out, lse


def tiled_backward(square, tile, dout, q, k, v, out, lse, causal, scale, varlen, window, softcap):
    """Backward of `tiled_forward` from ``square(dout, q, k, v, out, lse, window, scale,
    softcap) -> (dq, dk, dv)``; dK/dV of a sequence cut in several tiles add up in fp32."""
    plan, single = _plan(q, k, causal, window, varlen, tile)
    if single is not None:  # dK, dV straight from the kernel
        rows, w = slice(*single[:2]), single[4]
        if single[:2] == (0, q.shape[1]):
            return square(dout, q, k, v, out, lse, w, scale, softcap)
        dq = torch.zeros_like(q)
        dq[:, rows], dk, dv = square(dout[:, rows], q[:, rows], k, v, out[:, rows], lse[..., rows], w, scale, softcap)
        return dq, dk, dv
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for (q0, _, k0, k1), tiles in plan:
        gk, gv = dk[:, k0:k1], dv[:, k0:k1]
        if len(tiles) > 1:
            gk, gv = (torch.zeros_like(g, dtype=accumulator_dtype(g.dtype)) for g in (gk, gv))
        for a, b, c, e, w in tiles:
            rows, keys = slice(q0 + a, q0 + b), slice(k0 + c, k0 + e)
            dq[:, rows], gk_, gv_ = square(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[..., rows], w, scale, softcap)
            gk[:, c:e] += gk_
            gv[:, c:e] += gv_
        if len(tiles) > 1:
            dk[:, k0:k1], dv[:, k0:k1] = gk, gv
    return dq, dk, dv
