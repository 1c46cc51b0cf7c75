"""``sp-bench mixers``: what the mixer strategies cost. One mixer layer of each kind (Qwen3-Next's
Gated DeltaNet, Bamba's Mamba2, LFM2's short convolution, Kimi Linear's Kimi Delta Attention; transformers' torch code, so transformers
must be installed) forward + backward on P gloo ranks under every strategy that can run it, against
the same layer on the whole sequence in one process and on one rank's shard alone (the compute an
even split of the mixer reaches). Median of ``repeat`` after one warm-up, slowest rank; bytes rank 0
sent in one forward and backward, counted.
"""

from __future__ import annotations

import statistics
import time

import torch

HIDDEN = 256
LAYERS = {
    "gdn": "Gated DeltaNet (Qwen3-Next), 8 value / 4 key heads of 32, conv kernel 4",
    "mamba2": "Mamba2 (Bamba), 8 heads of 64, 1 group, state 64, conv kernel 4",
    "conv": "short convolution (LFM2), kernel 3",
    "kda": "Kimi Delta Attention (Kimi Linear), 8 heads of 32, conv kernel 4",
}


def _layer(kind: str):
    import transformers

    from ulysses_sp.models import adapters  # noqa: F401 - the layers' adapters and reaches, registered

    torch.manual_seed(0)
    if kind == "gdn":
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

        return Qwen3NextGatedDeltaNet(transformers.Qwen3NextConfig(hidden_size=HIDDEN, linear_num_value_heads=8, linear_num_key_heads=4,
                                                                   linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4), 0)
    if kind == "mamba2":
        from transformers.models.bamba.modeling_bamba import BambaMixer

        return BambaMixer(transformers.BambaConfig(hidden_size=HIDDEN, mamba_n_heads=8, mamba_d_head=64, mamba_expand=2, mamba_n_groups=1,
                                                   mamba_d_state=64, mamba_d_conv=4), 0)
    if kind == "kda":
        from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

        return KimiLinearDeltaAttention(transformers.KimiLinearConfig(hidden_size=HIDDEN, linear_num_heads=8, linear_head_dim=32,
                                                                      linear_conv_kernel_dim=4, layer_types=["linear_attention"],
                                                                      mlp_layer_types=["dense"], num_hidden_layers=1), 0)
    from transformers.models.lfm2.modeling_lfm2 import Lfm2ShortConv

    return Lfm2ShortConv(transformers.Lfm2Config(hidden_size=HIDDEN, conv_L_cache=3, layer_types=["conv"], num_hidden_layers=1), 0)


def _time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _fwd_bwd(layer, x):
    def run():
        x.grad = None
        layer(x).sum().backward()
    return run


def _rank(rank: int, world: int, kind: str, seq: int, repeat: int) -> dict:
    import torch.distributed as dist

    import ulysses_sp as usp
    from ulysses_sp.mixers import BUILT_IN, MIXERS

    torch.set_num_threads(1)
    topo = usp.init_sequence_parallel(world, timeout=600)
    layer = _layer(kind)
    x = torch.randn(1, seq // world, HIDDEN, requires_grad=True)
    out = {}
    for name in BUILT_IN:
        mixer = MIXERS[name](topo)
        if mixer.check(layer) is not None:
            continue

        def run():
            x.grad = None
            mixer(layer, layer.forward, (x,), {}, 1, x.shape[1], None).sum().backward()

        seconds = _time(run, repeat)
        with usp.CommCounter() as counter:
            run()
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        out[name] = (slowest.item(), counter.bytes_sent)
    shard = torch.tensor([_time(_fwd_bwd(layer, x), repeat)], dtype=torch.float64)
    dist.all_reduce(shard, op=dist.ReduceOp.MAX)
    out["shard"] = shard.item()
    return out


def rows(kinds, seqs, worlds, repeat: int):
    """One dict per (mixer, tokens, P): seconds of one process, of the shard alone, and per strategy
    (seconds, bytes rank 0 sent forward and backward), as measured."""
    from ulysses_sp.launch import run_ranks

    torch.set_num_threads(1)
    for kind in kinds:
        for seq in seqs:
            layer, x = _layer(kind), torch.randn(1, seq, HIDDEN, requires_grad=True)
            whole = _time(_fwd_bwd(layer, x), repeat)
            for world in worlds:
                r = run_ranks(_rank, world, kind, seq, repeat, timeout=1800)[0]
                yield {"mixer": kind, "tokens": seq, "ranks": world, "one_process_s": whole, "shard_s": r.pop("shard"),
                       "strategies": {name: {"seconds": s, "bytes_sent": b} for name, (s, b) in r.items()}}
