"""``sp-bench``: inspect and measure sequence-parallel attention backends."""

from __future__ import annotations

import sys

import click

from ulysses_sp import registry
from ulysses_sp.kernels import KERNEL_NAMES
from ulysses_sp.mixers import MIXER_CHOICES


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
    click.echo(f"{'hybrid-u{U}':10s} the hybrid at Ulysses degree U (hybrid: the topology's degree; auto weighs every U)")


def _join_launch():
    """Under torchrun / deepspeed (RANK set): bind this rank's GPU (cuda:LOCAL_RANK) before the
    process group starts, join it, refuse two ranks on one GPU; returns the rank's device."""
    import torch.distributed as dist

    from ulysses_sp.devices import bind_device, check_one_rank_per_device

    device = bind_device()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    check_one_rank_per_device(dist.group.WORLD, device)
    return device


def _leave_launch() -> None:
    """Every rank of a launch leaves together, the group destroyed: a rank that returned right
    after a gather left gloo's threads alive at interpreter exit, which aborted it ("terminate
    called without an active exception")."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _calibrate_rank(rank, world, repeat, seq, backend_seq, device=None):
    from .calibrate import measure

    progress = None
    if rank == 0:
        from tqdm import tqdm

        progress = tqdm(total=10, desc="calibrate", unit="measure")
    profile = measure(repeat=repeat, seq=seq, progress=progress, backend_seq=backend_seq, device=device)
    if progress is not None:
        progress.close()
    return profile.to_json()


@main.command("calibrate")
@click.option("--nproc", type=int, default=2, show_default=True, help="gloo ranks to spawn (ignored under torchrun/deepspeed)")
@click.option("--out", type=click.Path(dir_okay=False), default="profile.json", show_default=True, help="the profile file to write")
@click.option("--repeat", type=int, default=5, show_default=True, help="timed rounds per measurement (the median is kept)")
@click.option("--seq", type=int, default=2048, show_default=True, help="tokens of the attention kernel measurement")
@click.option("--backend-seq", type=int, default=4096, show_default=True, help="tokens of the per-backend reference attention")
def calibrate(nproc, out, repeat, seq, backend_seq):
    """Measure collectives and the attention kernel here; write a profile for auto and plan.
    Run it on as many ranks as training will use: the figures are of that many."""
    import json
    import os

    import torch.distributed as dist

    from ulysses_sp.launch import run_ranks
    from ulysses_sp.profile import Profile

    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    if (int(os.environ["WORLD_SIZE"]) if launched else nproc) < 2:
        raise click.UsageError("calibrate measures collectives between ranks and the backends across them: "
                               + ("launch at least 2 ranks" if launched else "--nproc must be at least 2"))
    if launched:  # inside a launcher: use its ranks, one GPU each
        device = _join_launch()
        text, rank = _calibrate_rank(dist.get_rank(), dist.get_world_size(), repeat, seq, backend_seq, device), dist.get_rank()
        _leave_launch()
        if rank != 0:
            return
    else:
        text = run_ranks(_calibrate_rank, nproc, repeat, seq, backend_seq, timeout=1800)[0]
    profile = Profile.from_dict(json.loads(text))
    profile.save(out)
    click.echo(f"wrote {out}: " + ", ".join(f"{k} {c.latency * 1e6:.0f} us + {c.bandwidth / 1e9:.2f} GB/s" for k, c in profile.collectives.items()))
    click.echo("attention fwd/bwd GFLOP/s: " + ", ".join(
        f"{d} {profile.attention_fwd_flops[d] / 1e9:.1f}/{profile.attention_bwd_flops[d] / 1e9:.1f}" for d in profile.attention_fwd_flops
    ) + f"; overlap {profile.overlap}" + (f" ({profile.comm_exposed.get('p2p', 0.0):.0%} of a transfer stays exposed)" if profile.overlap else "")
      + f"; ulysses head groups {profile.ulysses_head_groups}")
    per_kv = profile.backend_overhead_kv or profile.backend_overhead
    click.echo("backend overhead beyond the model, ns per byte of a rank's q and output / k and v shards: "
               + ", ".join(f"{n} {x * 1e9:.2f} / {per_kv.get(n, 0.0) * 1e9:.2f}" for n, x in profile.backend_overhead.items()))


@main.command("plan")
@click.option("--model-config", type=click.Path(exists=True, dir_okay=False), help="a Hugging Face config.json")
@click.option("--heads", type=int, help="q heads (without --model-config)")
@click.option("--kv-heads", type=int, help="kv heads (default: --heads)")
@click.option("--head-dim", type=int, default=128, show_default=True, help="head dim (without --model-config)")
@click.option("--layers", type=int, default=1, show_default=True, help="attention layers (without --model-config)")
@click.option("--window", type=int, default=None, help="sliding window of every layer (without --model-config)")
@click.option("--seq", "seq", default="128k", show_default=True, help="global tokens per sequence: 4096, 8k, 1m")
@click.option("--sp-size", type=int, default=None, help="ranks sharing one sequence (with --max-seq-len, default: every GPU)")
@click.option("--ulysses-degree", type=int, default=None, help="the topology's Ulysses degree (default: sp size); auto weighs every degree")
@click.option("--gpus-per-node", type=int, default=8, show_default=True, help="groups wider than this cross nodes")
@click.option("--batch", type=int, default=1, show_default=True, help="sequences per step")
@click.option("--dtype", type=click.Choice(["bfloat16", "float16", "float32"]), default="bfloat16", show_default=True, help="training dtype")
@click.option("--causal/--no-causal", default=True, show_default=True, help="causal attention (or full)")
@click.option("--layout", type=click.Choice(["zigzag", "contiguous", "balanced"]), default="zigzag", show_default=True, help="token layout of the shards")
@click.option("--docs", "docs", default=None, metavar="SPEC",
              help="a packed row's document lengths: a repeated pattern (12k,512x8) or lognormal:MEDIAN:SIGMA (lognormal:2k:1.5)")
@click.option("--docs-seed", type=int, default=0, show_default=True, help="the seed of a lognormal row")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False), help="from sp-bench calibrate (default: built-in NVLink GPU figures)")
@click.option("--images", type=click.IntRange(min=1), default=None, help="images per sequence: plan an image-text model's vision tower too")
@click.option("--image-size", default=None, metavar="HxW", help="pixels per image (default: 448x448 for Qwen's families, else the model's own)")
@click.option("--max-seq-len", "max_seq", is_flag=True,
              help="instead: the longest sequence one training step fits in (needs --model-config; ulysses_sp.step_memory)")
@click.option("--nodes", type=click.IntRange(min=1), default=1, show_default=True, help="with --max-seq-len")
@click.option("--gpu-memory", default="80GB", show_default=True, help="with --max-seq-len: device memory per GPU (GB = 1e9 bytes, GiB = 2^30)")
@click.option("--host-memory", default="1.5TB", show_default=True, help="with --max-seq-len: host memory per node ('none': no limit)")
@click.option("--engine", type=click.Choice(["none", "zero0", "zero1", "zero2", "zero3", "fsdp2"]), default="zero3", show_default=True,
              help="with --max-seq-len: what holds parameters, gradients and optimizer states")
@click.option("--offload-optimizer/--no-offload-optimizer", default=True, show_default=True, help="with --max-seq-len (ZeRO-1/2/3)")
@click.option("--checkpoint", type=click.Choice(["none", "layers", "offload"]), default="offload", show_default=True, help="with --max-seq-len")
@click.option("--tiled-loss/--no-tiled-loss", default=True, show_default=True, help="with --max-seq-len")
@click.option("--tiled-mlp/--no-tiled-mlp", default=True, show_default=True, help="with --max-seq-len")
@click.option("--tiled-norms/--no-tiled-norms", default=True, show_default=True, help="with --max-seq-len")
@click.option("--head-groups", type=click.IntRange(min=1), default=1, show_default=True, help="with --max-seq-len: Ulysses over this many head groups")
@click.option("--sp-mixer", type=click.Choice(MIXER_CHOICES[:-1]), default="auto", show_default=True,
              help="with --max-seq-len: the strategy of a hybrid's linear-attention and state-space layers")
@click.option("--gains", is_flag=True, help="with --max-seq-len: also the longest sequence with each switch off in turn (one search each)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="with --max-seq-len: write the answer and its breakdown")
def plan(model_config, heads, kv_heads, head_dim, layers, window, seq, sp_size, ulysses_degree, gpus_per_node, batch, dtype, causal, layout, docs,
         docs_seed, profile_path, images, image_size, max_seq, nodes, gpu_memory, host_memory, engine, offload_optimizer, checkpoint, tiled_loss,
         tiled_mlp, tiled_norms, head_groups, sp_mixer, gains, json_path):
    """Show, per layer, the backend auto would choose and every alternative's estimate or reason;
    with --max-seq-len, the longest sequence a training step fits in, and what holds the memory."""
    import torch

    if max_seq:
        from .memory import plan_max_seq_len

        if not model_config:
            raise click.UsageError("--max-seq-len needs --model-config (a config.json)")
        plan_max_seq_len(model_config, gpus_per_node=gpus_per_node, nodes=nodes, sp_size=sp_size, gpu_memory=gpu_memory, host_memory=host_memory,
                         engine=engine, offload_optimizer=offload_optimizer, checkpoint=checkpoint, tiled_loss=tiled_loss, tiled_mlp=tiled_mlp,
                         tiled_norms=tiled_norms, head_groups=head_groups, mixer=sp_mixer, dtype=dtype, profile_path=profile_path, gains=gains, json_path=json_path)
        return
    if sp_size is None:
        raise click.UsageError("give --sp-size")

    from ulysses_sp.profile import NVLINK_PROFILE, load_profile

    from ulysses_sp.layout import LAYOUTS, work_imbalance

    from .docs import describe_docs, parse_docs
    from .plan import LayerShape, layers_from_config, parse_tokens, plan_rows, render

    if model_config:
        shapes = layers_from_config(model_config)
    elif heads:
        shapes = [LayerShape(heads, kv_heads or heads, head_dim, window)] * layers
    else:
        raise click.UsageError("give --model-config or --heads")
    profile = load_profile(profile_path) if profile_path else NVLINK_PROFILE
    try:
        seq_len = parse_tokens(seq)
        cu = parse_docs(docs, seq_len, docs_seed) if docs else None
        rows = plan_rows(shapes, seq_len=seq_len, sp_size=sp_size, ulysses_degree=ulysses_degree, ranks_per_node=gpus_per_node,
                         batch=batch, dtype=getattr(torch, dtype), causal=causal, layout=layout, profile=profile, cu_seqlens=cu)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    if cu:
        click.echo(f"packed row: {describe_docs(cu)}; the slowest rank's causal attention work over the mean: "
                   + ", ".join(f"{name} {work_imbalance(name, seq_len, sp_size, cu):.3f}" for name in LAYOUTS))
    render(rows, title=f"{parse_tokens(seq)} tokens on {sp_size} ranks ({gpus_per_node} per node), {dtype}, profile {profile.name}", sp_size=sp_size)
    if images:
        import json

        from .vision import describe, vision_share

        if not model_config:
            raise click.UsageError("--images needs --model-config (an image-text model's config.json)")
        with open(model_config) as f:
            config = json.load(f)
        try:
            share = vision_share(config, images=images, image_size=image_size, sp_size=sp_size, dtype_bytes=getattr(torch, dtype).itemsize)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        for line in describe(share, seq_len):
            click.echo(line)


def _csv(text: str, convert=str) -> list:
    try:
        return [convert(x.strip()) for x in str(text).split(",") if x.strip()]
    except ValueError as e:
        raise click.BadParameter(f"{text!r}: {e}") from None


def _maybe_fake_flash_attn(fake: bool):
    """The CPU fake of flash-attn installed for the block (``--fake-flash-attn``), before any
    peer imports flash-attn's functions; else nothing."""
    import contextlib

    if not fake:
        return contextlib.nullcontext()
    from ulysses_sp.testing.fake_flash_attn import install

    return install()


