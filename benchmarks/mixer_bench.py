"""What the mixer strategies cost: one Gated DeltaNet layer (Qwen3-Next's, transformers' torch
code) forward + backward on P gloo ranks under the allgather and the ulysses strategies, against
the same layer on the whole sequence in one process and on one rank's shard alone (the compute
an even split of the mixer reaches). Median of ``--repeat`` after one warm-up, slowest rank;
bytes each rank sent, counted.

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
    layer = _layer()
    x = torch.randn(1, seq // world, HIDDEN, requires_grad=True)
    out = {}
    for name in ("allgather", "ulysses"):
        mixer = get_mixer(name, topo, layer)

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
    print("| tokens | P | one process, whole sequence | allgather on P ranks (MiB sent) | ulysses on P ranks (MiB sent) | one rank's shard alone |")
    print("|---|---|---|---|---|---|")
    for seq in [int(s) for s in a.seq.split(",")]:
        layer, x = _layer(), torch.randn(1, seq, HIDDEN, requires_grad=True)
        whole = _time(_fwd_bwd(layer, x), a.repeat)
        for world in [int(w) for w in a.ranks.split(",")]:
            r = run_ranks(_rank, world, seq, a.repeat, timeout=1800)[0]
            cells = [f"{r[n][0] * 1e3:.0f} ms ({r[n][1] / 2**20:.2f})" for n in ("allgather", "ulysses")]
            print(f"| {seq} | {world} | {whole * 1e3:.0f} ms | {cells[0]} | {cells[1]} | {r['shard'] * 1e3:.0f} ms |", flush=True)


if __name__ == "__main__":
    main()
