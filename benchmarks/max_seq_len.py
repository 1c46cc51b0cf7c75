"""The longest sequence the embedded model (train.py's default) can take one training
step on under a per-rank memory limit, with SP=1 and with SP=2.

Per rank and sequence length: one forward, `sp_cross_entropy` and backward on the
passkey task, and the step's peak memory above the memory held before it (model,
gradients of the previous step freed): on CPU the peak resident set (VmHWM,
reset through /proc/self/clear_refs), as `sp-bench run` measures it. Lengths grow
by --step tokens until a rank's peak exceeds --limit-mib; the last length that
fit is the maximum.

    python benchmarks/max_seq_len.py --limit-mib 256 --json benchmarks/results/max-seq-len.json
"""

from __future__ import annotations

import datetime
import json
import os
import platform

import click
import torch

from ulysses_sp.cli.bench import MMAP_THRESHOLD, PeakMemory, memory_method
from ulysses_sp.launch import run_ranks


def _rank(rank, world, limit, step_tokens, max_tokens, backend):
    import ulysses_sp as usp
    from ulysses_sp.tasks import PAD_ID, passkey_batch
    from ulysses_sp.trainer import TrainConfig, build_model

    topo = usp.init_sequence_parallel(world, layout="zigzag", timeout=3600)
    model = usp.apply_sequence_parallel(build_model(TrainConfig(sp_size=world)), topo, backend=backend)
    model.train()
    fits, rows = 0, []
    for seq in range(step_tokens, max_tokens + 1, step_tokens):
        batch = usp.shard_batch(passkey_batch(seq, seed=0, step=0, dp_rank=0), topo, pad_token_id=PAD_ID)
        model.zero_grad(set_to_none=True)
        with PeakMemory(topo.device) as mem:
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
            usp.sp_cross_entropy(logits, batch["shift_labels"], topo).backward()
            del logits
        worst = max(p[0] for p in usp.comm.all_gather_ints((mem.peak,), topo.sp_group, topo.device))
        rows.append({"seq": seq, "peak_bytes_max_over_ranks": worst})
        if worst > limit:
            break
        fits = seq
    return {"max_seq": fits, "steps": rows}


@click.command()
@click.option("--limit-mib", default=256, show_default=True, help="per-rank memory a training step may use")
@click.option("--step", "step_tokens", default=1024, show_default=True, help="sequence-length resolution")
@click.option("--max-tokens", default=65536, show_default=True)
@click.option("--backend", default="auto", show_default=True)
@click.option("--json", "json_path", default=None)
def main(limit_mib, step_tokens, max_tokens, backend, json_path):
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))
    limit = limit_mib * 2**20
    results = {}
    for sp in (1, 2):
        results[sp] = run_ranks(_rank, sp, limit, step_tokens, max_tokens, backend, timeout=7200, collective_timeout=3600)[0]
        peaks = ", ".join(f"{r['seq']}: {r['peak_bytes_max_over_ranks'] / 2**20:.0f} MiB" for r in results[sp]["steps"])
        click.echo(f"SP={sp}: longest sequence under {limit_mib} MiB per rank: {results[sp]['max_seq']} tokens (peaks: {peaks})")
    ratio = results[2]["max_seq"] / max(1, results[1]["max_seq"])
    click.echo(f"SP=2 / SP=1: {ratio:.2f}x")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"command": "python benchmarks/max_seq_len.py " + f"--limit-mib {limit_mib} --step {step_tokens} --backend {backend}",
                       "date": datetime.date.today().isoformat(), "torch": torch.__version__, "machine": platform.machine(),
                       "cpus": os.cpu_count(), "memory": memory_method(torch.device("cpu")), "limit_mib": limit_mib,
                       "results": results, "ratio": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
