"""The one attention interface: `SequenceParallelAttention` and `sp_attention`.

Order of work on every call: validate this rank's inputs (local checks, no
communication), check once per call signature that every rank of the SP group
agrees (one small all-gather), pick the backend (``auto``: cheapest feasible,
cached per layer and shape), make sure it can run, and only then run it. Every
user mistake therefore raises ``ValueError`` on every rank before a collective
that could hang.
"""

from __future__ import annotations

import bisect
import logging
import math
import weakref
import zlib

import torch
from torch import nn

from . import comm
from . import layout as _layout
from .eager_ops import EagerCall, compiled_attention
from .kernels import check_options, get_kernel, resolve_kernel, sliding_band
from .registry import choose_backend, get_backend, problem
from .profile import Profile
from .spec import AttnSpec
from .topology import Topology, register_attention

__all__ = ["SequenceParallelAttention", "sp_attention", "make_spec"]

log = logging.getLogger(__name__)


def _cu_seqlens_tuple(cu_seqlens, seq_len: int, cache: dict) -> tuple[int, ...] | None:
    """The boundaries as a tuple. A tensor is read back once, not once per layer: every
    layer of a forward gets the same tensor, and the last one read is kept (by weak
    reference and version counter, so a new or modified tensor is read again)."""
    if cu_seqlens is None:
        return None
    if isinstance(cu_seqlens, torch.Tensor):
        last = cache.get("cu_seqlens")
        if last is not None and last[0]() is cu_seqlens and last[1] == cu_seqlens._version and last[2][-1] == seq_len:
            return last[2]
        values = _check_cu_seqlens(cu_seqlens.tolist(), seq_len)
        cache["cu_seqlens"] = (weakref.ref(cu_seqlens), cu_seqlens._version, values)
        return values
    return _check_cu_seqlens(list(cu_seqlens), seq_len)


def _check_cu_seqlens(values: list, seq_len: int) -> tuple[int, ...]:
    if (
        len(values) < 2
        or any(not isinstance(x, int) for x in values)
        or values[0] != 0
        or values[-1] != seq_len
        or any(b <= a for a, b in zip(values, values[1:]))
    ):
        raise ValueError(
            "cu_seqlens must be the cumulative document lengths of the global packed sequence: "
            f"integers starting at 0, strictly increasing, ending at the global length {seq_len}; got {values}"
        )
    return tuple(values)


def _check_blocks(blocks, seq_len: int, cu_seqlens, causal: bool) -> tuple[tuple[int, int], ...] | None:
    """The bidirectional blocks as a tuple of ``(start, end)``; ValueError naming the constraint."""
    if blocks is None:
        return None
    if isinstance(blocks, torch.Tensor):
        blocks = blocks.tolist()
    try:
        values = tuple((int(a), int(b)) for a, b in blocks)
        valid = all(isinstance(x, int) and not isinstance(x, bool) for pair in blocks for x in pair)
    except (TypeError, ValueError):
        values, valid = (), False
    if not valid or any(not 0 <= a < b <= seq_len for a, b in values) or any(b > c for (_, b), (c, _) in zip(values, values[1:])):
        raise ValueError(f"blocks must be (start, end) integer pairs, 0 <= start < end <= the global length {seq_len}, sorted and "
                         f"disjoint: each a run of tokens that attend to each other both ways; got {blocks!r}")
    if values and not causal:
        raise ValueError("blocks overlay a causal mask (causal=True); without one every token already sees every other")
    bounds = cu_seqlens or (0, seq_len)  # a block crosses a boundary when the first one after its start is before its end
    crossing = [(a, b) for a, b in values if bounds[bisect.bisect_right(bounds, a)] < b]
    if crossing:
        raise ValueError(f"blocks {crossing} cross a document boundary of cu_seqlens {list(bounds)}: a block lies within one document")
    return values or None


