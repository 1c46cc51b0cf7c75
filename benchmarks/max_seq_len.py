"""The longest sequence a Llama-3-shaped model trains one step on under a per-rank memory
cap, with the memory stack off and on, at SP=1 and SP=2; and what tiling costs in time.

The model is shaped like Llama 3 but tiny: vocabulary 128,256, hidden 256, intermediate
1024, 4 layers, 8 q / 2 kv heads, so the logits ([tokens, 128k]) dominate as they do at
scale. Configurations, each at SP=1 and SP=2:

* ``off``: the model's logits and ``sp_cross_entropy``;
* ``loss``: ``causal_lm_loss`` (tiled fused linear + cross-entropy);
* ``loss+mlp``: and ``apply_sequence_parallel(tiled_mlp=True)``;
* ``all``: and ``checkpoint="offload"`` (per-layer checkpoints, inputs offloaded).

**Memory** is measured at real shapes without running the arithmetic: one process plays
rank 0 of the SP group on the meta device with torch's fake process group, and
:class:`ulysses_sp.testing.memory.PeakMemory` adds up what every op allocates during one
forward, loss and backward (what a CUDA caching allocator's "allocated" counter would
see; offloaded tensors leave the device, which the meta device cannot show, so ``all``
differs from ``loss+mlp`` here by the per-layer checkpointing only). Lengths double
from ``--start`` until the peak passes ``--cap-mib``, then bisect to ``--resolution``.

**Time** is one real training step on CPU (gloo, spawned ranks, fp32) at ``--time-seq``
tokens, median of ``--repeat``, for every configuration at SP=2.

    python benchmarks/max_seq_len.py --cap-mib 3072 --json benchmarks/results/max-seq-len-memory-stack.json \\
        --plot benchmarks/results/max-seq-len-memory-stack.png
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import time

import click
import torch

from ulysses_sp.launch import run_ranks

CONFIGS = {
    "off": {},
    "loss": {"tiled_loss": True},
    "loss+mlp": {"tiled_loss": True, "tiled_mlp": True},
    "all": {"tiled_loss": True, "tiled_mlp": True, "checkpoint": "offload"},
}
MODEL = dict(vocab_size=128256, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 23, tie_word_embeddings=False, use_cache=False)


def build(topo, config: str, dtype, device):
    """The model switched to SP with ``config``'s options, and its loss function."""
    import transformers

    import ulysses_sp as usp

    options = CONFIGS[config]
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**MODEL, attn_implementation="sdpa")).to(dtype)
    model.train()
    usp.apply_sequence_parallel(model, topo, backend="auto", tiled_mlp=options.get("tiled_mlp", False),
                                checkpoint=options.get("checkpoint", "none"))

    def loss_fn(batch):
        if options.get("tiled_loss"):
            return usp.causal_lm_loss(model, batch, topo)
        logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        return usp.sp_cross_entropy(logits, batch["shift_labels"], topo)

    return model, loss_fn


def _batch(seq: int, topo, device):
    import ulysses_sp as usp

    ids = torch.randint(0, MODEL["vocab_size"], (1, seq))
    local = usp.shard_batch({"input_ids": ids, "labels": ids.clone()}, topo)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in local.items()}


def peak_bytes(config: str, sp: int, seq: int, dtype) -> int:
    """Rank 0's peak bytes allocated during one step at ``seq`` tokens (meta device)."""
    import transformers.masking_utils

    from ulysses_sp.testing.memory import PeakMemory, _topology

    # transformers looks for packed documents by reading position ids back (.item()), which meta
    # tensors cannot do; these batches are one document each, so the answer is known: none
    transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None
    topo = _topology(sp, None)
    model, loss_fn = build(topo, config, dtype, "meta")
    batch = _batch(seq, dataclasses.replace(topo, device=torch.device("cpu")), "meta")
    with PeakMemory() as mem:
        loss_fn(batch).backward()
    return mem.peak


def _memory_worker(sp: int, configs, cap: int, start: int, resolution: int, max_tokens: int, dtype_name: str) -> dict:
    """In a fresh process (the fake process group is per process): every config's search at one SP size."""
    dtype = getattr(torch, dtype_name)
    out = {}
    for config in configs:
        points, fits, seq = {}, 0, start
        while seq <= max_tokens:  # double until the cap is passed
            points[seq] = peak_bytes(config, sp, seq, dtype)
            if points[seq] > cap:
                break
            fits, seq = seq, 2 * seq
        lo, hi = fits, min(seq, max_tokens + resolution)
        while hi - lo > resolution and points.get(lo, 0) <= cap and lo:  # bisect between the last fit and the first miss
            mid = (lo + hi) // 2 // resolution * resolution
            points[mid] = peak_bytes(config, sp, mid, dtype)
            lo, hi = (mid, hi) if points[mid] <= cap else (lo, mid)
        out[config] = {"max_seq": lo, "capped_by": "memory" if seq <= max_tokens else "max_tokens",
                       "peak_bytes": {str(s): b for s, b in sorted(points.items())}}
    return out


