"""``sp-bench plan --max-seq-len``: the longest sequence one training step of a model fits in on a
world of GPUs, where the memory goes at that length, and what each switch buys
(`ulysses_sp.step_memory`, which runs the model on the meta device)."""

from __future__ import annotations

import dataclasses
import json
import re
import time

import click
import torch

from ulysses_sp.step_memory import Breakdown, Engine, Switches, World, max_seq_len, model_states

__all__ = ["parse_bytes", "plan_max_seq_len", "SWITCH_OFF"]

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}

SWITCH_OFF = {
    "tiled loss": {"tiled_loss": False},
    "tiled MLP": {"tiled_mlp": False},
    "tiled norms": {"tiled_norms": False},
    "offloading checkpoints": {"checkpoint": "layers"},
    "checkpointing": {"checkpoint": "none"},
}
"""What ``--gains`` turns off, one at a time, against the switches given."""


def parse_bytes(text: str) -> int | None:
    """``80GB`` (80e9), ``80GiB`` (80 x 2^30), ``1.5TB``; ``none`` -> None (no limit)."""
    text = str(text).strip().lower().replace(" ", "")
    if text == "none":
        return None
    match = re.fullmatch(r"([0-9]*\.?[0-9]+)([kmgt]i?b|b)", text)
    if not match:
        raise click.BadParameter(f"{text!r} is not a size (examples: 80GB, 80GiB, 1.5TB, none)")
    return int(float(match[1]) * _UNITS[match[2]])


def _gib(n: int) -> str:
    """GiB with one decimal; MiB below 1 GiB."""
    return f"{n / 2**30:.1f} GiB" if abs(n) >= 2**30 or n == 0 else f"{n / 2**20:.1f} MiB"


def _tokens(n: int) -> str:
    return f"{n:,} ({n / 1e6:.2f}M)"


def _attention_seconds(model_config: str, seq_len: int, sp: int, gpus_per_node: int, backend: str, dtype, profile) -> tuple[float | None, str, float]:
    """Forward plus backward of every attention layer at ``seq_len``: as ``backend`` runs it (None
    where auto does not weigh it) and as auto's choice, by the profile's estimates (``sp-bench plan``)."""
    from .plan import layers_from_config, plan_rows

    from ulysses_sp.spec import Estimate

    rows = plan_rows(layers_from_config(model_config), seq_len=seq_len, sp_size=sp, ranks_per_node=gpus_per_node, dtype=dtype, profile=profile)
    ran = auto = 0.0
    chosen = set()
    for first, last, _shape, name, considered in rows:
        count = last - first + 1
        mine = considered.get(backend)
        ran = ran + count * mine.seconds if isinstance(mine, Estimate) and ran is not None else None
        auto += count * considered[name].seconds if isinstance(considered[name], Estimate) else 0.0
        chosen.add(name)
    return ran, "/".join(sorted(chosen)), auto


def _breakdown_lines(b: Breakdown, device: int, host: int | None) -> list[str]:
    host_cap = "no limit" if host is None else _gib(host)
    return [
        f"  per GPU: parameters {_gib(b.params)} + gradients {_gib(b.grads)} + optimizer {_gib(b.optimizer)} + engine buffers {_gib(b.buffers)}"
        f" + activations kept {_gib(b.activations)} + largest transient {_gib(b.transient)} = {_gib(b.peak)} of {_gib(device)} (peak in the {b.peak_at})",
        f"  per node (host): offloaded checkpoints {_gib(b.host_checkpoints)} + optimizer states {_gib(b.host_optimizer)} = {_gib(b.host)} of {host_cap}",
    ]


