"""``sp-bench run``'s measurements: every backend (and peer) on every cell of a grid.

One rank function runs the whole grid inside one group of ranks. Per cell:
``warmup`` untimed calls of each entry, then ``repeat`` rounds in which every
entry runs once, the order rotating between rounds, so that a drift of the
machine's speed during a cell falls on every entry alike (run i of two entries
ran in the same round: their ratio is paired). With ``baseline``, the rounds also
run T1, the same attention on the whole sequence on rank 0 alone (the other ranks
wait at the next barrier), so that the scaling efficiency T1 / (P x T) is paired
too and T1 runs in a rank's process, under its allocator settings. Each call starts at a barrier;
forward and forward+backward seconds per rank (CUDA synchronised);
peak memory of the call; bytes sent, counted by ``CommCounter``; with
``check``, the max error of out, dq, dk, dv against fp64 attention of the
whole sequence. The report takes, per repeat, the slowest rank.

Peak memory: on CUDA the allocator's peak above what was allocated before the
call; on CPU the process's peak resident set (``VmHWM``, reset through
``/proc/self/clear_refs``) above its resident set before the call. For that the
ranks need glibc's mmap threshold at 128 KiB, so that a freed tensor leaves the
resident set; every large tensor is then fresh pages, whose faults slowed the calls
by up to 41% at 4k (benchmarks/results/efficiency-probe-P2-*.json against efficiency-P2-*.json). So ``sp-bench run`` times its spawned CPU ranks
with ``memory=False`` and measures memory in a second group of ranks started with
that setting, one call per entry and cell (after one warmup). ``summarise`` takes a
rank's ``"peak"`` where such a pass left one, else the peaks of its runs.
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
from ulysses_sp import kernels, layout
from ulysses_sp.registry import problem

from .calibrate import rotated
from .peers import PEERS

__all__ = ["BASELINE", "Cell", "PeakMemory", "cells", "measure_rank", "memory_method", "summarise"]

BACKENDS = ("ulysses", "allgather", "ring", "hybrid", "halo", "auto")
MMAP_THRESHOLD = 1 << 17
"""glibc otherwise raises its mmap threshold as large blocks are freed and keeps them
resident, hiding the next call's allocations from the resident-set measure."""
BASELINE = "one rank (T1)"  # the key of T1's runs in measure_rank's results


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
    docs: str | None = None
    """The ``--docs`` spec of a packed row (``cli.docs``), None for one document."""
    cu_seqlens: tuple[int, ...] | None = None
    """The row's document boundaries drawn from ``docs``."""
    sinks: bool = False
    """Learned attention sinks (`sinks_of`)."""

    @property
    def bounds(self) -> tuple[int, ...]:
        return self.cu_seqlens or (0, self.seq)


def cells(seqs, heads, kv_heads, head_dims, batches, dtypes, causal: bool, layouts, windows=(None,), docs: str | None = None,
          docs_seed: int = 0, sinks: bool = False) -> tuple[list[Cell], list[str]]:
    """The grid's cells (``layouts``: one name or several), and a note for every combination left
    out (kv heads not dividing q heads)."""
    from .docs import parse_docs

    out, dropped = [], []
    layouts = [layouts] if isinstance(layouts, str) else list(layouts)
    for lay, s, h, kv, d, b, dt, w in itertools.product(layouts, seqs, heads, kv_heads, head_dims, batches, dtypes, windows):
        if kv > h or h % kv:
            dropped.append(f"heads {h} / kv heads {kv}: kv heads must divide q heads")
            continue
        out.append(Cell(s, h, kv, d, b, dt, causal, lay, w, docs, parse_docs(docs, s, docs_seed) if docs else None, sinks))
    return out, dropped


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class PeakMemory:
    """Peak bytes above the starting point while open (see the module docstring); None where
    not ``enabled`` or not measurable."""

    def __init__(self, device, enabled: bool = True):
        self.device, self.enabled, self.peak = device, enabled, None

    @staticmethod
    def _status(field: str) -> int:
        with open("/proc/self/status") as f:
            return int(re.search(rf"{field}:\s+(\d+) kB", f.read()).group(1)) * 1024

    def __enter__(self):
        self.start = None
        if self.enabled and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.start = torch.cuda.memory_allocated(self.device)
        elif self.enabled and os.path.exists("/proc/self/clear_refs"):
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset VmHWM to the current resident set
            self.start = self._status("VmRSS")
        return self

    def __exit__(self, *exc):
        if self.start is None:
            self.peak = None
        elif self.device.type == "cuda":
            self.peak = torch.cuda.max_memory_allocated(self.device) - self.start
        else:
            self.peak = self._status("VmHWM") - self.start


