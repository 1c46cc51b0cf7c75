"""``sp-bench run``'s measurements: every backend (and peer) on every cell of a grid.

One rank function runs the whole grid inside one group of ranks. Per cell:
``warmup`` untimed calls of each entry, then ``repeat`` rounds in which every
entry runs once, the order rotating between rounds, so that a drift of the
machine's speed during a cell falls on every entry alike (run i of two entries
ran in the same round: their ratio is paired). Each call starts at a barrier;
forward and forward+backward seconds per rank (CUDA synchronised);
peak memory of the call; bytes sent, counted by ``CommCounter``; with
``check``, the max error of out, dq, dk, dv against fp64 attention of the
whole sequence. The report takes, per repeat, the slowest rank.

Peak memory: on CUDA the allocator's peak above what was allocated before the
call; on CPU the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) above its resident set before the call.
"""

from __future__ import annotations

import functools
import itertools
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp import kernels

from .calibrate import rotated
from .peers import PEERS

__all__ = ["Cell", "PeakMemory", "cells", "measure_rank", "memory_method", "one_process", "summarise"]

BACKENDS = ("ulysses", "allgather", "ring", "hybrid", "halo", "auto")
MMAP_THRESHOLD = 1 << 17
"""glibc otherwise raises its mmap threshold as large blocks are freed and keeps them
resident, hiding the next call's allocations from the resident-set measure."""


@dataclass(frozen=True)
class Cell:
    """One attention shape of the grid."""

    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    batch: int
    dtype: str
    causal: bool
    layout: str
    window: int | None = None


def cells(seqs, heads, kv_heads, head_dims, batches, dtypes, causal: bool, layout: str, windows=(None,)) -> tuple[list[Cell], list[str]]:
    """The grid's cells, and a note for every combination left out (kv heads not dividing q heads)."""
    out, dropped = [], []
    for s, h, kv, d, b, dt, w in itertools.product(seqs, heads, kv_heads, head_dims, batches, dtypes, windows):
        if kv > h or h % kv:
            dropped.append(f"heads {h} / kv heads {kv}: kv heads must divide q heads")
            continue
        out.append(Cell(s, h, kv, d, b, dt, causal, layout, w))
    return out, dropped


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak bytes above the starting point while open (see the module docstring)."""

    def __init__(self, device):
        self.device, self.peak = device, 0

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        elif os.path.exists("/proc/self/clear_refs"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self.start = self._status("VmRSS")
        else:
            self.start = None
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        elif self.start is not None:
            self.peak = self._status("VmHWM") - self.start
        else:
            self.peak = None


def memory_method(device) -> str:
    if device.type == "cuda":
        return "CUDA allocator: max_memory_allocated above the allocation before the call"
    if os.path.exists("/proc/self/clear_refs"):
        threshold = os.environ.get("MALLOC_MMAP_THRESHOLD_")
        return "process peak resident set (VmHWM, reset via /proc/self/clear_refs) above the resident set before the call" + (
            f"; ranks run with MALLOC_MMAP_THRESHOLD_={threshold} so freed tensors leave the resident set" if threshold else "")
    return "not measured on this platform"


def _inputs(cell: Cell, device):
    """The global q, k, v and upstream gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(cell.seq * 1000 + cell.heads * 10 + cell.kv_heads)
    dtype = getattr(torch, cell.dtype)

    def make(h):
        return torch.randn(cell.batch, cell.seq, h, cell.head_dim, generator=gen).to(device=device, dtype=dtype)

    return make(cell.heads), make(cell.kv_heads), make(cell.kv_heads), make(cell.heads)


def _reference(full, cell: Cell):
    """fp64 out and dq, dk, dv of the whole sequence."""
    leaves = [t.double().requires_grad_() for t in full[:3]]
    out = kernels.local_attention(*leaves, causal=cell.causal, window=cell.window)
    out.backward(full[3].double())
    return [out.detach()] + [t.grad for t in leaves]


