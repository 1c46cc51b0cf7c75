"""Where a Ulysses (or ring) step's time goes: torch.profiler self CPU time per op on rank 0,
ours (zigzag and contiguous layouts) beside DeepSpeed's DistributedAttention, all on the same
local kernel (``kernels.local_attention``), fwd+bwd of one causal attention call; with
``--ways ring,torch-ring``, our zigzag ring beside torch's ring (sp-bench's peer).

    python benchmarks/profile_ulysses.py [--seq 4096] [--heads 8] [--kv-heads 8] [--head-dim 64] [--repeat 3]
                                         [--ways ours-zigzag,ours-contiguous,deepspeed] [--dtype float32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist

from ulysses_sp.launch import run_ranks

WAYS = ("ours-zigzag", "ours-contiguous", "deepspeed", "ring", "torch-ring")


def _rank(rank, world, seq, heads, kv_heads, head_dim, repeat, top, ways, dtype):
    import ulysses_sp as usp
    from ulysses_sp import kernels
    from ulysses_sp.integrations.deepspeed import use_cpu_accelerator_if_needed

    use_cpu_accelerator_if_needed()
    import deepspeed
    from deepspeed.sequence.layer import DistributedAttention

    deepspeed.init_distributed(dist_backend="gloo")  # joins the running group
    out = {}
    for way in ways:
        topo = usp.init_sequence_parallel(world, layout="contiguous" if way in ("ours-contiguous", "deepspeed") else "zigzag")
        torch.manual_seed(0)
        q_l, k_l, v_l = (usp.shard_sequence(torch.randn(1, seq, h, head_dim).to(getattr(torch, dtype)), topo).requires_grad_()
                         for h in (heads, kv_heads, kv_heads))
        if way == "torch-ring":
            from ulysses_sp.cli.bench import Cell
            from ulysses_sp.cli.peers import PEERS

            attn = PEERS["torch-ring"].make(Cell(seq, heads, kv_heads, head_dim, 1, dtype, True, "zigzag"), topo)
            step = lambda: attn(q_l, k_l, v_l)  # noqa: E731
        elif way == "ring":
            ours = usp.SequenceParallelAttention(topo, backend="ring")
            step = lambda: ours(q_l, k_l, v_l, causal=True)  # noqa: E731
        elif way == "deepspeed":
            attn = DistributedAttention(lambda q, k, v, *a, **kw: kernels.local_attention(q, k, v, causal=True), topo.sp_group,
                                        scatter_idx=2, gather_idx=1)
            step = lambda: attn(q_l, k_l, v_l, batch_dim_idx=0)  # noqa: E731
        else:
            ours = usp.SequenceParallelAttention(topo, backend="ulysses")
            step = lambda: ours(q_l, k_l, v_l, causal=True)  # noqa: E731
        for _ in range(2):
            step().sum().backward()
        dist.barrier()
        seconds = []
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(repeat):
                t0 = time.perf_counter()
                step().sum().backward()
                seconds.append(time.perf_counter() - t0)
        dist.barrier()
        ops = sorted(((e.key, e.self_cpu_time_total / 1e3 / repeat, e.count // repeat) for e in prof.key_averages()), key=lambda r: -r[1])
        out[way] = {"fwd_bwd_ms": [s * 1e3 for s in seconds], "top_ops_ms_per_step": ops[:top]}
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads (DeepSpeed's Ulysses needs as many)")
    p.add_argument("--ways", default="ours-zigzag,ours-contiguous,deepspeed", help=f"comma list of {', '.join(WAYS)}")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    ways = a.ways.split(",")
    unknown = set(ways) - set(WAYS)
    if unknown:
        p.error(f"unknown ways {sorted(unknown)}; choose from {', '.join(WAYS)}")
    result = run_ranks(_rank, a.nproc, a.seq, a.heads, a.kv_heads or a.heads, a.head_dim, a.repeat, a.top, ways, a.dtype, timeout=1800)[0]
    for way, r in result.items():
        print(f"{way}: fwd+bwd ms {', '.join(f'{t:.0f}' for t in r['fwd_bwd_ms'])}")
        for name, ms, calls in r["top_ops_ms_per_step"]:
            print(f"  {ms:8.1f} ms  x{calls:<3d} {name}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": "python benchmarks/profile_ulysses.py " + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in vars(a).items() if k != "json" and v is not None),
                       "per_way": result}, f, indent=1)


if __name__ == "__main__":
    main()