def memory_method(device, memory: bool = True, threshold: str | None = None) -> str:
    """What the peak memory figure is; ``threshold``: the MALLOC_MMAP_THRESHOLD_ of a separate memory pass."""
    if not memory:
        return "not measured (--no-memory)"
    if device.type == "cuda":
        return "CUDA allocator: max_memory_allocated above the allocation before the call"
    if os.path.exists("/proc/self/clear_refs"):
        return "process peak resident set (VmHWM, reset via /proc/self/clear_refs) above the resident set before the call" + (
            f"; one call per entry and cell in a separate group of ranks run with MALLOC_MMAP_THRESHOLD_={threshold}, so freed "
            "tensors leave the resident set; the timed calls ran in another group" if threshold else "")
    return "not measured on this platform"


def _inputs(cell: Cell, device):
    """The global q, k, v and upstream gradient, the same on every rank."""
    gen = torch.Generator().manual_seed(cell.seq * 1000 + cell.heads * 10 + cell.kv_heads)
    dtype = getattr(torch, cell.dtype)

    def make(h):
        return torch.randn(cell.batch, cell.seq, h, cell.head_dim, generator=gen).to(device=device, dtype=dtype)

    return make(cell.heads), make(cell.kv_heads), make(cell.kv_heads), make(cell.heads)


def sinks_of(cell: Cell, device):
    """The cell's sinks (None without ``--sinks``): one float32 logit per head, drawn around 1, the same on every rank."""
    if not cell.sinks:
        return None
    return (torch.randn(cell.heads, generator=torch.Generator().manual_seed(cell.heads)) + 1.0).to(device)


def _reference(full, cell: Cell):
    """fp64 out and dq, dk, dv of the whole sequence."""
    leaves = [t.double().requires_grad_() for t in full[:3]]
    sinks = sinks_of(cell, leaves[0].device)
    out = kernels.local_attention(*leaves, causal=cell.causal, window=cell.window, cu_seqlens=cell.cu_seqlens,
                                  sinks=None if sinks is None else sinks.double())
    out.backward(full[3].double())
    return [out.detach()] + [t.grad for t in leaves]


