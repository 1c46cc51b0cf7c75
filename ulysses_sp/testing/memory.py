"""Transient memory of each backend at real shapes, without a GPU.

One process plays rank 0 of ``sp_size`` ranks: torch's fake process group (collectives
return at once) on meta tensors (shapes, no data), with the torch kernel's CUDA ops
(``kernels.torch_kernel`` sends meta tensors down its CUDA path). `PeakMemory`, a
dispatch mode, adds up the bytes of every storage an op allocates and subtracts them
when the storage dies, as a caching allocator's "allocated" figure would.

    python -m ulysses_sp.testing.memory                       # 128k tokens, P=8, H32/KV8, D128, bf16
    python -m ulysses_sp.testing.memory --seq 131072 --sp 8 --json
    python -m ulysses_sp.testing.memory --indexed             # a DeepSeek-V3.2 attention layer (DSA)
    python -m ulysses_sp.testing.memory --compressed compressed_sparse_attention   # a DeepSeek-V4 attention layer
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["PeakMemory", "peak_until", "measure", "measure_compressed", "measure_indexed", "main"]


def _tensors(value):
    """The tensors in an op's (nested tuple, list, dict) arguments or outputs: a dispatch mode's
    hot path, where torch's general pytree costs more than the meta kernels."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


class PeakMemory(TorchDispatchMode):
    """Live and peak bytes of the storages allocated while the mode is active.

    An op's output that shares an input's storage (a view, an in-place op) allocated nothing: a
    storage made before the mode (a parameter, a tensor passed in) is never counted through it."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes

    def _call(self, func, args, kwargs):
        return func(*args, **kwargs)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = self._call(func, args, kwargs or {})
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in _tensors(out):
            storage = t.untyped_storage()
            key = id(storage)
            if key not in self._seen and key not in inputs:
                self._seen.add(key)
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key, storage.nbytes())
        return out


class _Reached(Exception):
    pass


def peak_until(module: torch.nn.Module, fn) -> tuple[int, dict]:
    """The peak bytes (`PeakMemory`) of ``fn()`` up to ``module``'s first call, which is not run,
    and the keyword arguments that call got (after ``module``'s own pre-hooks)."""
    seen: dict = {}

    def stop(_, args, kwargs):
        seen.update(kwargs)
        raise _Reached

    handle = module.register_forward_pre_hook(stop, with_kwargs=True)
    try:
        with PeakMemory() as memory:
            fn()
    except _Reached:
        return memory.peak, seen
    finally:
        handle.remove()
    raise ValueError(f"{type(module).__name__} was never called")


def _topology(sp_size: int, ulysses_degree: int | None):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..topology import init_sequence_parallel

    if not dist.is_initialized():
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=0, world_size=sp_size)
    topo = init_sequence_parallel(sp_size, ulysses_degree=ulysses_degree)
    return dataclasses.replace(topo, device=torch.device("meta"))


def measure(backend: str, *, seq: int = 131072, sp: int = 8, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
            dtype=torch.bfloat16, ulysses_degree: int | None = None, kernel: str = "auto", cu_seqlens=None) -> dict:
    """Rank 0's transient bytes (allocated beyond its q, k, v shards) at the peak of the
    forward and of the backward of ``backend``, with the local shard sizes to compare."""
    from ..attention import make_spec
    from ..registry import get_backend

    topo = _topology(sp, ulysses_degree)
    local = seq // sp
    q = torch.empty(1, local, heads, head_dim, dtype=dtype, device="meta", requires_grad=True)
    k, v = (torch.empty(1, local, kv_heads, head_dim, dtype=dtype, device="meta", requires_grad=True) for _ in range(2))
    spec = make_spec(q, k, v, topo, kernel=kernel, cu_seqlens=cu_seqlens)  # local checks only: no handshake
    impl = get_backend(backend)
    with PeakMemory() as fwd:
        out = impl.forward(q, k, v, spec, topo)
    with PeakMemory() as bwd:
        out.backward(torch.empty_like(out))
    return {
        "backend": backend, "kernel": spec.kernel, "seq": seq, "sp": sp, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
        "dtype": str(dtype).replace("torch.", ""), "q_shard_bytes": q.numel() * q.element_size(),
        "kv_shard_bytes": k.numel() * k.element_size(), "forward_peak_bytes": fwd.peak, "backward_peak_bytes": bwd.peak,
        # all-gather: full-length K and V of one chunk of KV heads
        "gathered_chunk_bytes": 2 * seq * head_dim * q.element_size() * impl.stride(spec) if hasattr(impl, "stride") else 0,
    }


