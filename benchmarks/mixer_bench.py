"""What the allgather mixer costs: one Gated DeltaNet layer (Qwen3-Next's, transformers' torch
code) forward + backward on P gloo ranks under the allgather strategy, against the same layer on
the whole sequence in one process and on one rank's shard alone (the compute a split of the
mixer across ranks could reach). Median of ``--repeat`` after one warm-up, slowest rank; bytes
each rank sent, counted.

    python benchmarks/mixer_bench.py --seq 4096,8192,16384 --ranks 2,4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

HIDDEN, HEADS, KEY_HEADS, HEAD_DIM = 256, 8, 4, 32


def _layer():
    import transformers
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet

    config = transformers.Qwen3NextConfig(hidden_size=HIDDEN, linear_num_value_heads=HEADS, linear_num_key_heads=KEY_HEADS,
                                          linear_key_head_dim=HEAD_DIM, linear_value_head_dim=HEAD_DIM, linear_conv_kernel_dim=4)
    torch.manual_seed(0)
    return Qwen3NextGatedDeltaNet(config, layer_idx=0)


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


def _rank(rank: int, world: int, seq: int, repeat: int) -> dict:
    import torch.distributed as dist

    import ulysses_sp as usp
    from ulysses_sp.mixers import get_mixer

    torch.set_num_threads(1)
    topo = usp.init_sequence_parallel(world, timeout=600)
    layer, mixer = _layer(), get_mixer("allgather", topo)
    x = torch.randn(1, seq // world, HIDDEN, requires_grad=True)

    def allgather():
        x.grad = None
        mixer(layer.forward, (x,), {}, 1, x.shape[1], None).sum().backward()

    seconds = _time(allgather, repeat)
    with usp.CommCounter() as counter:
        allgather()
    shard = _time(_fwd_bwd(layer, x), repeat)
    slowest = torch.tensor([seconds, shard], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return {"allgather": slowest[0].item(), "shard": slowest[1].item(), "sent": counter.bytes_sent}


def main() -> None:
    from ulysses_sp.launch import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="4096,8192,16384")
    p.add_argument("--ranks", default="2,4")
    p.add_argument("--repeat", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    print(f"Gated DeltaNet layer, hidden {HIDDEN}, {HEADS} value / {KEY_HEADS} key heads of {HEAD_DIM}, fp32, forward + backward, "
          f"median of {a.repeat} (slowest rank)\n")
    print("| tokens | P | one process, whole sequence | allgather mixer on P ranks | one rank's shard alone | MiB sent per rank |")
    print("|---|---|---|---|---|---|")
    for seq in [int(s) for s in a.seq.split(",")]:
        layer, x = _layer(), torch.randn(1, seq, HIDDEN, requires_grad=True)
        whole = _time(_fwd_bwd(layer, x), a.repeat)
        for world in [int(w) for w in a.ranks.split(",")]:
            r = run_ranks(_rank, world, seq, a.repeat, timeout=1800)[0]
            print(f"| {seq} | {world} | {whole * 1e3:.0f} ms | {r['allgather'] * 1e3:.0f} ms | {r['shard'] * 1e3:.0f} ms | "
                  f"{r['sent'] / 2**20:.2f} |", flush=True)


if __name__ == "__main__":
    main()