def _memory(sp: int, configs, cap: int, start: int, resolution: int, max_tokens: int, dtype_name: str) -> dict:
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(_memory_worker, (sp, configs, cap, start, resolution, max_tokens, dtype_name))


def _time_rank(rank, world, configs, seq, repeat):
    import ulysses_sp as usp

    topo = usp.init_sequence_parallel(world, timeout=3600)
    out = {}
    for config in configs:
        model, loss_fn = build(topo, config, torch.float32, "cpu")
        batch = _batch(seq, topo, "cpu")
        times = []
        for i in range(repeat + 1):  # the first step warms up
            model.zero_grad(set_to_none=True)
            torch.distributed.barrier()
            t0 = time.perf_counter()
            loss_fn(batch).backward()
            slowest = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            torch.distributed.all_reduce(slowest, op=torch.distributed.ReduceOp.MAX)
            if i:
                times.append(slowest.item())
        out[config] = statistics.median(times)
    return out


def _plot(path: str, memory: dict, cap: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for sp, per_config in memory.items():
        for config, r in per_config.items():
            points = sorted((int(s), b / 2**20) for s, b in r["peak_bytes"].items())
            ax.plot(*zip(*points), marker="o", linestyle="-" if sp == "1" else "--", color=f"C{list(CONFIGS).index(config)}",
                    label=f"SP={sp} {config}")
    ax.axhline(cap / 2**20, color="grey", linewidth=0.8, label="cap")
    ax.set(xscale="log", yscale="log", xlabel="sequence length (tokens)", ylabel="peak memory per rank (MiB)",
           title="one training step, Llama-3-shaped tiny model (meta device)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


@click.command()
@click.option("--cap-mib", default=3072, show_default=True, help="per-rank memory one training step may allocate")
@click.option("--start", default=1024, show_default=True, help="first length tried (doubling from there)")
@click.option("--resolution", default=1024, show_default=True, help="bisection step, tokens")
@click.option("--max-tokens", default=1 << 22, show_default=True)
@click.option("--dtype", default="bfloat16", show_default=True, help="of the memory measurement (meta device)")
@click.option("--memory/--no-memory", "do_memory", default=True, show_default=True, help="run the memory search")
@click.option("--time-seq", default=2048, show_default=True, help="tokens of the timed CPU step (0: skip timing)")
@click.option("--repeat", default=3, show_default=True)
@click.option("--json", "json_path", default=None)
@click.option("--plot", "plot_path", default=None)
def main(cap_mib, start, resolution, max_tokens, dtype, do_memory, time_seq, repeat, json_path, plot_path):
    cap = cap_mib * 2**20
    memory, all_on = {}, None
    if do_memory:
        memory = {str(sp): _memory(sp, list(CONFIGS), cap, start, resolution, max_tokens, dtype) for sp in (1, 2)}
        click.echo(f"longest sequence under {cap_mib} MiB per rank ({dtype}, meta device, rank 0):")
        click.echo(f"{'config':10s} {'SP=1':>10s} {'SP=2':>10s} {'SP=2/SP=1':>10s}")
        for config in CONFIGS:
            one, two = memory["1"][config]["max_seq"], memory["2"][config]["max_seq"]
            capped = " (max-tokens)" if "max_tokens" in (memory["1"][config]["capped_by"], memory["2"][config]["capped_by"]) else ""
            click.echo(f"{config:10s} {one:10d} {two:10d} {two / max(one, 1):10.2f}{capped}")
        all_on = memory["2"]["all"]["max_seq"] / max(memory["2"]["off"]["max_seq"], 1)
        click.echo(f"SP=2, all on / all off: {all_on:.2f}x")
    times = {}
    if time_seq:
        times = run_ranks(_time_rank, 2, list(CONFIGS), time_seq, repeat, timeout=7200, collective_timeout=3600)[0]
        click.echo(f"one step at {time_seq} tokens, SP=2, fp32 CPU (median of {repeat}): "
                   + ", ".join(f"{c} {t:.2f} s ({t / times['off']:.2f}x)" for c, t in times.items()))
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"command": "python benchmarks/max_seq_len.py " + f"--cap-mib {cap_mib} --dtype {dtype} --time-seq {time_seq} --repeat {repeat}"
                       + ("" if do_memory else " --no-memory"),
                       "date": datetime.date.today().isoformat(), "torch": torch.__version__, "machine": platform.machine(),
                       "cpus": os.cpu_count(), "model": MODEL, "cap_mib": cap_mib, "memory": memory, "all_on_over_off_sp2": all_on,
                       "time_seq": time_seq, "step_seconds_sp2": times}, f, indent=2)
    if plot_path and memory:
        _plot(plot_path, memory, cap)


if __name__ == "__main__":
    main()
