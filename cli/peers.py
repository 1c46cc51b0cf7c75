"""Other libraries' sequence-parallel attention, wrapped to run beside ours in ``sp-bench run --peers``.

Every peer takes this rank's shards in ``[B, S/P, H, D]`` and returns the local
output, differentiably, so it is timed exactly like a backend. A peer that
cannot run here says why (`Peer.problem`) and is listed with that reason.

- ``deepspeed``: DeepSpeed-Ulysses' ``DistributedAttention`` around the same
  local kernel our Ulysses backend uses; three all-to-alls in, one out. Its
  all-to-all concatenates ranks in order, so it gets contiguous shards.
- ``torch-ring``: torch's ring attention. On CPU only its private
  ``_templated_ring_attention`` (and backward) with the CPU flash op runs,
  wrapped in an autograd Function here; zigzag shards map to its head-tail
  load balancing, contiguous ones to plain rotation. Not wired for CUDA.
- ``ring-flash-attn`` (zigzag ring) and ``yunchang`` (Ulysses x ring): flash-attn's
  private functions, so CUDA with flash-attn, or on CPU the fake of flash-attn that
  ``sp-bench run --fake-flash-attn`` installs in every rank (bf16/fp16 only): every
  library then runs on one kernel and the bench compares SP algorithms like for like.
  ring-flash-attn 0.1.8's package ``__init__`` imports its Hugging Face adapter, which
  fails beside transformers >= 4.54; only its algorithm modules are loaded then.
  yunchang's ring backward sends to itself when its ring has one rank, which gloo
  refuses, so on CPU it runs with a ring of 2 (Ulysses over the rest).
"""

from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass

import torch

from ulysses_sp import kernels
from ulysses_sp.comm import head_scatter_problem

__all__ = ["PEERS", "Peer"]


@dataclass(frozen=True)
class Peer:
    name: str

    def shard_layout(self, layout: str) -> str:
        """The token layout this peer's shards must have for the run's ``layout``."""
        return layout

    def problem(self, cell, topo) -> str | None:
        raise NotImplementedError

    def make(self, cell, topo, kernel: str = "auto"):
        """A callable ``(q, k, v) -> out`` on this rank's shards; ``kernel`` is the local kernel
        our backends run with, for a peer that takes ours."""
        raise NotImplementedError


