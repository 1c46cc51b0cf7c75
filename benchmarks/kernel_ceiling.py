"""The best scaling efficiency this machine allows, without any communication: N spawned
ranks (one thread each) each run causal attention fwd+bwd on the whole sequence with
H/N of the heads, at the same time, against one process with all H heads. Whatever
the efficiency here falls short of 1.0 (shared caches and memory bandwidth, the other
core no longer idle) no SP backend can recover.

    python benchmarks/kernel_ceiling.py --nproc 2 --seq 4k,16k --heads 8
"""

from __future__ import annotations

import statistics
import time

import click
import torch
import torch.distributed as dist

from ulysses_sp import kernels
from ulysses_sp.cli.plan import parse_tokens
from ulysses_sp.launch import run_ranks


def _attention_seconds(seq: int, heads: int, repeat: int, barrier: bool) -> float:
    q, k, v, dout = (torch.randn(1, seq, heads, 64) for _ in range(4))
    times = []
    for _ in range(repeat + 1):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        if barrier:
            dist.barrier()
        t0 = time.perf_counter()
        kernels.local_attention(*leaves, causal=True).backward(dout)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def _rank(rank, world, seq, heads, repeat):
    return _attention_seconds(seq, heads // world, repeat, barrier=True)


@click.command()
@click.option("--nproc", default=2, show_default=True)
@click.option("--seq", default="4k,16k", show_default=True)
@click.option("--heads", default=8, show_default=True)
@click.option("--repeat", default=3, show_default=True)
def main(nproc, seq, heads, repeat):
    torch.set_num_threads(1)
    for s in (parse_tokens(x) for x in seq.split(",")):
        t1 = _attention_seconds(s, heads, repeat, barrier=False)
        tn = max(run_ranks(_rank, nproc, s, heads, repeat, timeout=3600))
        click.echo(f"S={s} H={heads}: one process {t1:.3f} s; {nproc} at once with {heads // nproc} heads each {tn:.3f} s; "
                   f"ceiling T1 / (P x T) = {t1 / (nproc * tn):.3f}")


if __name__ == "__main__":
    main()
