"""Local attention kernels: how one block of attention is computed on this device.

A backend decides *which* blocks of attention a rank computes and where the data
goes; a kernel decides *how* one block is computed. Backends never branch on the
device, the dtype or the installed packages: they name a kernel (``AttnSpec.kernel``,
resolved once per call signature by `resolve_kernel`) and call its contract,
all in the ``[B, S, H, D]`` layout, q heads a multiple of kv heads (GQA):

* ``block_forward(q, k, v, *, causal, scale, varlen=None, window=None, softcap=0.0) -> (out, lse)``:
  out in the input dtype, lse ``[B, H, Sq]`` in fp32 (fp64 for fp64 inputs), the natural
  log-sum-exp of the (capped) scores; **out 0 and lse -inf for a query row that sees no
  key**, whatever the kernel itself writes (flash-attn writes +inf).
* ``block_backward(dout, q, k, v, out, lse, *, causal, scale, varlen=None, window=None, softcap=0.0)
  -> (dq, dk, dv)`` from the *final* out and lse of every query row (so a block's share of
  the gradient comes out right however many blocks the row was merged from), in the
  input dtype.
* `attend` makes the pair one differentiable call (whole sequences: Ulysses, P=1).

The mask is flash-attn's, aligned to the bottom right: query i of Sq sees key j of Sk iff
``(left < 0 or j >= i + Sk - Sq - left) and (right < 0 or j <= i + Sk - Sq + right) and
(not causal or j <= i + Sk - Sq)``, ``window = (left, right)`` (ints >= -1, -1 unbounded;
None is (-1, -1)), so causal alone is the usual lower triangle for Sq == Sk. Empty rows
can only be the top ones (the last query always sees the last key unless Sk = 0).
``varlen`` (`Varlen`) packs independent sequences into one call: sequence n holds
``lens_q[n]`` consecutive queries and ``lens_k[n]`` consecutive keys, masked within
itself only (its own Sq, Sk in the formula); a length may be 0. ``softcap`` > 0 replaces
a score s = scale * q.k by ``softcap * tanh(s / softcap)`` before the mask and softmax
(flash-attn's and Gemma 2's soft-capping); 0 is off.

Inputs reach the kernel in their own dtype (never upcast); only the backends' merges
accumulate in fp32 (`merge_into`, in place; `merge_partials`). Kernels:

* ``flash_attn``: flash-attn 2.x (2.6 and 2.7+ private signatures), native varlen,
  bottom-right masks, windows and soft-capping; imported at use, so a fake in
  ``sys.modules`` runs it on CPU. Windows flash-attn reads differently (one-sided or
  wider than Sk, with Sq > Sk + 1) run in query tiles where it reads them right.
* ``torch``: on CPU the ATen flash op; on CUDA ``_scaled_dot_product_flash_attention``
  (fp16/bf16, GQA without repeating K/V) or ``_scaled_dot_product_efficient_attention``
  (fp32). No varlen form: sequences loop inside the kernel, in O(tokens) memory.
  Windows: query tiles with per-tile masks (CPU, CUDA fp32) or ``_flash_attention_forward``'s
  window (CUDA fp16/bf16); soft-capping: the math kernel over query tiles.
* ``math``: plain fp32/fp64 math, O(Sq x Sk) memory: the reference, and the last resort.
"""

from __future__ import annotations

import torch

from .common import Varlen, accumulator_dtype, add_sink, check_options, merge_into, merge_partials, sink_grad, sliding_band
from .flash_attn_kernel import FlashAttnKernel
from .math_kernel import MathKernel
from .torch_kernel import TorchKernel

__all__ = [
    "KERNEL_NAMES",
    "Varlen",
    "get_kernel",
    "resolve_kernel",
    "attend",
    "local_attention",
    "merge_partials",
    "merge_into",
    "add_sink",
    "sink_grad",
    "sliding_band",
    "accumulator_dtype",
]

_KERNELS = {k.name: k for k in (FlashAttnKernel(), TorchKernel(), MathKernel())}
KERNEL_NAMES = ("auto", *_KERNELS)