def make_spec(q, k, v, topo: Topology, *, causal: bool = True, softmax_scale=None, cu_seqlens=None, kernel: str = "auto",
              window: int | None = None, softcap: float | None = None, sinks=None, blocks=None) -> AttnSpec:
    """Validate this rank's shards and describe the call, with the kernel that will run it
    (``kernels.resolve_kernel``). Local only: no communication."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [batch, local_seq, heads, head_dim] (4-D), got shape {tuple(t.shape)}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device) or q.device.type != topo.device.type or (topo.device.index not in (None, q.device.index)):
        raise ValueError(f"q, k, v must be on this rank's {topo.device.type} device ({topo.device}), got {q.device}, {k.device}, {v.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape (a different v head dim is padded by SequenceParallelAttention and sp_attention "
                         f"before this check), got {tuple(k.shape)} and {tuple(v.shape)}")
    b, s, hq, d = q.shape
    if k.shape[0] != b or k.shape[1] != s:
        raise ValueError(f"q and k/v must agree in batch and local sequence length, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if k.shape[3] != d:
        raise ValueError(f"q and k/v must have the same head dim, got {d} and {k.shape[3]}")
    if b == 0 or s == 0 or hq == 0 or d == 0:
        raise ValueError(f"q must have non-zero batch, sequence, heads and head dim, got {tuple(q.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv}) (MHA, GQA or MQA)")
    multiple = _layout.required_multiple(topo.layout, topo.sp_size) // topo.sp_size
    if s % multiple:
        raise ValueError(
            f"local sequence length {s} must divide by {multiple} for the {topo.layout!r} layout "
            f"(global length a multiple of {multiple * topo.sp_size}); pad the batch with "
            f"ulysses_sp.pad_to_multiple before sharding"
        )
    if softmax_scale is not None and not (math.isfinite(softmax_scale) and softmax_scale > 0):
        raise ValueError(f"softmax_scale must be a positive finite number or None, got {softmax_scale}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,) or not sinks.is_floating_point()
                              or sinks.device != q.device):
        raise ValueError(f"sinks must be one floating-point logit per query head on q's device, a [{hq}] tensor, got "
                         f"{tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
    softcap = 0.0 if softcap is None else softcap
    sliding_band(window, causal)
    check_options(None, softcap)
    seq_len = s * topo.sp_size
    cu = _cu_seqlens_tuple(cu_seqlens, seq_len, topo.cache)
    return AttnSpec(
        batch=b,
        seq_len=seq_len,
        local_seq_len=s,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        dtype=q.dtype,
        causal=bool(causal),
        softmax_scale=float(softmax_scale) if softmax_scale is not None else 1.0 / math.sqrt(d),
        layout=topo.layout,
        cu_seqlens=cu,
        kernel=resolve_kernel(kernel, q.dtype, q.device, d),
        window=window if window is not None and window < seq_len else None,  # a window over everything is none
        softcap=float(softcap),
        sinks=sinks is not None,
        blocks=_check_blocks(blocks, seq_len, cu, causal),
    )


def _signature(spec: AttnSpec, backend: str, tensors) -> tuple[int, ...]:
    dtype_code = zlib.crc32(str(spec.dtype).encode())
    # which inputs need a gradient decides which tensors the backward all-to-all carries
    grads = sum(1 << i for i, t in enumerate(tensors) if t.requires_grad and torch.is_grad_enabled())
    extras = zlib.crc32(repr((spec.cu_seqlens, backend, spec.softmax_scale, spec.kernel, spec.window, spec.softcap, spec.sinks, spec.blocks)).encode())
    return (spec.batch, spec.local_seq_len, spec.q_heads, spec.kv_heads, spec.head_dim, dtype_code, int(spec.causal), grads, extras)


_SIGNATURE_FIELDS = ("batch", "local_seq_len", "q_heads", "kv_heads", "head_dim", "dtype", "causal", "requires_grad", "cu_seqlens/backend/scale/kernel/window/softcap/sinks/blocks")


def _check_ranks_agree(spec: AttnSpec, backend: str, topo: Topology, tensors) -> None:
    """One small all-gather per new call signature (every call with
    ``shape_check="always"``); every rank raises if any rank differs."""
    if topo.sp_size == 1 or topo.device.type == "meta":  # meta (ulysses_sp.testing.memory): no values to compare
        return
    mine = _signature(spec, backend, tensors)
    if topo.shape_check == "once" and mine in topo.verified_signatures:
        return
    rows = comm.all_gather_ints(mine, topo.sp_group, topo.device)
    if any(r != rows[0] for r in rows):
        differing = [f for i, f in enumerate(_SIGNATURE_FIELDS) if len({r[i] for r in rows}) > 1]
        shown = "; ".join(f"sp rank {i}: {dict(zip(_SIGNATURE_FIELDS[:5], r[:5]))}" for i, r in enumerate(rows))
        raise ValueError(
            f"the ranks of the SP group called attention with different {', '.join(differing)}; "
            f"every rank must pass shards of the same shape and options ({shown})"
        )
    if len(topo.verified_signatures) > 4096:
        topo.verified_signatures.clear()
    topo.verified_signatures.add(mine)


def _resolve(name: str, spec: AttnSpec, topo: Topology, profile: Profile | None, layer_idx):
    if name != "auto":
        backend = get_backend(name)
        reason = problem(backend, spec, topo)
        if reason is not None:
            raise ValueError(reason)
        return backend
    backend, considered = choose_backend(spec, topo, profile)
    log.info("layer %s: auto chose %s for %s; considered %s", layer_idx, backend.name, spec, considered)
    return backend


def _same_head_dim(q, k, v, softmax_scale):
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2) has a value head dim other than the
    query/key one. The shorter side is zero-padded to the longer, which changes no score and no
    output column (zero value columns give zero output columns; zero q/k columns add nothing to
    q.k), and the output is cut back to the value head dim: every backend and kernel runs it as
    it is, and transformers pads V the same way for flash-attn. The softmax scale stays that of
    the unpadded query/key head dim. Returns (q, k, v, softmax_scale, value head dim or None)."""
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)) or v.shape[3] == k.shape[3]:
        return q, k, v, softmax_scale, None
    if v.shape[:3] != k.shape[:3] or q.shape[3] != k.shape[3]:
        raise ValueError(f"k and v must agree in batch, sequence and heads, and q and k in head dim; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    d_qk, d_v = k.shape[3], v.shape[3]
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d_qk)
    if d_v < d_qk:
        v = nn.functional.pad(v, (0, d_qk - d_v))
    else:
        q, k = (nn.functional.pad(t, (0, d_v - d_qk)) for t in (q, k))
    return q, k, v, softmax_scale, d_v