def _bench_rank(rank, world, cells, entries, options):
    from .bench import measure_rank

    options = dict(options)
    with _maybe_fake_flash_attn(options.pop("fake_flash_attn", False)):
        return measure_rank(cells, entries, **options)


@main.command("mixers")
@click.option("--mixers", "kinds", default="gdn,mamba2,conv,kda", show_default=True, help="comma list of gdn, mamba2, conv, kda")
@click.option("--seq", default="4k,8k,16k", show_default=True, help="global tokens, comma list")
@click.option("--nproc", default="2,4", show_default=True, help="gloo ranks, comma list")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True, help="timed rounds per cell")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="every row as measured")
def mixers(kinds, seq, nproc, repeat, json_path):
    """Time one hybrid-model mixer layer of each kind under every mixer strategy that can run it."""
    import json

    from .mixers import HIDDEN, LAYERS, rows
    from .plan import _size, parse_tokens

    kinds_ = _csv(kinds)
    for kind in kinds_:
        if kind not in LAYERS:
            raise click.BadParameter(f"unknown mixer {kind!r}; known: {', '.join(LAYERS)}", param_hint="--mixers")
    try:
        seqs = [parse_tokens(s) for s in _csv(seq)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--seq") from None
    click.echo(f"hidden {HIDDEN}, fp32, forward + backward, median of {repeat} (slowest rank); a strategy's cell: time (rank 0's bytes sent, forward and backward)\n")
    from ulysses_sp.mixers import BUILT_IN

    click.echo(f"| mixer | tokens | P | one process, whole sequence | {' | '.join(BUILT_IN)} | one rank's shard alone |\n|{'---|' * (len(BUILT_IN) + 5)}")
    measured = []
    for row in rows(kinds_, seqs, _csv(nproc, int), repeat):
        measured.append(row)
        cells = [f"{s['seconds'] * 1e3:.0f} ms ({_size(s['bytes_sent'])})" if (s := row["strategies"].get(n)) else "-"
                 for n in BUILT_IN]
        click.echo(f"| {row['mixer']} | {row['tokens']} | {row['ranks']} | {row['one_process_s'] * 1e3:.0f} ms | {' | '.join(cells)} "
                   f"| {row['shard_s'] * 1e3:.0f} ms |")
    click.echo("\n" + "\n".join(f"- {kind}: {LAYERS[kind]}" for kind in kinds_))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(measured, f, indent=1)


@main.command("run")
@click.option("--backends", default="ulysses,allgather,ring,hybrid,halo,auto", show_default=True, help="comma list of registered backends (and auto); halo runs windowed cells only")
@click.option("--peers", is_flag=False, flag_value="all", default="", metavar="[NAMES]",
              help="also run other libraries: --peers alone for all of deepspeed,torch-ring,ring-flash-attn,yunchang")
@click.option("--seq", default="4k,16k", show_default=True, help="global tokens per sequence, comma list (4096, 8k, 1m)")
@click.option("--heads", default="8", show_default=True, help="q heads, comma list")
@click.option("--kv-heads", default="q", show_default=True, help="kv heads, comma list; q: as many as q heads")
@click.option("--head-dim", default="64", show_default=True, help="comma list")
@click.option("--batch", default="1", show_default=True, help="comma list")
@click.option("--dtype", default="float32", show_default=True, help="comma list of float32, bfloat16, float16")
@click.option("--causal/--no-causal", default=True, show_default=True, help="causal attention (or full)")
@click.option("--window", "windows", default="none", show_default=True, help="sliding windows, comma list (none: full attention; needs --causal)")
@click.option("--sinks", is_flag=True, help="learned attention sinks (GPT-OSS): one logit per head in every row's softmax")
@click.option("--layout", "layouts", default="zigzag", show_default=True, help="comma list of zigzag, contiguous, balanced: each a row of its own")
@click.option("--docs", default=None, metavar="SPEC",
              help="pack every row with documents: a repeated pattern of lengths (12k,512x8) or lognormal:MEDIAN:SIGMA (lognormal:2k:1.5)")
@click.option("--docs-seed", type=int, default=0, show_default=True, help="the seed of lognormal rows")
@click.option("--kernel", type=click.Choice(KERNEL_NAMES), default="auto", show_default=True,
              help="local attention kernel of our backends and of the one-rank baseline")
@click.option("--fake-flash-attn", is_flag=True,
              help="install the CPU fake of flash-attn in every rank (testing): the flash_attn kernel and the "
                   "ring-flash-attn and yunchang peers then run on CPU tensors")
@click.option("--nproc", type=int, default=2, show_default=True, help="gloo ranks to spawn (ignored under torchrun/deepspeed, which set RANK)")
@click.option("--ulysses-degree", type=int, default=None, help="Ulysses part of the hybrid (default: all ranks)")
@click.option("--warmup", type=click.IntRange(min=0), default=1, show_default=True, help="untimed calls of each entry per cell")
@click.option("--repeat", type=click.IntRange(min=1), default=3, show_default=True,
              help="timed rounds per cell; each round runs every entry once, the order rotating")
@click.option("--threads-per-rank", type=int, default=1, show_default=True, help="torch threads per spawned rank")
@click.option("--profile", "profile_path", type=click.Path(exists=True, dir_okay=False), help="for auto (default: built-in for the device)")
@click.option("--check", is_flag=True, help="also the max error of out and grads against fp64 one-process attention")
@click.option("--memory/--no-memory", default=True, show_default=True,
              help="peak memory per rank; on spawned CPU ranks measured in a second group of ranks, one call per entry and cell")
@click.option("--baseline/--no-baseline", default=True, show_default=True, help="time one rank on the whole sequence (T1, on rank 0 in the same rounds) for the scaling efficiency T1 / (P x T)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), help="every field and the environment")
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), help="also write every row as CSV here")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), help="PNG: time and memory against sequence length")
def run(backends, peers, seq, heads, kv_heads, head_dim, batch, dtype, causal, windows, sinks, layouts, docs, docs_seed, kernel, fake_flash_attn, nproc,
        ulysses_degree, warmup, repeat,
        threads_per_rank, profile_path, check, memory, baseline, json_path, csv_path, plot_path):
    """Time every backend (and peers) side by side on a grid of attention shapes."""
    import datetime
    import functools
    import os
    import platform

    import torch
    import torch.distributed as dist

    from ulysses_sp.launch import run_ranks

    from . import report
    from .bench import BACKENDS, MMAP_THRESHOLD, cells as make_cells, memory_method, summarise
    from .peers import PEERS
    from ulysses_sp.layout import LAYOUTS, required_multiple

    from .plan import parse_tokens

    entries = _csv(backends)
    for name in entries:
        if name != "auto":
            try:
                registry.get_backend(name)
            except ValueError:
                raise click.BadParameter(f"unknown backend {name!r}; known: {', '.join(BACKENDS)}, hybrid-u{{U}}", param_hint="--backends") from None
    peer_names = list(PEERS) if peers == "all" else _csv(peers)
    for name in peer_names:
        if name not in PEERS:
            raise click.BadParameter(f"unknown peer {name!r}; known: {', '.join(PEERS)}", param_hint="--peers")
    entries += [f"peer:{p}" for p in peer_names]
    for name in _csv(dtype):
        if name not in ("float32", "bfloat16", "float16"):
            raise click.BadParameter(f"{name!r}: one of float32, bfloat16, float16", param_hint="--dtype")
    heads_ = _csv(heads, int)
    kv_raw = _csv(kv_heads)
    try:
        seqs = [parse_tokens(s) for s in _csv(seq)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--seq") from None
    if any(kv != "q" and not kv.isdigit() for kv in kv_raw):
        raise click.BadParameter(f"{kv_heads!r}: integers or q", param_hint="--kv-heads")
    try:
        windows_ = [None if w == "none" else parse_tokens(w) for w in _csv(windows)]
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--window") from None
    if not causal and any(windows_):
        raise click.BadParameter("a sliding window needs --causal", param_hint="--window")
    layouts_ = _csv(layouts)
    for name in layouts_:
        if name not in LAYOUTS:
            raise click.BadParameter(f"unknown layout {name!r}; known: {', '.join(LAYOUTS)}", param_hint="--layout")
    grid = []
    for h in heads_:
        kvs = [h if kv == "q" else int(kv) for kv in kv_raw]
        try:
            cells, dropped = make_cells(seqs, [h], kvs, _csv(head_dim, int), _csv(batch, int), _csv(dtype), causal, layouts_, windows_, docs, docs_seed,
                                       sinks)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--docs") from None
        grid += [c for c in cells if c not in grid]
        for note in dropped:
            click.echo(f"left out: {note}", err=True)
    if not grid:
        raise click.UsageError("the grid is empty")

    options = dict(warmup=warmup, repeat=repeat, check=check, progress=True, kernel=kernel, fake_flash_attn=fake_flash_attn, baseline=baseline, memory=memory,
                   topo_args={"ulysses_degree": ulysses_degree, "profile": profile_path, "timeout": 3600})
    launched = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if launched else nproc
    multiple = max(required_multiple(name, max(world, 1)) for name in layouts_)
    if world < 1 or any(c.seq % multiple for c in grid):
        raise click.BadParameter(f"every length must divide by {multiple} ({world} ranks, {', '.join(layouts_)} layout)", param_hint="--seq")
    device, threshold = torch.device("cpu"), None
    if launched:  # under torchrun / deepspeed: use its ranks (one GPU each), rank 0 reports
        device = _join_launch()
        per_rank = [None] * world
        dist.all_gather_object(per_rank, _bench_rank(dist.get_rank(), world, grid, entries, options))
        rank = dist.get_rank()
        _leave_launch()
        if rank != 0:
            return
    else:
        spawn = functools.partial(run_ranks, _bench_rank, nproc, grid, entries, timeout=24 * 3600, collective_timeout=3600,
                                  threads_per_rank=threads_per_rank)
        per_rank = spawn({**options, "memory": False})  # timed under the allocator's defaults
        if memory:  # peak resident set in a group of its own, whose allocator setting would slow the timed calls
            unset = "MALLOC_MMAP_THRESHOLD_" not in os.environ
            threshold = os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD))  # read by the spawned ranks' libc
            try:
                peaks = spawn({**options, "warmup": min(warmup, 1), "repeat": 1, "check": False, "baseline": False, "desc": "memory"})
            finally:
                if unset:
                    del os.environ["MALLOC_MMAP_THRESHOLD_"]
            for mine, measured in zip(per_rank, peaks):
                for key, result in measured.items():
                    if "runs" in result:
                        mine[key]["peak"] = result["runs"][0][2]
    rows = summarise(grid, entries, per_rank, world)

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "sp-bench " + " ".join(sys.argv[1:]),
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "cpus": os.cpu_count(), "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "process_group": "nccl" if device.type == "cuda" else "gloo", "world_size": world, "threads_per_rank": threads_per_rank,
        "warmup": warmup, "repeat": repeat, "memory": memory_method(device, memory, threshold),
        "timing": "per repeat the slowest rank; median and min-max over repeats; each repeat starts at a barrier; "
                  "repeat i of every entry of a cell ran in round i, the entries' order rotating between rounds"
                  + ("; T1 ran on rank 0 in the same rounds, efficiency is the median of T1 / (P x T) by round" if baseline else ""),
    }
    packing = f", packed {docs} (seed {docs_seed})" if docs else ""
    title = (f"sp-bench: {world} ranks ({env['process_group']}, {threads_per_rank} thread(s) each), {'causal' if causal else 'full'}{packing}"
             + (", learned sinks" if sinks else ""))
    report.render(rows, title)
    if json_path:
        report.write_json(json_path, rows, env)
    if csv_path:
        report.write_csv(csv_path, rows, env)
    if plot_path:
        report.write_plot(plot_path, rows, title)
    for path in (json_path, csv_path, plot_path):
        if path:
            click.echo(f"wrote {path}")


if __name__ == "__main__":
    main()
