"""Local attention kernels: how one block of attention is computed on this device.

A backend decides *which* blocks of attention a rank computes and where the data
goes; a kernel decides *how* one block is computed. Backends never branch on the
device, the dtype or the installed packages: they name a kernel (``AttnSpec.kernel``,
resolved once per call signature by :func:`resolve_kernel`) and call its contract,
all in the ``[B, S, H, D]`` layout, q heads a multiple of kv heads (GQA):

* ``block_forward(q, k, v, *, causal, scale, varlen=None) -> (out, lse)``: out in the
  input dtype, lse ``[B, H, Sq]`` in fp32 (fp64 for fp64 inputs), the natural
  log-sum-exp of the scaled scores; **-inf for a query row that sees no key**, whatever
  the kernel itself writes (flash-attn writes +inf).
* ``block_backward(dout, q, k, v, out, lse, *, causal, scale, varlen=None) -> (dq, dk, dv)``
  from the *final* out and lse of every query row (so a block's share of the gradient
  comes out right however many blocks the row was merged from), in the input dtype.
* :func:`attend` makes the pair one differentiable call (whole sequences: Ulysses, P=1).

``causal`` is flash-attn's mask, aligned to the bottom right: query i of Sq sees key j
of Sk iff ``j <= i + Sk - Sq`` (for Sq == Sk the usual lower triangle). ``varlen``
(:class:`Varlen`) packs independent sequences into one call: sequence n holds
``lens_q[n]`` consecutive queries and ``lens_k[n]`` consecutive keys, masked (if causal)
within itself only; a length may be 0.

Inputs reach the kernel in their own dtype (never upcast); only the backends' merges
accumulate in fp32 (:func:`merge_partials`). Kernels:

* ``flash_attn``: flash-attn 2.x (2.6 and 2.7+ private signatures), native varlen and
  bottom-right masks; imported at use, so a fake in ``sys.modules`` runs it on CPU.
* ``torch``: on CPU the ATen flash op; on CUDA ``_scaled_dot_product_flash_attention``
  (fp16/bf16, GQA without repeating K/V) or ``_scaled_dot_product_efficient_attention``
  (fp32). No varlen form: sequences loop inside the kernel, in O(tokens) memory.
* ``math``: plain fp32/fp64 math, O(Sq x Sk) memory: the reference, and the last resort.
"""

from __future__ import annotations

import torch

from .common import Varlen, accumulator_dtype, merge_partials
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
    def forward(ctx, q, k, v, kernel, causal, scale, varlen):
        out, lse = kernel.block_forward(q, k, v, causal=causal, scale=scale, varlen=varlen)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (kernel, causal, scale, varlen)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        kernel, causal, scale, varlen = ctx.args
        dq, dk, dv = kernel.block_backward(dout, q, k, v, out, lse, causal=causal, scale=scale, varlen=varlen)
        return dq, dk, dv, None, None, None, None


def attend(q_bshd, k_bshd, v_bshd, *, kernel: str, causal: bool, scale: float, varlen: Varlen | None = None) -> torch.Tensor:
    """Differentiable attention of whole (or packed) sequences with the named kernel; the
    backward recomputes from (q, k, v, out, lse) through the same kernel."""
    if q_bshd.shape[1] == 0 or k_bshd.shape[1] == 0:  # the CPU op dies with SIGFPE on it
        raise ValueError(f"attention needs non-empty sequences, got q {tuple(q_bshd.shape)} and k {tuple(k_bshd.shape)}")
    return _Attention.apply(q_bshd, k_bshd, v_bshd, get_kernel(kernel), causal, scale, varlen)


def local_attention(q_bshd, k_bshd, v_bshd, *, causal: bool, scale: float | None = None, kernel: str = "auto") -> torch.Tensor:
    """:func:`attend` with the default scale 1/sqrt(D) and ``auto`` resolved for these tensors."""
    name = resolve_kernel(kernel, q_bshd.dtype, q_bshd.device, q_bshd.shape[-1])
    return attend(q_bshd, k_bshd, v_bshd, kernel=name, causal=causal, scale=scale if scale is not None else q_bshd.shape[-1] ** -0.5)