def plan_max_seq_len(model_config: str, *, gpus_per_node: int, nodes: int, sp_size: int | None, gpu_memory: str, host_memory: str, engine: str,
                     offload_optimizer: bool, checkpoint: str, tiled_loss: bool, tiled_mlp: bool, tiled_norms: bool, head_groups: int, dtype: str, mixer: str = "auto",
                     profile_path: str | None, gains: bool, json_path: str | None) -> dict:
    from ulysses_sp.profile import NVLINK_PROFILE, load_profile

    device, host = parse_bytes(gpu_memory), parse_bytes(host_memory)
    if device is None:
        raise click.UsageError("--gpu-memory needs a size (80GB, 80GiB)")
    try:
        world = World(gpus_per_node, nodes, sp_size)
        eng = Engine(engine, offload_optimizer and engine not in ("none", "zero0", "fsdp2"))
        switches = Switches(tiled_loss=tiled_loss, tiled_mlp=tiled_mlp, checkpoint=checkpoint, tiled_norms=tiled_norms, head_groups=head_groups,
                            mixer=mixer)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    torch_dtype = getattr(torch, dtype)
    states = model_states(model_config, world, eng, torch_dtype)
    on = [name for name, off in SWITCH_OFF.items() if all(getattr(switches, k) != v for k, v in off.items())]
    click.echo(f"{model_config}: {states['n_params'] / 1e9:.3g}B parameters, {dtype}; {world.ranks} GPUs ({gpus_per_node} x {nodes} nodes), SP {world.sp}; "
               f"engine {eng.name}{' + optimizer offload' if eng.offload_optimizer else ''}; attention {switches.backend_name}; mixers {switches.mixer}; "
               f"on: {', '.join(on) or 'nothing'}")
    started = time.perf_counter()

    def progress(seq, b):
        click.echo(f"  tried {_tokens(seq)}: {_gib(b.peak)} per GPU, {_gib(b.host)} host per node  [{time.perf_counter() - started:.0f} s]", err=True)

    def search(sw):
        try:
            return max_seq_len(model_config, device, host, world, eng, sw, torch_dtype, progress=progress, states=states)
        except ValueError as e:
            raise click.UsageError(str(e)) from None

    longest, b = search(switches)
    out = {"model_config": model_config, "n_params": states["n_params"], "world": dataclasses.asdict(world), "engine": dataclasses.asdict(eng),
           "switches": dataclasses.asdict(switches), "dtype": dtype, "gpu_memory_bytes": device, "host_memory_bytes": host, "max_seq_len": longest,
           "breakdown": b.as_dict() if b else None, "projection": "ulysses_sp.step_memory: the model's step on the meta device, engine states by formula"}
    if b is None:
        click.echo(f"not even {2 * world.sp} tokens fit: {_gib(states['params'])} of parameters per GPU")
    else:
        device_use, host_use = b.peak / device, (b.host / host if host else 0.0)
        limit = "GPU memory" if device_use >= host_use else "host memory"
        click.echo(f"longest sequence: {_tokens(longest)} tokens, limited by {limit} (a projection)")
        for line in _breakdown_lines(b, device, host):
            click.echo(line)
        profile = load_profile(profile_path) if profile_path else NVLINK_PROFILE
        ran, chosen, auto = _attention_seconds(model_config, longest, world.sp, gpus_per_node, switches.backend_name, torch_dtype, profile)
        out["attention_seconds"] = {"backend": switches.backend_name, "seconds": ran, "auto_choice": chosen, "auto_seconds": auto, "profile": profile.name}
        as_run = f"{ran:.0f} s" if ran is not None else "not estimated (auto does not weigh it)"
        click.echo(f"  step time: attention forward + backward over all layers {as_run} as {switches.backend_name} (auto would pick {chosen}: "
                   f"{auto:.0f} s), profile {profile.name}; the dense layers add {_dense_share(states['n_params'], longest, model_config):.1%} of attention's FLOPs")
    if gains:
        out["without"] = {}
        for name, off in SWITCH_OFF.items():
            if name not in on:
                continue
            n, _ = search(dataclasses.replace(switches, **off))
            out["without"][name] = n
            click.echo(f"  without {name}: {_tokens(n)}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump(out, f, indent=2)
    return out


def _dense_share(n_params: int, seq_len: int, model_config: str) -> float:
    """6 N S (the dense layers' forward and backward) over causal attention's 3.5 x 2 S^2 h d per layer."""
    from .plan import layers_from_config

    attention = sum(3.5 * 2 * seq_len * seq_len * shape.q_heads * shape.head_dim for shape in layers_from_config(model_config) if not shape.mixer)
    return 6 * n_params * seq_len / attention if attention else float("inf")