def _missing(module: str, extra: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return f"{module} is not installed (pip install {extra})"
    return None


def _flash_attn_problem(cell, topo) -> str | None:
    try:
        import flash_attn
    except ImportError:
        return "needs flash-attn (pip install flash-attn; on CPU: sp-bench run --fake-flash-attn)"
    if topo.device.type != "cuda" and not getattr(flash_attn, "__fake__", False):
        return "flash-attn runs on CUDA only (on CPU: sp-bench run --fake-flash-attn)"
    if cell.dtype not in ("bfloat16", "float16"):
        return "flash-attn takes bf16 or fp16 (--dtype bfloat16)"
    return None


def _ring_flash_attn():
    """The ``ring_flash_attn`` package, or its algorithm modules alone when its ``__init__``
    fails on its Hugging Face adapter (not used here)."""
    try:
        import ring_flash_attn
    except ImportError:
        spec = importlib.util.find_spec("ring_flash_attn")
        ring_flash_attn = types.ModuleType("ring_flash_attn")
        ring_flash_attn.__path__, ring_flash_attn.__spec__ = list(spec.submodule_search_locations), spec
        sys.modules["ring_flash_attn"] = ring_flash_attn
    return ring_flash_attn


class DeepSpeedUlysses(Peer):
    def shard_layout(self, layout: str) -> str:
        return "contiguous"

    def problem(self, cell, topo):
        if cell.kv_heads < topo.sp_size:  # it asserts this in the first call (deepspeed 0.19): it does not replicate KV heads
            return f"DeepSpeed's DistributedAttention needs at least sp_size ({topo.sp_size}) KV heads, got {cell.kv_heads}"
        return _missing("deepspeed", "deepspeed") or head_scatter_problem(cell.heads, cell.kv_heads, topo.sp_size)

    def make(self, cell, topo, kernel: str = "auto"):
        from ulysses_sp.integrations.deepspeed import use_cpu_accelerator_if_needed

        use_cpu_accelerator_if_needed()
        import deepspeed
        from deepspeed.sequence.layer import DistributedAttention

        deepspeed.init_distributed(dist_backend="nccl" if topo.device.type == "cuda" else "gloo")  # joins the running group

        def local(q, k, v, *args, **kwargs):
            return kernels.local_attention(q, k, v, causal=cell.causal, kernel=kernel)

        attn = DistributedAttention(local, topo.sp_group, scatter_idx=2, gather_idx=1)
        return lambda q, k, v: attn(q, k, v, batch_dim_idx=0)


class _TorchRingFunction(torch.autograd.Function):
    """torch's ring forward and backward with the CPU flash op, on ``[B, H, S, D]``."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale):
        from torch.distributed.tensor.experimental._attention import _templated_ring_attention

        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out, lse = _templated_ring_attention(group, 2, op, q, k, v, is_causal=causal, scale=scale)[:2]
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale = group, causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        from torch.distributed.tensor.experimental._context_parallel._attention import _templated_ring_attention_backward

        q, k, v, out, lse = ctx.saved_tensors
        op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
        dq, dk, dv = _templated_ring_attention_backward(
            ctx.group, 2, op, grad_out=dout.contiguous(), grad_out_name="grad_out", query=q, key=k, value=v, out=out,
            logsumexp=lse, is_causal=ctx.causal, dropout_p=0.0, scale=ctx.scale,
        )[:3]
        return dq, dk, dv, None, None, None


class TorchRing(Peer):
    def problem(self, cell, topo):
        if topo.device.type != "cpu":
            return "wired for CPU only here (on CUDA use torch's public context_parallel)"
        if cell.dtype == "float16":
            return "the CPU flash op has no float16 kernel"
        try:
            from torch.distributed.tensor.experimental._context_parallel import _attention  # noqa: F401
        except ImportError as e:
            return f"this torch has no _templated_ring_attention ({e})"
        return None

    def make(self, cell, topo, kernel: str = "auto"):
        from torch.distributed.tensor.experimental._attention import _cp_options

        # head-tail balancing is our zigzag; torch allows it only under a causal mask
        _cp_options.enable_load_balance = cell.causal and cell.layout == "zigzag"
        repeat = cell.heads // cell.kv_heads
        scale = cell.head_dim**-0.5

        def attn(q, k, v):
            k, v = (t.repeat_interleave(repeat, dim=2) if repeat > 1 else t for t in (k, v))  # it needs MHA
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            return _TorchRingFunction.apply(q, k, v, topo.sp_group, cell.causal, scale).transpose(1, 2)

        return attn


class RingFlashAttn(Peer):
    def problem(self, cell, topo):
        return _missing("ring_flash_attn", "ring-flash-attn") or _flash_attn_problem(cell, topo) or (
            None if cell.layout == "zigzag" else "benchmarked in its zigzag variant only: run with --layout zigzag"
        )

    def make(self, cell, topo, kernel: str = "auto"):
        _ring_flash_attn()
        from ring_flash_attn.zigzag_ring_flash_attn import zigzag_ring_flash_attn_func

        return lambda q, k, v: zigzag_ring_flash_attn_func(q, k, v, causal=cell.causal, group=topo.sp_group)


class YunChang(Peer):
    def shard_layout(self, layout: str) -> str:
        return "contiguous"

    def problem(self, cell, topo):
        u = self._degrees(topo)[0]
        if cell.heads % u or cell.kv_heads % u:
            return f"its all-to-all scatters q and kv heads ({cell.heads}, {cell.kv_heads}) over {u} ranks, which must divide both"
        return _missing("yunchang", "yunchang") or _flash_attn_problem(cell, topo)

    @staticmethod
    def _degrees(topo) -> tuple[int, int]:
        """(Ulysses, ring) degrees: the topology's; on CPU a ring of at least 2 (see above)."""
        u, r = topo.ulysses_degree, topo.ring_degree
        if topo.device.type == "cpu" and r == 1 and topo.sp_size % 2 == 0:
            u, r = topo.sp_size // 2, 2
        return u, r

    def make(self, cell, topo, kernel: str = "auto"):
        from yunchang import LongContextAttention, set_seq_parallel_pg

        set_seq_parallel_pg(*self._degrees(topo), topo.rank, topo.world_size, use_ulysses_low=True)
        attn = LongContextAttention(ring_impl_type="basic")
        return lambda q, k, v: attn(q, k, v, causal=cell.causal)


PEERS = {p.name: p for p in (DeepSpeedUlysses("deepspeed"), TorchRing("torch-ring"), RingFlashAttn("ring-flash-attn"), YunChang("yunchang"))}