def _autocast(q, k, v) -> torch.dtype | None:
    """The dtype one process's attention computes in under autocast (SDPA is on autocast's
    lower-precision list, and transformers' flash-attn path casts to it): autocast's dtype for the
    device, where it is on and the inputs are eligible (floating-point, not fp64); else None. The SP
    attention then runs on inputs cast to it with autocast off, so kernels and fp32 merges see one dtype."""
    tensors = (q, k, v)
    if not all(isinstance(t, torch.Tensor) for t in tensors) or q.device.type not in ("cpu", "cuda", "xpu", "mps"):
        return None  # the meta device of the memory model has no autocast
    if not torch.is_autocast_enabled(q.device.type):
        return None
    if any(not t.is_floating_point() or t.dtype == torch.float64 for t in tensors):
        return None
    return torch.get_autocast_dtype(q.device.type)


class SequenceParallelAttention(nn.Module):
    """Attention over a sequence split across the SP group of ``topo``, for one layer.

    Each call takes this rank's shards ``[B, S/P, H, D]`` of q, k and v in ``topo.layout`` (as cut
    by `shard_sequence`) and returns this rank's output shard. Every input mistake raises
    ``ValueError`` on every rank of the group before any collective that could hang. With
    ``backend="auto"`` the cheapest feasible backend is chosen once per call shape and cached in
    the layer.

    Args:
        topo: The topology from `init_sequence_parallel`.
        backend: ``auto``, or a registered backend name (`list_backends`: ``ulysses``,
            ``allgather``, ``ring``, ``hybrid``, ``halo``, ``hybrid-u{U}``, ``ulysses-g{G}``...).
        layer_idx: The layer's index, for logs only.
        profile: What ``auto`` estimates with (default: the topology's, else the built-in one).
        kernel: The local attention kernel (`ulysses_sp.kernels`): ``auto``, ``flash_attn``,
            ``torch`` or ``math``.

    Raises:
        ValueError: An unknown backend or kernel name.
    """

    def __init__(self, topo: Topology, backend: str = "auto", layer_idx: int | None = None, profile: Profile | None = None, kernel: str = "auto"):
        super().__init__()
        if backend != "auto":
            get_backend(backend)  # unknown names fail here, at construction
        if kernel != "auto":
            get_kernel(kernel)
        self.topo, self.backend, self.layer_idx, self.profile, self.kernel = topo, backend, layer_idx, profile, kernel
        self._chosen: dict[AttnSpec, object] = {}
        self._eager = EagerCall(self._forward)  # what a compiled graph calls (ulysses_sp.eager_ops)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True, softmax_scale: float | None = None,
                cu_seqlens: torch.Tensor | list[int] | None = None, window: int | None = None, softcap: float | None = None,
                sinks: torch.Tensor | None = None, blocks: list[tuple[int, int]] | None = None) -> torch.Tensor:
        """Attention of this rank's query shard over the whole sequence's keys and values.

        Args:
            q: This rank's queries, ``[B, S/P, Hq, D]``.
            k: This rank's keys, ``[B, S/P, Hkv, D]``; ``Hq`` must be a multiple of ``Hkv`` (MHA,
                GQA or MQA).
            v: This rank's values, ``[B, S/P, Hkv, Dv]``; a ``Dv`` other than ``D`` (multi-head
                latent attention) is zero-padded and cut back.
            causal: Causal mask (query i sees keys j <= i, in global positions).
            softmax_scale: Scale of the scores (default: ``1 / sqrt(D)``).
            cu_seqlens: Global document boundaries ``[0, ..., S]`` of a packed sequence (a tensor
                or a list; `shard_batch` returns them): no token attends across documents.
            window: Causal sliding window, Hugging Face's convention: query i sees keys
                ``i - window < j <= i``.
            softcap: Caps the scaled scores at ``softcap * tanh(s / softcap)`` (Gemma 2).
            sinks: Learned attention sinks (GPT-OSS's ``s_aux``), ``[Hq]``: one logit per head
                added to every row's softmax denominator, with no value; the same on every rank.
            blocks: Bidirectional blocks: global ``(start, end)`` pairs, sorted and disjoint, each
                within a document; a query of a block also sees the block's later keys (Gemma 3's
                image tokens), on sliding-window layers those within the window. The same on every rank.

        Returns:
            This rank's output shard, ``[B, S/P, Hq, Dv]``.

        Raises:
            TypeError: Inputs that are not floating-point tensors of one dtype.
            ValueError: Shards of the wrong shape, device or length for the layout, ranks of
                the group that disagree on shapes or options, a backend that cannot run the
                call, or invalid ``cu_seqlens``, ``softmax_scale``, ``window``, ``softcap``, ``sinks`` or
                ``blocks`` (or blocks under torch.compile).
        """
        options = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks)
        if torch.compiler.is_compiling():
            _no_compiled_blocks(blocks)
            return compiled_attention(self._eager, q, k, v, **options)
        return self._forward(q, k, v, **options, blocks=blocks)

    def _forward(self, q, k, v, *, causal, softmax_scale, cu_seqlens, window, softcap, sinks=None, blocks=None) -> torch.Tensor:
        options = dict(causal=causal, cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks, blocks=blocks)
        dtype = _autocast(q, k, v)
        if dtype is not None:
            with torch.autocast(q.device.type, enabled=False):
                return self._forward(q.to(dtype), k.to(dtype), v.to(dtype), softmax_scale=softmax_scale, **options)
        q, k, v, softmax_scale, d_v = _same_head_dim(q, k, v, softmax_scale)
        if d_v is not None:
            return self._forward(q, k, v, softmax_scale=softmax_scale, **options)[..., :d_v]
        spec = make_spec(q, k, v, self.topo, softmax_scale=softmax_scale, kernel=self.kernel, **options)
        _check_ranks_agree(spec, self.backend, self.topo, (q, k, v))
        backend = self._chosen.get(spec)
        if backend is None:
            if len(self._chosen) > 1024:  # packed batches vary cu_seqlens: keep the cache bounded
                self._chosen.clear()
            backend = self._chosen[spec] = _resolve(self.backend, spec, self.topo, self.profile, self.layer_idx)
        return _run(backend, q, k, v, spec, self.topo, sinks)

    def extra_repr(self) -> str:
        return f"backend={self.backend!r}, kernel={self.kernel!r}, layer_idx={self.layer_idx}, sp_size={self.topo.sp_size}, layout={self.topo.layout!r}"