def _entry(name: str, cell: Cell, topo_for, kernel: str = "auto"):
    """(callable, topology of its shards, None) for a backend or ``peer:NAME``, or (None, None, why it cannot run)."""
    topo = topo_for(cell.layout)
    if name.startswith("peer:"):
        peer = PEERS[name[5:]]
        reason = "peers are run without a sliding window" if cell.window else peer.problem(cell, topo)
        if reason:
            return None, None, reason
        shard_topo = topo_for(peer.shard_layout(cell.layout))
        return peer.make(cell, shard_topo, kernel), shard_topo, None
    probe = torch.empty(cell.batch, cell.seq // topo.sp_size, 1, cell.head_dim, dtype=getattr(torch, cell.dtype), device=topo.device)
    q, kv = probe.expand(-1, -1, cell.heads, -1), probe.expand(-1, -1, cell.kv_heads, -1)
    try:
        spec = usp.attention.make_spec(q, kv, kv, topo, causal=cell.causal, kernel=kernel, window=cell.window)
    except ValueError as e:  # the kernel cannot take this cell
        return None, None, str(e)
    reason = usp.get_backend(name).check(spec, topo) if name != "auto" else None
    if reason:
        return None, None, reason
    attn = usp.SequenceParallelAttention(topo, backend=name, kernel=kernel)
    return functools.partial(attn, window=cell.window), topo, None


def _payload(counter) -> int:
    """Bytes sent by the attention itself: the one-off shape handshake of a first call is left out."""
    handshake = counter.by_op.get("handshake")
    return counter.bytes_sent - (handshake.sent if handshake else 0)


def _run_once(fn, shards, dout, device, group):
    """One forward+backward from a barrier: ((fwd s, fwd+bwd s, peak bytes, fwd bytes, bwd bytes), out, grads)."""
    leaves = [t.detach().clone().requires_grad_() for t in shards]
    dist.barrier(group)
    with PeakMemory(device) as mem:
        t0 = time.perf_counter()
        with usp.CommCounter() as fwd_bytes:
            out = fn(*leaves)
        _sync(device)
        t1 = time.perf_counter()
        with usp.CommCounter() as bwd_bytes:
            out.backward(dout)
        _sync(device)
        t2 = time.perf_counter()
    return (t1 - t0, t2 - t0, mem.peak, _payload(fwd_bytes), _payload(bwd_bytes)), out.detach(), [t.grad for t in leaves]


def _advance(bar, calls: int, name: str, cell: Cell) -> None:
    if bar is not None:
        bar.set_postfix_str(f"{name} S={cell.seq} H={cell.heads}/{cell.kv_heads}")
        bar.update(calls)


def measure_rank(cells_: list[Cell], entries: list[str], *, warmup: int, repeat: int, check: bool, topo_args: dict, progress: bool,
                 kernel: str = "auto") -> dict:
    """Run on every rank of the SP group (the world): ``{(cell index, entry): this rank's figures}``."""
    topos = {}

    def topo_for(layout):
        if layout not in topos:
            topos[layout] = usp.init_sequence_parallel(dist.get_world_size(), layout=layout, **topo_args)
        return topos[layout]

    bar = None
    if progress and dist.get_rank() == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(cells_) * len(entries) * (warmup + repeat), desc="sp-bench", unit="call")
    results = {}
    for index, cell in enumerate(cells_):
        topo = topo_for(cell.layout)
        full = _inputs(cell, topo.device)
        ready = {}  # entry -> (callable, its shards, their topology)
        for name in entries:
            fn, shard_topo, reason = _entry(name, cell, topo_for, kernel)
            if reason:
                results[(index, name)] = {"skipped": reason}
                _advance(bar, warmup + repeat, name, cell)
                continue
            shards = [usp.shard_sequence(t, shard_topo) for t in full]
            ready[name] = fn, shards, shard_topo
            results[(index, name)] = {"runs": []}
            for _ in range(warmup):
                _run_once(fn, shards[:3], shards[3], topo.device, topo.sp_group)
                _advance(bar, 1, name, cell)
        last = {}
        names = list(ready)  # empty where every entry was skipped
        for round_ in range(repeat):
            for name in rotated(names, round_):
                fn, shards, _ = ready[name]
                run, out, grads = _run_once(fn, shards[:3], shards[3], topo.device, topo.sp_group)
                results[(index, name)]["runs"].append(run)
                last[name] = out, grads
                _advance(bar, 1, name, cell)
        reference = _reference(full, cell) if check and ready else None
        for name, (fn, shards, shard_topo) in ready.items():
            result = results[(index, name)]
            if name == "auto":
                result["resolved"] = [b.name for b in fn.func._chosen.values()]
            if not name.startswith("peer:"):
                spec = usp.attention.make_spec(*shards[:3], shard_topo, causal=cell.causal, window=cell.window)
                backend = usp.get_backend(result.get("resolved", [name])[0])
                estimate = backend.estimate(spec, shard_topo, shard_topo.profile or usp.CPU_GLOO_PROFILE)
                result["analytic_bytes"] = (estimate.comm_bytes, estimate.bwd_comm_bytes)
            if check:
                out, grads = last[name]
                mine = [usp.shard_sequence(t, shard_topo) for t in reference]
                result["max_error"] = max((a.double() - b).abs().max().item() for a, b in zip([out, *grads], mine))
    if bar is not None:
        bar.close()
    return results


