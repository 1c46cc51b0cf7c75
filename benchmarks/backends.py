"""Forward and forward+backward time and bytes of every backend, one attention shape,
on N spawned gloo ranks (CPU, one thread per rank), next to one process doing the
whole sequence. A stop-gap until `sp-bench run` exists; results go to --json.

    python benchmarks/backends.py --nproc 2 --seq 8192 --heads 8 --kv-heads 2 --head-dim 64
"""

from __future__ import annotations

import json
import platform
import statistics
import time

import click
import torch

import ulysses_sp as usp
from ulysses_sp import kernels
from ulysses_sp.launch import run_ranks


def _shards(topo, cfg, dtype):
    gen = torch.Generator().manual_seed(topo.rank)
    s = cfg["seq"] // topo.sp_size
    make = lambda h: torch.randn(cfg["batch"], s, h, cfg["head_dim"], generator=gen, dtype=dtype)  # noqa: E731
    return make(cfg["heads"]), make(cfg["kv_heads"]), make(cfg["kv_heads"]), make(cfg["heads"])


def _rank(rank, world, cfg):
    import torch.distributed as dist

    dtype = getattr(torch, cfg["dtype"])
    topo = usp.init_sequence_parallel(world, ulysses_degree=cfg["ulysses_degree"], layout=cfg["layout"])
    q, k, v, dout = _shards(topo, cfg, dtype)
    results = {}
    for backend in cfg["backends"]:
        spec = usp.attention.make_spec(q, k, v, topo, causal=cfg["causal"])
        reason = usp.get_backend(backend).check(spec, topo)
        if reason:
            results[backend] = {"skipped": reason}
            continue
        attn = usp.SequenceParallelAttention(topo, backend=backend)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        attn(*leaves, causal=cfg["causal"]).backward(dout)  # warm-up (and the shape handshake)
        fwd_times, total_times = [], []
        for _ in range(cfg["repeat"]):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            dist.barrier(topo.sp_group)
            t0 = time.perf_counter()
            with usp.CommCounter() as fwd_bytes:
                out = attn(*leaves, causal=cfg["causal"])
            t1 = time.perf_counter()
            with usp.CommCounter() as bwd_bytes:
                out.backward(dout)
            t2 = time.perf_counter()
            fwd_times.append(t1 - t0)
            total_times.append(t2 - t0)
        results[backend] = {
            "fwd_s": fwd_times,
            "fwd_bwd_s": total_times,
            "fwd_bytes_sent": fwd_bytes.bytes_sent,
            "bwd_bytes_sent": bwd_bytes.bytes_sent,
            "estimated_fwd_bytes": usp.get_backend(backend).estimate(spec, topo, usp.CPU_GLOO_PROFILE).comm_bytes,
        }
    return results


def _one_process(cfg) -> float:
    torch.set_num_threads(1)
    dtype = getattr(torch, cfg["dtype"])
    shape = (cfg["batch"], cfg["seq"])
    q = torch.randn(*shape, cfg["heads"], cfg["head_dim"], dtype=dtype, requires_grad=True)
    k, v = (torch.randn(*shape, cfg["kv_heads"], cfg["head_dim"], dtype=dtype, requires_grad=True) for _ in range(2))
    times = []
    for _ in range(cfg["repeat"] + 1):
        t0 = time.perf_counter()
        kernels.local_attention(q, k, v, causal=cfg["causal"]).backward(torch.ones_like(q))
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _slowest(per_rank, backend: str, key: str) -> list[float]:
    """Per repeat, the slowest rank's time (the step takes as long as its slowest rank)."""
    return [max(times) for times in zip(*(r[backend][key] for r in per_rank))]


@click.command()
@click.option("--nproc", default=2, show_default=True)
@click.option("--backends", default="ulysses,allgather,ring,hybrid", show_default=True)
@click.option("--batch", default=1, show_default=True)
@click.option("--seq", default=8192, show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--kv-heads", default=2, show_default=True)
@click.option("--head-dim", default=64, show_default=True)
@click.option("--dtype", default="float32", show_default=True)
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--layout", default="zigzag", show_default=True)
@click.option("--ulysses-degree", default=None, type=int, help="for the hybrid (default: sp size)")
@click.option("--repeat", default=3, show_default=True)
@click.option("--json", "json_path", default=None, help="write every figure and the environment here")
def main(json_path, backends, nproc, **cfg):
    cfg["backends"] = backends.split(",")
    per_rank = run_ranks(_rank, nproc, cfg, timeout=3600, collective_timeout=600)
    one = _one_process(cfg)
    rows = {}
    for backend in cfg["backends"]:
        if "skipped" in per_rank[0][backend]:
            rows[backend] = per_rank[0][backend]
            continue
        rows[backend] = {
            "fwd_s_median": statistics.median(_slowest(per_rank, backend, "fwd_s")),
            "fwd_bwd_s_median": statistics.median(_slowest(per_rank, backend, "fwd_bwd_s")),
            "fwd_bwd_s_all": _slowest(per_rank, backend, "fwd_bwd_s"),
            **{k: per_rank[0][backend][k] for k in ("fwd_bytes_sent", "bwd_bytes_sent", "estimated_fwd_bytes")},
        }
    click.echo(f"one process, whole sequence, fwd+bwd: {one:.3f} s")
    click.echo(f"{'backend':10s} {'fwd s':>8s} {'fwd+bwd s':>10s} {'fwd bytes':>12s} {'bwd bytes':>12s}")
    for backend, row in rows.items():
        if "skipped" in row:
            click.echo(f"{backend:10s} skipped: {row['skipped']}")
        else:
            click.echo(
                f"{backend:10s} {row['fwd_s_median']:8.3f} {row['fwd_bwd_s_median']:10.3f} "
                f"{row['fwd_bytes_sent']:12d} {row['bwd_bytes_sent']:12d}"
            )
    if json_path:
        env = {"torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
               "nproc": nproc, "threads_per_rank": 1, "backend": "gloo", "device": "cpu"}
        with open(json_path, "w") as f:
            json.dump({"config": cfg, "env": env, "one_process_fwd_bwd_s": one, "results": rows}, f, indent=2)


if __name__ == "__main__":
    main()
