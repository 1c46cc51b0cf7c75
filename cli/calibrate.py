"""``sp-bench calibrate``: measure a `Profile` on this machine.

On N spawned gloo ranks (CPU, one thread each), or inside an existing
torchrun/deepspeed launch (NCCL on GPUs): latency (small messages) and
bandwidth (large ones) of all-to-all, all-gather, reduce-scatter and p2p, the
local attention kernel's forward and backward rate per dtype, and whether a
p2p exchange overlaps computation (and, where it does, the share of the exchange that stays
exposed: ``comm_exposed``, taken for every collective). Every rank measures at once, as in
training. The built-in GPU profile's ``kernel_efficiency`` and ``kernel_half_rate_tokens``
(published figures) are not measured: a calibrated profile has none, and the backends'
measured overheads (below) stand in for them on the machine measured.

Last, every backend ``auto`` weighs runs two reference attentions (8 q and 8 kv heads,
then 16 and 1; dim 64, fp32, causal, ``backend_seq`` tokens); what it takes beyond the
time the profile so far predicts, less the leanest backend's figure at that shape (the
median of differences within a round, so that drift between rounds cancels), is
solved for seconds per byte of the rank's q and output shards (``backend_overhead``) and
of its k and v shards (``backend_overhead_kv``); a backend that runs only sliding-window
layers (halo) is measured against the leanest one on the MHA attention with a window. The hybrid
runs at every Ulysses degree 1 < U < N, each under auto's name ``hybrid-u{U}`` (none on 2 ranks,
where U = 1 and U = 2 are the ring and Ulysses). The figures are of N ranks on this machine: a
profile serves best at the rank count it was measured at. The backends take turns (one run
each, ``repeat`` rounds) so that a drift of the machine's speed during
calibration does not favour one of them. The same way, Ulysses runs over 1, 2 and
4 head groups (4 q heads per rank) and the fastest count becomes the profile's
``ulysses_head_groups``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

import torch
import torch.distributed as dist

from ulysses_sp import comm, kernels
from ulysses_sp.profile import COLLECTIVES, LinkCost, Profile
from ulysses_sp.registry import candidates

__all__ = ["measure", "rotated", "slowest_seconds", "exposed_share"]

SMALL, LARGE = 1 << 6, 1 << 22  # elements of float32: 256 B and 16 MiB


def slowest_seconds(fn, repeat: int, device) -> float:
    """Median seconds of ``fn`` over ``repeat`` runs, the slowest rank's, ranks in step."""
    times = []
    for _ in range(repeat):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.item()


def _collective(kind: str, n: int, group, device):
    """(callable running one collective of ``n`` float32 elements per rank, bytes this rank sends)."""
    p = dist.get_world_size(group)
    x = torch.randn(n * p if kind in ("all_to_all", "reduce_scatter") else n, device=device)
    if kind == "all_to_all":
        rows = x.view(p, -1)
        return (lambda: comm.all_to_all(rows, group, scatter_dim=0, gather_dim=0)), rows[0].numel() * 4 * (p - 1)
    if kind == "all_gather":
        return (lambda: comm.all_gather_start(x, group, 0)()), n * 4 * (p - 1)
    if kind == "reduce_scatter":
        return (lambda: comm.reduce_scatter_sum(x, group, 0)), n * 4 * (p - 1)
    rank = dist.get_rank(group)

    def exchange():
        _, wait = comm.ring_send_recv([x], group, send_to=(rank + 1) % p, recv_from=(rank - 1) % p)
        wait()

    return exchange, n * 4


def exposed_share(comm_s: float, compute_s: float, both_s: float) -> float:
    """The share of a transfer run alongside a computation that it still adds: 0 when both
    together take the longer one's time, 1 when they take the sum."""
    return min(1.0, max(0.0, (both_s - max(comm_s, compute_s)) / max(min(comm_s, compute_s), 1e-12)))


