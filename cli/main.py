"""``sp-bench``: inspect and measure sequence-parallel attention backends."""

from __future__ import annotations

import sys

import click

from ulysses_sp import registry


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
def main() -> None:
    """Inspect and measure ulysses-sp's sequence-parallel attention backends."""


@main.command("backends")
def backends() -> None:
    """List the registered backends and what each one needs."""
    for name in registry.list_backends():
        backend = registry.get_backend(name)
        doc = (sys.modules[type(backend).__module__].__doc__ or "").strip().splitlines()
        click.echo(f"{name:10s} {doc[0] if doc else ''}")


def _calibrate_rank(rank, world, repeat, seq):
    from .calibrate import measure

    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=7, desc="calibrate", unit="measure")
    profile = measure(repeat=repeat, seq=seq, progress=progress)
    if progress is not None:
        progress.close()
    return profile.to_json()


@main.command("calibrate")
@click.option("--nproc", type=int, default=2, show_default=True, help="gloo ranks to spawn (ignored under torchrun/deepspeed)")
@click.option("--out", type=click.Path(dir_okay=False), default="profile.json", show_default=True)
@click.option("--repeat", type=int, default=5, show_default=True)
@click.option("--seq", type=int, default=2048, show_default=True, help="tokens of the attention kernel measurement")
def calibrate(nproc, out, repeat, seq):
    """Measure collectives and the attention kernel here; write a profile for auto and plan."""
    import os

    import torch.distributed as dist

    from ulysses_sp.launch import run_ranks
    from ulysses_sp.profile import Profile

    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # inside a launcher: use its ranks
        if not dist.is_initialized():
            dist.init_process_group("nccl" if __import__("torch").cuda.is_available() else "gloo")
        text = _calibrate_rank(dist.get_rank(), dist.get_world_size(), repeat, seq)
        if dist.get_rank() != 0:
            return
    else:
        text = run_ranks(_calibrate_rank, nproc, repeat, seq, timeout=1800)[0]
    profile = Profile.from_dict(__import__("json").loads(text))
    profile.save(out)
    click.echo(f"wrote {out}: " + ", ".join(f"{k} {c.latency * 1e6:.0f} us + {c.bandwidth / 1e9:.2f} GB/s" for k, c in profile.collectives.items()))
    click.echo("attention fwd/bwd GFLOP/s: " + ", ".join(
        f"{d} {profile.attention_fwd_flops[d] / 1e9:.1f}/{profile.attention_bwd_flops[d] / 1e9:.1f}" for d in profile.attention_fwd_flops
    ) + f"; overlap {profile.overlap}")


@main.command("plan")
@click.option("--model-config", type=click.Path(exists=True, dir_okay=False), help="a Hugging Face config.json")
@click.option("--heads", type=int, help="q heads (without --model-config)")
@click.option("--kv-heads", type=int, help="kv heads (default: --heads)")
@click.option("--head-dim", type=int, default=128, show_default=True)
@click.option("--layers", type=int, default=1, show_default=True)
@click.option("--seq", "seq", default="128k", show_default=True, help="global tokens per sequence: 4096, 8k, 1m")
@click.option("--sp-size", type=int, required=True, help="ranks sharing one sequence")
@click.option("--ulysses-degree", type=int, default=None, help="Ulysses part of the hybrid (default: sp size)")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="groups wider than this cross nodes")
@click.option("--batch", type=int, default=1, show_default=True)
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True)
@click.option("--causal/--no-causal", default=True, show_default=True)
@click.option("--layout", type=click.Choice(["zigzag", "contiguous"]), default="zigzag", show_default=True)
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False), help="from sp-bench calibrate (default: built-in NVLink GPU figures)")
def plan(model_config, heads, kv_heads, head_dim, layers, seq, sp_size, ulysses_degree, gpus_per_node, batch, dtype, causal, layout, profile_path):
    """Show, per layer, the backend auto would choose and every alternative's estimate or reason."""
    import torch

    from ulysses_sp.profile import NVLINK_PROFILE, load_profile

    from .plan import LayerShape, layers_from_config, parse_tokens, plan_rows, render

    if model_config:
        shapes = layers_from_config(model_config)
    elif heads:
        shapes = [LayerShape(heads, kv_heads or heads, head_dim)] * layers
    else:
        raise click.UsageError("give --model-config or --heads")
    profile = load_profile(profile_path) if profile_path else NVLINK_PROFILE
    try:
        rows = plan_rows(shapes, seq_len=parse_tokens(seq), sp_size=sp_size, ulysses_degree=ulysses_degree, ranks_per_node=gpus_per_node,
                         batch=batch, dtype=getattr(torch, dtype), causal=causal, layout=layout, profile=profile)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    render(rows, title=f"{parse_tokens(seq)} tokens on {sp_size} ranks ({gpus_per_node} per node), {dtype}, profile {profile.name}")


if __name__ == "__main__":
    main()