def one_process(cells_: list[Cell], *, warmup: int, repeat: int, progress: bool = False, device: torch.device | None = None,
                kernel: str = "auto") -> dict:
    """Forward+backward seconds of the same attention on one rank, whole sequence: T1 per cell.
    ``device``: the rank's bound device; default: the current CUDA device, else the CPU."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    out = {}
    if progress:
        from tqdm import tqdm

        cells_ = tqdm(cells_, desc="one rank (T1)", unit="cell")
    for index, cell in enumerate(cells_):
        q, k, v, dout = _inputs(cell, device)
        times = []
        for i in range(warmup + repeat):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            t0 = time.perf_counter()
            kernels.local_attention(*leaves, causal=cell.causal, kernel=kernel, window=cell.window).backward(dout)
            _sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out[index] = times
    return out


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(cells_: list[Cell], entries: list[str], per_rank: list[dict], t1: dict | None, world: int) -> list[dict]:
    """One row per (cell, entry): the slowest rank per repeat, medians and spreads, bytes and efficiency."""
    rows = []
    for index, cell in enumerate(cells_):
        for name in entries:
            row = {**asdict(cell), "entry": name, "kind": "peer" if name.startswith("peer:") else "ulysses-sp"}
            mine = [r[(index, name)] for r in per_rank]
            if "skipped" in mine[0]:
                rows.append({**row, "skipped": mine[0]["skipped"]})
                continue
            fwd = [max(r["runs"][i][0] for r in mine) for i in range(len(mine[0]["runs"]))]
            total = [max(r["runs"][i][1] for r in mine) for i in range(len(mine[0]["runs"]))]
            peaks = [run[2] for r in mine for run in r["runs"] if run[2] is not None]
            row.update(
                fwd_s=_spread(fwd),
                fwd_bwd_s=_spread(total),
                fwd_bwd_s_all=total,
                peak_mem_bytes=max(peaks) if peaks else None,
                # peers' collectives bypass CommCounter
                fwd_bytes_sent=None if row["kind"] == "peer" else max(r["runs"][-1][3] for r in mine),
                bwd_bytes_sent=None if row["kind"] == "peer" else max(r["runs"][-1][4] for r in mine),
            )
            if "resolved" in mine[0]:
                row["resolved"] = mine[0]["resolved"][0]
            if "analytic_bytes" in mine[0]:
                row["analytic_fwd_bytes"], row["analytic_bwd_bytes"] = mine[0]["analytic_bytes"]
                row["bytes_match"] = all((run[3], run[4]) == tuple(r["analytic_bytes"]) for r in mine for run in r["runs"])
            if "max_error" in mine[0]:
                row["max_error"] = max(r["max_error"] for r in mine)
            if t1 is not None:
                row["t1_s"] = statistics.median(t1[index])
                row["efficiency"] = row["t1_s"] / (world * row["fwd_bwd_s"]["median"])
            rows.append(row)
    return rows