def _entry(name: str, cell: Cell, topo_for, kernel: str = "auto"):
    """(callable, topology of its shards, None) for a backend or ``peer:NAME``, or (None, None, why it cannot run)."""
    topo = topo_for(cell.layout)
    if name.startswith("peer:"):
        peer = PEERS[name[5:]]
        reason = ("peers are run without a sliding window" if cell.window else
                  "peers are run without attention sinks" if cell.sinks else
                  "peers are run on one document per row" if cell.cu_seqlens else
                  "peers run the zigzag and contiguous layouts only" if cell.layout == "balanced" else peer.problem(cell, topo))
        if reason:
            return None, None, reason
        shard_topo = topo_for(peer.shard_layout(cell.layout))
        return peer.make(cell, shard_topo, kernel), shard_topo, None
    probe = torch.empty(cell.batch, cell.seq // topo.sp_size, 1, cell.head_dim, dtype=getattr(torch, cell.dtype), device=topo.device)
    q, kv = probe.expand(-1, -1, cell.heads, -1), probe.expand(-1, -1, cell.kv_heads, -1)
    try:
        spec = usp.attention.make_spec(q, kv, kv, topo, causal=cell.causal, kernel=kernel, window=cell.window, cu_seqlens=cell.cu_seqlens,
                                       sinks=sinks_of(cell, topo.device))
    except ValueError as e:  # the kernel cannot take this cell
        return None, None, str(e)
    reason = problem(usp.get_backend(name), spec, topo) if name != "auto" else None
    if reason:
        return None, None, reason
    attn = usp.SequenceParallelAttention(topo, backend=name, kernel=kernel)
    return functools.partial(attn, window=cell.window, cu_seqlens=cell.cu_seqlens, sinks=sinks_of(cell, topo.device)), topo, None


def _payload(counter) -> int:
    """Bytes sent by the attention itself: the one-off shape handshake of a first call is left out."""
    handshake = counter.by_op.get("handshake")
    return counter.bytes_sent - (handshake.sent if handshake else 0)


def _run_once(fn, shards, dout, device, group, memory: bool = True):
    """One forward+backward from a barrier: ((fwd s, fwd+bwd s, peak bytes or None, fwd bytes, bwd bytes), out, grads)."""
    leaves = [t.detach().clone().requires_grad_() for t in shards]
    dist.barrier(group)
    with PeakMemory(device, enabled=memory) as mem:
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


def _run_baseline(cell: Cell, full, device, group, kernel: str) -> float | None:
    """T1 from a barrier: forward+backward seconds of the whole sequence on rank 0; None on the
    other ranks, which go on to the next call's barrier and wait there."""
    dist.barrier(group)
    if dist.get_rank(group) != 0:
        return None
    leaves = [t.clone().requires_grad_() for t in full[:3]]
    t0 = time.perf_counter()
    kernels.local_attention(*leaves, causal=cell.causal, kernel=kernel, window=cell.window, cu_seqlens=cell.cu_seqlens,
                            sinks=sinks_of(cell, device)).backward(full[3])
    _sync(device)
    return time.perf_counter() - t0


def _advance(bar, calls: int, name: str, cell: Cell) -> None:
    if bar is not None:
        bar.set_postfix_str(f"{name} S={cell.seq} H={cell.heads}/{cell.kv_heads}")
        bar.update(calls)


def measure_rank(cells_: list[Cell], entries: list[str], *, warmup: int, repeat: int, check: bool, topo_args: dict, progress: bool,
                 kernel: str = "auto", baseline: bool = False, memory: bool = True, desc: str = "sp-bench") -> dict:
    """Run on every rank of the SP group (the world): ``{(cell index, entry): this rank's figures}``;
    with ``baseline`` also ``{(cell index, BASELINE): {"runs": T1 seconds per round}}`` (None off rank 0)."""
    topos = {}

    def topo_for(name):
        if name not in topos:
            topos[name] = usp.init_sequence_parallel(dist.get_world_size(), layout=name, **topo_args)
        return topos[name]

    bar = None
    if progress and dist.get_rank() == 0:
        from tqdm import tqdm

        bar = tqdm(total=len(cells_) * (len(entries) + baseline) * (warmup + repeat), desc=desc, unit="call")
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
            shards = [usp.shard_sequence(t, shard_topo, cu_seqlens=cell.bounds) for t in full]
            ready[name] = fn, shards, shard_topo
            results[(index, name)] = {"runs": []}
            for _ in range(warmup):
                _run_once(fn, shards[:3], shards[3], topo.device, topo.sp_group, memory)
                _advance(bar, 1, name, cell)
        names = list(ready)  # empty where every entry was skipped
        if baseline:
            if names:
                names.append(BASELINE)
                results[(index, BASELINE)] = {"runs": []}
                for _ in range(warmup):
                    _run_baseline(cell, full, topo.device, topo.sp_group, kernel)
                    _advance(bar, 1, BASELINE, cell)
            else:
                _advance(bar, warmup + repeat, BASELINE, cell)
        last = {}
        for round_ in range(repeat):
            for name in rotated(names, round_):
                if name == BASELINE:
                    results[(index, name)]["runs"].append(_run_baseline(cell, full, topo.device, topo.sp_group, kernel))
                else:
                    fn, shards, _ = ready[name]
                    run, out, grads = _run_once(fn, shards[:3], shards[3], topo.device, topo.sp_group, memory)
                    results[(index, name)]["runs"].append(run)
                    last[name] = out, grads
                _advance(bar, 1, name, cell)
        reference = _reference(full, cell) if check and ready else None
        for name, (fn, shards, shard_topo) in ready.items():
            result = results[(index, name)]
            if name == "auto":
                result["resolved"] = [b.name for b in fn.func._chosen.values()]
            if not name.startswith("peer:"):
                spec = usp.attention.make_spec(*shards[:3], shard_topo, causal=cell.causal, window=cell.window, cu_seqlens=cell.cu_seqlens,
                                               sinks=sinks_of(cell, shard_topo.device))
                backend = usp.get_backend(result.get("resolved", [name])[0])
                estimate = backend.estimate(spec, shard_topo, shard_topo.profile or usp.CPU_GLOO_PROFILE)
                result["analytic_bytes"] = (estimate.comm_bytes, estimate.bwd_comm_bytes)
            if check:
                out, grads = last[name]
                mine = [usp.shard_sequence(t, shard_topo, cu_seqlens=cell.bounds) for t in reference]
                result["max_error"] = max((a.double() - b).abs().max().item() for a, b in zip([out, *grads], mine))
    if bar is not None:
        bar.close()
    return results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarise(cells_: list[Cell], entries: list[str], per_rank: list[dict], world: int) -> list[dict]:
    """One row per (cell, entry): the slowest rank per repeat, medians and spreads, bytes and, where
    T1 ran, the efficiency: the median over rounds of T1 / (P x T) within a round."""
    rows = []
    for index, cell in enumerate(cells_):
        for name in entries:
            row = {**asdict(cell), "entry": name, "kind": "peer" if name.startswith("peer:") else "ulysses-sp",
                   "work_imbalance": layout.work_imbalance(cell.layout, cell.seq, world, cell.bounds, causal=cell.causal, window=cell.window)}
            mine = [r[(index, name)] for r in per_rank]
            if "skipped" in mine[0]:
                rows.append({**row, "skipped": mine[0]["skipped"]})
                continue
            fwd = [max(r["runs"][i][0] for r in mine) for i in range(len(mine[0]["runs"]))]
            total = [max(r["runs"][i][1] for r in mine) for i in range(len(mine[0]["runs"]))]
            peaks = [p for r in mine for p in ([r["peak"]] if "peak" in r else [run[2] for run in r["runs"]]) if p is not None]
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
            t1 = per_rank[0].get((index, BASELINE))
            if t1 is not None:
                row["t1_s"] = statistics.median(t1["runs"])
                row["efficiency"] = statistics.median(a / (world * b) for a, b in zip(t1["runs"], total))
            rows.append(row)
    return rows