def _kernel_rates(dtype, seq: int, repeat: int, device) -> tuple[float, float]:
    """Forward and backward FLOP/s of causal local attention (8 q heads, 2 kv heads, dim 64)."""
    q = torch.randn(1, seq, 8, 64, device=device, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, seq, 2, 64, device=device, dtype=dtype, requires_grad=True) for _ in range(2))
    flops = 4 * seq * seq * 8 * 64 / 2  # causal
    dout = kernels.local_attention(q, k, v, causal=True).detach()
    t_fwd = slowest_seconds(lambda: kernels.local_attention(q, k, v, causal=True), repeat, device)
    t_both = slowest_seconds(lambda: torch.autograd.grad(kernels.local_attention(q, k, v, causal=True), (q, k, v), dout), repeat, device)
    return flops / t_fwd, flops / max(t_both - t_fwd, 1e-9)


def rotated(items: list, shift: int) -> list:
    """``items`` started at index ``shift`` (mod its length): round r of a paired measurement runs
    ``rotated(names, r)``, so that no one always runs first."""
    k = shift % len(items) if items else 0
    return items[k:] + items[:k]


def _backend_times(backends: dict, spec, topo, q, k, v, dout, profile: Profile, repeat: int, device) -> dict:
    """Per backend, the median measured seconds of forward+backward of ``spec``, its estimate,
    and every round's seconds (``runs_s``; round i of every backend ran in the same turn)."""

    def step(backend):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        backend.forward(*leaves, spec, topo).backward(dout)

    names = list(backends)
    times = {name: [] for name in names}
    for round_ in range(repeat + 1):  # the first round warms up; the order rotates
        for name in rotated(names, round_):
            seconds = slowest_seconds(lambda b=backends[name]: step(b), 1, device)
            if round_:
                times[name].append(seconds)
    return {name: {"measured_s": statistics.median(times[name]), "estimated_s": b.estimate(spec, topo, profile).seconds,
                   "runs_s": times[name]} for name, b in backends.items()}


def _excess_over(times: dict, ref: str) -> dict:
    """Per backend of `_backend_times`, seconds beyond its estimate less ``ref``'s: the
    median over rounds of the difference within a round, where the two ran one after the
    other, so that the machine's drift between rounds cancels (a difference of two medians
    keeps it)."""
    ref_runs, ref_est = times[ref]["runs_s"], times[ref]["estimated_s"]
    return {name: statistics.median(t - u for t, u in zip(r["runs_s"], ref_runs)) - (r["estimated_s"] - ref_est)
            for name, r in times.items()}


def _over_leanest(times: dict) -> tuple[str, dict]:
    """(the backend of `_backend_times` with the smallest excess over its estimate, every
    backend's `_excess_over` it, 0 where below 0)."""
    leanest = min(times, key=lambda name: times[name]["measured_s"] - times[name]["estimated_s"])
    return leanest, {name: max(x, 0.0) for name, x in _excess_over(times, leanest).items()}


REFERENCE_HEADS = ((8, 8), (16, 1))
"""q/kv heads of the reference attentions: MHA, where a rank's shards are half q and output,
half k and v, and MQA, where they are nearly all q and output."""


def _fit(rows) -> tuple[float, float]:
    """Non-negative ``(a, c)`` with ``a * q_bytes + c * kv_bytes = x`` for both ``rows``
    ``(q_bytes, kv_bytes, x)``: the exact solution where both are >= 0, else the one-term
    least-squares fit with the smaller residual (every ``x`` is >= 0)."""
    (p1, k1, x1), (p2, k2, x2) = rows
    det = p1 * k2 - k1 * p2
    a, c = (x1 * k2 - k1 * x2) / det, (p1 * x2 - x1 * p2) / det
    if a >= 0 and c >= 0:
        return a, c
    only_a = (sum(p * x for p, _, x in rows) / sum(p * p for p, _, _ in rows), 0.0)
    only_c = (0.0, sum(k * x for _, k, x in rows) / sum(k * k for _, k, _ in rows))
    return min(only_a, only_c, key=lambda ac: sum((ac[0] * p + ac[1] * k - x) ** 2 for p, k, x in rows))