def get_kernel(name: str):
    try:
        return _KERNELS[name]
    except KeyError:
        raise ValueError(f"unknown attention kernel {name!r}; choose from {', '.join(KERNEL_NAMES)}") from None


def resolve_kernel(name: str, dtype: torch.dtype, device: torch.device, head_dim: int) -> str:
    """The kernel that runs: ``name`` itself if it can take these tensors (else ``ValueError``
    naming the constraint), or for ``auto``: flash_attn for fp16/bf16 CUDA tensors with
    D <= 256 when flash-attn imports, else torch where it can run, else math."""
    if name == "auto":
        if device.type == "cuda" and _KERNELS["flash_attn"].problem(dtype, device, head_dim) is None:
            return "flash_attn"
        return "torch" if _KERNELS["torch"].problem(dtype, device, head_dim) is None else "math"
    problem = get_kernel(name).problem(dtype, device, head_dim)
    if problem is not None:
        raise ValueError(f"kernel {name!r} cannot run here: {problem}; use kernel='auto' or another of {', '.join(KERNEL_NAMES)}")
    return name


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, kernel, options):
        out, lse = kernel.block_forward(q, k, v, **options)
        if sinks is not None:
            out, lse = add_sink(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.args = (kernel, options)
        return out

    @staticmethod
    def backward(ctx, dout):
        kernel, options = ctx.args
        q, k, v, out, lse, sinks = ctx.saved_tensors
        dsinks = sink_grad(dout, out, lse, sinks) if ctx.needs_input_grad[3] else None
        return *kernel.block_backward(dout, q, k, v, out, lse, **options), dsinks, None, None


def attend(q_bshd, k_bshd, v_bshd, *, kernel, causal: bool, scale: float, varlen: Varlen | None = None,
           window: tuple[int, int] | None = None, softcap: float = 0.0, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable attention of whole (or packed) sequences with the named kernel (or a kernel
    object with the contract's ``block_forward`` / ``block_backward``); the backward recomputes from
    (q, k, v, out, lse) through the same kernel. ``sinks``: one learned logit per query head (`add_sink`)."""
    if q_bshd.shape[1] == 0 or k_bshd.shape[1] == 0:  # the CPU op dies with SIGFPE on it
        raise ValueError(f"attention needs non-empty sequences, got q {tuple(q_bshd.shape)} and k {tuple(k_bshd.shape)}")
    check_options(window, softcap)
    options = dict(causal=causal, scale=scale, varlen=varlen, window=None if window is None else tuple(window), softcap=float(softcap))
    return _Attention.apply(q_bshd, k_bshd, v_bshd, sinks, get_kernel(kernel) if isinstance(kernel, str) else kernel, options)


def local_attention(q_bshd, k_bshd, v_bshd, *, causal: bool, scale: float | None = None, kernel: str = "auto",
                    window: int | None = None, softcap: float = 0.0, cu_seqlens=None, sinks=None) -> torch.Tensor:
    """`attend` with the default scale 1/sqrt(D) and ``auto`` resolved for these tensors.
    ``window``: Hugging Face's sliding window W (query i sees key j iff i - W < j <= i; causal
    only), the contract's ``(W - 1, 0)``. ``cu_seqlens``: document boundaries of a packed
    sequence (0, ..., S), each document attending within itself; None: one. ``sinks``: `attend`'s."""
    band = sliding_band(window, causal)
    name = resolve_kernel(kernel, q_bshd.dtype, q_bshd.device, q_bshd.shape[-1])
    varlen = None
    if cu_seqlens is not None:
        lens = [b - a for a, b in zip(cu_seqlens, cu_seqlens[1:])]
        varlen = Varlen.build(lens, lens, q_bshd.shape[0], q_bshd.device)
    return attend(q_bshd, k_bshd, v_bshd, kernel=name, causal=causal, scale=scale if scale is not None else q_bshd.shape[-1] ** -0.5,
                  varlen=varlen, window=band, softcap=softcap, sinks=sinks)