def _layer_peaks(strategy_cls, attention_cls, rotary_cls, config, seq: int, sp: int, inputs) -> dict:
    """Rank 0's peak bytes in the forward and the backward of one attention layer of ``attention_cls`` (bf16, the meta
    device, a fake process group of ``sp`` ranks) under ``strategy_cls``, called with ``inputs(rotary, hidden,
    positions)`` (its positional arguments), with this rank's input shard to compare."""
    from ..models import coverage, switch  # noqa: F401 - switch registers the "ulysses_sp" attention function

    topo = _topology(sp, None)
    config._attn_implementation = "ulysses_sp"
    with torch.device("meta"):
        layer = attention_cls(config, layer_idx=0).to(torch.bfloat16)
        rotary = rotary_cls(config)
    strategy = strategy_cls(topo)
    layer.__dict__[coverage.MIXER] = (strategy, {})
    local = seq // sp
    hidden = torch.empty(1, local, config.hidden_size, dtype=torch.bfloat16, device="meta", requires_grad=True)
    positions = torch.arange(local, device="meta")[None]
    args, kwargs = inputs(rotary, hidden, positions)
    with PeakMemory() as fwd:
        out = strategy(layer, type(layer).forward.__get__(layer), args, kwargs, 1, local, None)[0]
    with PeakMemory() as bwd:
        out.backward(torch.empty_like(out))
    return {"seq": seq, "sp": sp, "input_shard_bytes": hidden.numel() * hidden.element_size(), "forward_peak_bytes": fwd.peak,
            "backward_peak_bytes": bwd.peak}


def measure_indexed(*, seq: int = 131072, sp: int = 8) -> dict:
    """Rank 0's peak bytes in the forward and the backward of one DeepSeek-V3.2 attention layer (its default
    config: 128 heads, latent 512 + 64, indexer 64 x 128 choosing 2048) under the ``indexed`` strategy, bf16,
    with this rank's input shard to compare."""
    import transformers
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

    from ..mixers.indexed import IndexedAttention

    return _layer_peaks(IndexedAttention, dsv32.DeepseekV32Attention, dsv32.DeepseekV32RotaryEmbedding, transformers.DeepseekV32Config(), seq, sp,
                        lambda rotary, hidden, positions: ((hidden, rotary(hidden, positions)), {"position_ids": positions}))


def measure_compressed(*, seq: int = 131072, sp: int = 8, kind: str = "compressed_sparse_attention") -> dict:
    """Rank 0's peak bytes in the forward and the backward of one DeepSeek-V4 attention layer of ``kind`` (its default
    config: 64 heads of 512 over one K=V head, a window of 128; entries of 4 tokens chosen 512 by an indexer of 64 x 128,
    or of 128 tokens) under the ``compressed`` strategy, bf16, with this rank's input shard to compare."""
    import transformers
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

    from ..mixers.compressed import CompressedAttention

    config = transformers.DeepseekV4Config()
    config.layer_types = [kind] * config.num_hidden_layers

    def inputs(rotary, hidden, positions):
        return (hidden, {name: rotary(hidden, positions, layer_type=name) for name in ("main", "compress")}, positions), {}

    return dict(_layer_peaks(CompressedAttention, dsv4.DeepseekV4Attention, dsv4.DeepseekV4RotaryEmbedding, config, seq, sp, inputs), kind=kind)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=131072)
    p.add_argument("--sp", type=int, default=8)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--ulysses-degree", type=int, default=2, help="for the hybrid")
    p.add_argument("--kernel", default="auto")
    p.add_argument("--backends", default="ulysses,allgather,ring,hybrid")
    p.add_argument("--json", action="store_true")
    p.add_argument("--indexed", action="store_true", help="one DeepSeek-V3.2 attention layer under the indexed strategy instead")
    p.add_argument("--compressed", choices=("compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"),
                   help="one DeepSeek-V4 attention layer of this kind under the compressed strategy instead")
    a = p.parse_args(argv)
    if a.compressed:
        r = measure_compressed(seq=a.seq, sp=a.sp, kind=a.compressed)
        print(json.dumps(r) if a.json else f"S={a.seq} P={a.sp} DeepSeek-V4 {a.compressed} layer, compressed, bf16: forward "
              f"{r['forward_peak_bytes'] / 2**30:.2f} GiB, backward {r['backward_peak_bytes'] / 2**30:.2f} GiB per rank")
        return
    if a.indexed:
        r = measure_indexed(seq=a.seq, sp=a.sp)
        print(json.dumps(r) if a.json else f"S={a.seq} P={a.sp} DeepSeek-V3.2 attention layer, indexed, bf16: forward "
              f"{r['forward_peak_bytes'] / 2**30:.2f} GiB, backward {r['backward_peak_bytes'] / 2**30:.2f} GiB per rank")
        return
    rows = [measure(b, seq=a.seq, sp=a.sp, heads=a.heads, kv_heads=a.kv_heads, head_dim=a.head_dim, ulysses_degree=a.ulysses_degree, kernel=a.kernel)
            for b in a.backends.split(",")]
    if a.json:
        print(json.dumps(rows))
        return
    gib = 2**30
    print(f"S={a.seq} P={a.sp} H{a.heads}/KV{a.kv_heads} D{a.head_dim} bf16: transient bytes per rank (beyond the q, k, v shards)")
    for r in rows:
        shards = r["q_shard_bytes"] + 2 * r["kv_shard_bytes"]
        print(f"  {r['backend']:10s} kernel {r['kernel']:10s} forward {r['forward_peak_bytes'] / gib:7.3f} GiB ({r['forward_peak_bytes'] / shards:5.2f} x q+k+v)"
              f"  backward {r['backward_peak_bytes'] / gib:7.3f} GiB ({r['backward_peak_bytes'] / shards:5.2f} x q+k+v)")


if __name__ == "__main__":
    main()