def _windowed_overhead(leanest: str, window: int, q, k, v, dout, topo, profile: Profile, repeat: int, device) -> tuple[dict, dict | None]:
    """Per backend that runs only sliding-window layers (halo): seconds per shard byte beyond
    its estimate, less the ``leanest`` full-attention backend's, on the same attention with a
    ``window``; and the raw seconds (None when there is no such backend)."""
    import ulysses_sp as usp

    full, spec = (usp.attention.make_spec(q, k, v, topo, window=w) for w in (None, window))
    backends = candidates(topo)
    only_windowed = {name: b for name, b in backends.items() if b.check(full, topo) is not None and b.check(spec, topo) is None}
    if not only_windowed:
        return {}, None
    raw = _backend_times({leanest: backends[leanest], **only_windowed}, spec, topo, q, k, v, dout, profile, repeat, device)
    per_byte = {name: x / spec.shard_bytes for name, x in _excess_over(raw, leanest).items() if name != leanest}
    return per_byte, {"window": window, **raw}


def _backend_overhead(profile: Profile, seq: int, repeat: int, device, step=lambda *_: None) -> tuple[dict, dict, dict]:
    """(``backend_overhead``, ``backend_overhead_kv``, the raw measured and estimated seconds).
    Every backend runs at each of `REFERENCE_HEADS`; what it takes beyond its estimate,
    less the leanest backend's at that shape (round by round: `_excess_over`; 0 where
    that is below 0), is fitted per byte of q and output shards
    and per byte of k and v shards (`_fit`). Backends that run only sliding-window
    layers (halo) get one figure per shard byte from the MHA shape (`_windowed_overhead`)."""
    import ulysses_sp as usp

    topo = usp.init_sequence_parallel(dist.get_world_size(), timeout=3600)
    gen = torch.Generator().manual_seed(dist.get_rank())
    rows, raw = {}, {"seq": seq}
    for hq, hkv in REFERENCE_HEADS:
        q, dout, k, v = (torch.randn(1, seq // topo.sp_size, h, 64, generator=gen).to(device) for h in (hq, hq, hkv, hkv))
        spec = usp.attention.make_spec(q, k, v, topo)
        runs = {name: b for name, b in candidates(topo).items() if b.check(spec, topo) is None}
        times = _backend_times(runs, spec, topo, q, k, v, dout, profile, repeat, device)
        leanest, excess = _over_leanest(times)
        for name, x in excess.items():
            rows.setdefault(name, []).append((2 * hq * spec.head_bytes, 2 * hkv * spec.head_bytes, x))
        raw[f"{hq}/{hkv}"] = times
        if (hq, hkv) == REFERENCE_HEADS[0]:
            windowed, raw_w = _windowed_overhead(leanest, seq // 8, q, k, v, dout, topo, profile, repeat, device)
            if raw_w is not None:
                raw["windowed"] = raw_w
        step(1)
    # a backend that could not run at one of the shapes: one figure per shard byte
    fits = {name: _fit(r) if len(r) == 2 else (r[0][2] / (r[0][0] + r[0][1]),) * 2 for name, r in rows.items()}
    fits.update((name, (x, x)) for name, x in windowed.items())
    return {name: a for name, (a, _) in fits.items()}, {name: c for name, (_, c) in fits.items()}, raw


PIPELINE_GROUPS = (1, 2, 4)


def _head_groups(seq: int, repeat: int, device, profile: Profile) -> tuple[int, dict]:
    """(the fastest Ulysses head-group count of ``PIPELINE_GROUPS``, the measured seconds) on a
    causal attention of ``seq`` tokens with 4 q heads per rank (so that 4 groups fit), D64."""
    import ulysses_sp as usp

    topo = usp.init_sequence_parallel(dist.get_world_size(), timeout=3600)
    gen = torch.Generator().manual_seed(dist.get_rank())
    heads = 4 * topo.sp_size
    q, k, v, dout = (torch.randn(1, seq // topo.sp_size, heads, 64, generator=gen).to(device) for _ in range(4))
    spec = usp.attention.make_spec(q, k, v, topo)
    raw = _backend_times({g: usp.get_backend(f"ulysses-g{g}") for g in PIPELINE_GROUPS}, spec, topo, q, k, v, dout, profile, repeat, device)
    return min(raw, key=lambda g: raw[g]["measured_s"]), {"seq": seq, "heads": heads, **{f"ulysses-g{g}": r for g, r in raw.items()}}


def measure(repeat: int = 5, seq: int = 2048, dtypes=("float32", "bfloat16"), progress=None, backend_seq: int = 4096,
            device: torch.device | None = None) -> Profile:
    """Run on every rank of the default group; every rank returns the same profile. ``device``:
    this rank's (``ulysses_sp.devices.bind_device()``); default: the current CUDA device under
    NCCL, else the CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    group = dist.group.WORLD
    step = progress.update if progress is not None else (lambda *_: None)
    collectives, measured = {}, {"world_size": dist.get_world_size(), "device": str(device), "repeat": repeat}
    for kind in COLLECTIVES:
        small, _ = _collective(kind, SMALL, group, device)
        large, sent = _collective(kind, LARGE, group, device)
        latency = slowest_seconds(small, repeat, device)
        seconds = slowest_seconds(large, repeat, device)
        bandwidth = sent / max(seconds - latency, 1e-9)
        collectives[kind] = LinkCost(latency=latency, bandwidth=bandwidth)
        measured[kind] = {"small_s": latency, "large_s": seconds, "large_bytes_sent": sent}
        step(1)

    fwd, bwd = {}, {}
    for name in dtypes:
        fwd[name], bwd[name] = _kernel_rates(getattr(torch, name), seq, repeat, device)
        step(1)

    # overlap: does a p2p exchange proceed while the rank computes?
    exchange, _ = _collective("p2p", LARGE, group, device)
    q = torch.randn(1, seq, 8, 64, device=device)
    compute = lambda: kernels.local_attention(q, q[:, :, :2], q[:, :, :2], causal=True)  # noqa: E731
    t_comm, t_compute = slowest_seconds(exchange, repeat, device), slowest_seconds(compute, repeat, device)
    rank, p = dist.get_rank(), dist.get_world_size()

    def both():
        _, wait = comm.ring_send_recv([torch.randn(LARGE, device=device)], group, send_to=(rank + 1) % p, recv_from=(rank - 1) % p)
        compute()
        wait()

    t_both = slowest_seconds(both, repeat, device)
    overlap = t_both < 0.8 * (t_comm + t_compute)
    measured["overlap"] = {"comm_s": t_comm, "compute_s": t_compute, "both_s": t_both}
    exposed = exposed_share(t_comm, t_compute, t_both) if overlap else 0.0
    step(1)
    profile = Profile(
        name=f"calibrated: {p} x {device.type}, {dist.get_backend()}",
        collectives=collectives,
        inter_node=min(collectives.values(), key=lambda c: c.bandwidth),  # one machine measured: no slower link seen
        attention_fwd_flops=fwd,
        attention_bwd_flops=bwd,
        overlap=overlap,
        comm_exposed={kind: exposed for kind in COLLECTIVES} if exposed else {},  # measured on p2p
        measured=measured,
    )
    overhead, overhead_kv, measured["backends"] = _backend_overhead(profile, backend_seq, repeat, device, step)
    groups, measured["ulysses_head_groups"] = _head_groups(backend_seq, repeat, device, profile) if p > 1 else (1, {})
    step(1)
    return dataclasses.replace(profile, backend_overhead=overhead, backend_overhead_kv=overhead_kv, ulysses_head_groups=groups)