def sp_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, topo: Topology, *, backend: str = "auto", causal: bool = True,
    softmax_scale: float | None = None, cu_seqlens: torch.Tensor | list[int] | None = None, profile: Profile | None = None,
    kernel: str = "auto", window: int | None = None,
    softcap: float | None = None, sinks: torch.Tensor | None = None, blocks: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Functional form of `SequenceParallelAttention`, without its per-layer cache of ``auto``'s choice.

    Args:
        q: This rank's queries, ``[B, S/P, Hq, D]``, in ``topo.layout``.
        k: This rank's keys, ``[B, S/P, Hkv, D]``; ``Hq`` must be a multiple of ``Hkv``.
        v: This rank's values, ``[B, S/P, Hkv, Dv]``.
        topo: The topology from `init_sequence_parallel`.
        backend: ``auto`` or a registered backend name.
        causal: Causal mask, in global positions.
        softmax_scale: Scale of the scores (default: ``1 / sqrt(D)``).
        cu_seqlens: Global document boundaries ``[0, ..., S]`` of a packed sequence.
        profile: What ``auto`` estimates with (default: the topology's, else the built-in one);
            not under torch.compile.
        kernel: The local attention kernel: ``auto``, ``flash_attn``, ``torch`` or ``math``.
        window: Causal sliding window: query i sees keys ``i - window < j <= i``.
        softcap: Caps the scaled scores at ``softcap * tanh(s / softcap)``.
        sinks: Learned attention sinks, ``[Hq]`` (`SequenceParallelAttention.forward`).
        blocks: Bidirectional blocks, global ``(start, end)`` pairs (`SequenceParallelAttention.forward`).

    Returns:
        This rank's output shard, ``[B, S/P, Hq, Dv]``.

    Raises:
        TypeError: Inputs that are not floating-point tensors of one dtype.
        ValueError: As `SequenceParallelAttention.forward`, an unknown backend or kernel, or
            ``profile`` given under torch.compile.
    """
    if torch.compiler.is_compiling():  # one op of the graph, which calls this again outside it
        _no_compiled_blocks(blocks)
        if profile is not None:
            raise ValueError("sp_attention(profile=...) cannot be compiled: give the profile to init_sequence_parallel, "
                             "or use SequenceParallelAttention(topo, profile=...)")
        return compiled_attention(topo.eager_attention, q, k, v, backend=backend, kernel=kernel, causal=causal, softmax_scale=softmax_scale,
                                  cu_seqlens=cu_seqlens, window=window, softcap=softcap, sinks=sinks)
    options = dict(causal=causal, cu_seqlens=cu_seqlens, kernel=kernel, window=window, softcap=softcap, sinks=sinks, blocks=blocks)
    dtype = _autocast(q, k, v)
    if dtype is not None:
        with torch.autocast(q.device.type, enabled=False):
            return sp_attention(q.to(dtype), k.to(dtype), v.to(dtype), topo, backend=backend, softmax_scale=softmax_scale, profile=profile,
                                **options)
    q, k, v, softmax_scale, d_v = _same_head_dim(q, k, v, softmax_scale)
    if d_v is not None:
        return sp_attention(q, k, v, topo, backend=backend, softmax_scale=softmax_scale, profile=profile, **options)[..., :d_v]
    spec = make_spec(q, k, v, topo, softmax_scale=softmax_scale, **options)
    _check_ranks_agree(spec, backend, topo, (q, k, v))
    return _run(_resolve(backend, spec, topo, profile, None), q, k, v, spec, topo, sinks)


def _no_compiled_blocks(blocks) -> None:
    if blocks is not None:
        raise ValueError("bidirectional blocks are not supported under torch.compile; run the model eagerly")


def _run(backend, q, k, v, spec: AttnSpec, topo: Topology, sinks):
    """``backend.forward``, given ``sinks=`` only when there are sinks (`registry.problem` checked that it takes them)."""
    return backend.forward(q, k, v, spec, topo) if sinks is None else backend.forward(q, k, v, spec, topo, sinks=sinks)


register_attention(sp_attention)
