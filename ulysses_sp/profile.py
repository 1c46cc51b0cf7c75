"""Machine figures that backend cost estimates are computed from.

A `Profile` holds, per kind of collective, a latency and a bandwidth
(inside a node, and across nodes), the local attention kernel's throughput
forward and backward by dtype, whether communication overlaps computation,
and an optional memory budget. Built in: NVLink GPUs, and CPU with gloo measured
on 2 and on 4 ranks (`default_profile` takes the one for the SP size);
``sp-bench calibrate`` measures one for the machine and rank count at hand and
writes JSON that `load_profile` reads back.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

__all__ = ["LinkCost", "Profile", "CPU_GLOO_PROFILE", "CPU_GLOO_PROFILE_P4", "NVLINK_PROFILE", "load_profile", "default_profile", "profile_for",
           "COLLECTIVES"]

COLLECTIVES = ("all_to_all", "all_gather", "reduce_scatter", "p2p")


@dataclass(frozen=True)
class LinkCost:
    """The cost model of one kind of transfer: a fixed latency per call plus bytes over a bandwidth.

    Attributes:
        latency: Seconds of fixed cost per call.
        bandwidth: Bytes per second one rank sends.
    """

    latency: float
    bandwidth: float

    def seconds(self, bytes_sent: float, calls: int = 1) -> float:
        """Seconds for ``calls`` calls that send ``bytes_sent`` bytes in all.

        Args:
            bytes_sent: Bytes this rank sends, all calls together.
            calls: Number of calls, each paying the latency.

        Returns:
            ``calls * latency + bytes_sent / bandwidth``.
        """
        return calls * self.latency + bytes_sent / self.bandwidth


@dataclass(frozen=True)
class Profile:
    """Machine figures that ``auto`` and ``sp-bench plan`` estimate backend costs from.

    Built in: `NVLINK_PROFILE`, `CPU_GLOO_PROFILE` and `CPU_GLOO_PROFILE_P4`
    (`default_profile` picks one); ``sp-bench calibrate`` measures one for the machine and rank
    count at hand and writes JSON that `load_profile` reads back. Pass it to
    `init_sequence_parallel` (``profile=``) to make ``auto`` use it.

    Attributes:
        name: What the figures are of.
        collectives: Inside a node, per collective (``all_to_all``, ``all_gather``,
            ``reduce_scatter``, ``p2p``).
        inter_node: Any collective whose group spans nodes.
        attention_fwd_flops: Forward attention FLOP/s of the local kernel by dtype name
            (``float32``, ``bfloat16``...); FLOPs counted as 4 * B * Sq * Sk * H * D, halved under
            a causal mask.
        attention_bwd_flops: The backward's rate against the same FLOP count (so backward
            seconds = FLOPs / this).
        overlap: Whether communication posted before a computation runs while it runs.
        memory_budget_bytes: Backends whose estimated peak exceeds this are not chosen by
            ``auto`` (None: what the CUDA device reports free; no limit on CPU).
        backend_overhead: Per backend, seconds per byte of a rank's q and output shards that it
            took beyond its estimate on calibration's reference shapes, less the smallest such
            figure of any backend: what the model misses (copies, block merges, ranks waiting at
            every ring step on oversubscribed cores). Added to the estimate, so it grows linearly
            with the shards. 0 when absent.
        backend_overhead_kv: The same per byte of a rank's k and v shards (calibration times an
            MHA and an MQA shape and solves for both). None: ``backend_overhead`` counts every
            shard byte.
        kernel_efficiency: Per backend family (``ulysses``, ``allgather``, ``ring``, ``hybrid``,
            ``halo``; ``hybrid-u{U}`` and ``ulysses-g{G}`` read their family's), the share of the
            local kernel's rate its attention reaches on long blocks. 1 when absent.
        kernel_half_rate_tokens: A kernel call over n query tokens runs at n / (n + this) of the
            kernel's rate on long ones (small blocks leave the GPU's units idle). 0: every length
            at the full rate.
        comm_exposed: Per collective, the share of a transfer posted alongside computation that
            stays exposed all the same (NCCL's kernels take SMs from the attention; gloo's
            threads take the cores). 0 when absent.
        ulysses_head_groups: Head groups the Ulysses backend pipelines its all-to-alls over; 1:
            one fused all-to-all each way.
        measured: What calibration measured (sizes, raw timings), for the record.
    """

    name: str
    collectives: dict[str, LinkCost]
    inter_node: LinkCost
    attention_fwd_flops: dict[str, float]
    attention_bwd_flops: dict[str, float]
    overlap: bool = True
    memory_budget_bytes: int | None = None
    backend_overhead: dict[str, float] = field(default_factory=dict)
    backend_overhead_kv: dict[str, float] | None = None
    kernel_efficiency: dict[str, float] = field(default_factory=dict)
    kernel_half_rate_tokens: float = 0.0
    comm_exposed: dict[str, float] = field(default_factory=dict)
    ulysses_head_groups: int = 1
    measured: dict = field(default_factory=dict, compare=False)

    def link(self, collective: str, spans_nodes: bool) -> LinkCost:
        return self.inter_node if spans_nodes else self.collectives[collective]

    def attention_seconds(self, flops: float, dtype, backward: bool = False) -> float:
        rates = self.attention_bwd_flops if backward else self.attention_fwd_flops
        name = str(dtype).replace("torch.", "")
        return flops / rates.get(name, rates.get("float32"))

    def efficiency(self, backend: str, block_tokens: float) -> float:
        """The share of the kernel's rate ``backend``'s attention reaches with calls over
        ``block_tokens`` query tokens: ``kernel_efficiency`` of its family times the block's
        ``kernel_half_rate_tokens`` term."""
        share = self.kernel_efficiency.get(re.sub(r"-[ug][0-9]+$", "", backend), 1.0)
        n0 = self.kernel_half_rate_tokens
        return share * block_tokens / (block_tokens + n0) if n0 else share

    def overlapped(self, compute: float, transfer: float, collective: str | None = None) -> float:
        """Seconds for computation and ``collective``'s transfer posted alongside it."""
        exposed = transfer * self.comm_exposed.get(collective, 0.0)
        return (max(compute, transfer - exposed) if self.overlap else compute + transfer - exposed) + exposed

    def attention_fwd_bwd_seconds(self, spec, ranks: int, efficiency: float = 1.0) -> float:
        """Forward and backward seconds of a rank's share of ``spec``'s attention, the kernel
        running at ``efficiency`` of its rate (`efficiency`)."""
        flops = spec.attention_flops(ranks)
        return (self.attention_seconds(flops, spec.dtype) + self.attention_seconds(flops, spec.dtype, backward=True)) / efficiency

    def overhead_seconds(self, backend: str, spec) -> float:
        """``backend_overhead`` and ``backend_overhead_kv`` of ``backend`` for one call of ``spec``."""
        per_kv = self.backend_overhead if self.backend_overhead_kv is None else self.backend_overhead_kv
        q_bytes, kv_bytes = 2 * spec.q_heads * spec.head_bytes, 2 * spec.kv_heads * spec.head_bytes
        return self.backend_overhead.get(backend, 0.0) * q_bytes + per_kv.get(backend, 0.0) * kv_bytes

    def to_json(self) -> str:
        """The profile as JSON, what `save` writes and `load_profile` reads."""
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    def save(self, path: str) -> None:
        """Write the profile as JSON.

        Args:
            path: The file to write.
        """
        with open(path, "w") as f:
            f.write(self.to_json() + "\n")

    @classmethod
    def from_dict(cls, data: dict) -> "Profile":
        """The profile whose fields ``data`` holds (the parsed JSON of `to_json`).

        Args:
            data: Every field by name; ``collectives`` and ``inter_node`` as dicts of ``latency``
                and ``bandwidth``.

        Returns:
            The profile.

        Raises:
            ValueError: A collective missing, or a field this version does not know.
        """
        data = dict(data)
        data["collectives"] = {k: LinkCost(**v) for k, v in data["collectives"].items()}
        data["inter_node"] = LinkCost(**data["inter_node"])
        missing = set(COLLECTIVES) - set(data["collectives"])
        if missing:
            raise ValueError(f"profile lacks collectives {sorted(missing)}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"profile has unknown fields {sorted(unknown)}; measure it again with this version's sp-bench calibrate")
        return cls(**data)


def load_profile(path: str) -> Profile:
    """Read a profile written by ``sp-bench calibrate`` (or by `Profile.save`).

    Args:
        path: The JSON file.

    Returns:
        The profile.

    Raises:
        ValueError: A profile with a collective missing or a field this version does not know
            (measure it again with this version's ``sp-bench calibrate``).
    """
    with open(path) as f:
        return Profile.from_dict(json.load(f))


CPU_GLOO_PROFILE = Profile(
    name="cpu-gloo (built in)",
    collectives={
        "all_to_all": LinkCost(latency=6.4e-4, bandwidth=4.2e8),
        "all_gather": LinkCost(latency=4.8e-4, bandwidth=2.9e8),
        "reduce_scatter": LinkCost(latency=8.8e-4, bandwidth=3e8),
        "p2p": LinkCost(latency=3.6e-4, bandwidth=1.4e9),
    },
    inter_node=LinkCost(latency=4.8e-4, bandwidth=2.9e8),
    attention_fwd_flops={"float32": 6.9e10, "bfloat16": 1.6e11, "float64": 2.5e10, "float16": 1e10},
    attention_bwd_flops={"float32": 3e10, "bfloat16": 3.2e10, "float64": 1e10, "float16": 4e9},
    overlap=False,
    backend_overhead={"ulysses": 1.56e-9, "allgather": 4.64e-9, "ring": 3.31e-9},
    backend_overhead_kv={"ulysses": 0.07e-9, "allgather": 0.0, "ring": 1.55e-9},
    ulysses_head_groups=1,
)
"""Built-in profile of gloo on one CPU machine, 2 ranks of one thread each.

Each figure is the median of four runs of ``sp-bench calibrate --nproc 2`` on a 2-core machine
(``benchmarks/results/cpu-gloo-profile-P2-gqa*.json``), rounded; the float64 and float16 rates
are guesses. The overheads were fitted at 8/8 and 16/1 query/KV heads: the all-gather's falls on
the query bytes (it merges 16 query heads' blocks on one KV head), so ``auto`` does not take it
for the cheapest at one KV head. No hybrid runs on 2 or 3 ranks, so none is measured. Head
groups stay at 1: the runs and a paired benchmark showed no consistent gain from pipelining,
which holds more memory in the backward.
"""

CPU_GLOO_PROFILE_P4 = Profile(
    name="cpu-gloo 4 ranks (built in)",
    collectives={
        "all_to_all": LinkCost(latency=3.1e-3, bandwidth=4.1e8),
        "all_gather": LinkCost(latency=4.1e-3, bandwidth=2.4e8),
        "reduce_scatter": LinkCost(latency=6.9e-3, bandwidth=2e8),
        "p2p": LinkCost(latency=1.3e-3, bandwidth=9.1e8),
    },
    inter_node=LinkCost(latency=6.9e-3, bandwidth=2e8),
    attention_fwd_flops={"float32": 3.1e10, "bfloat16": 7.1e10, "float64": 1.1e10, "float16": 4.5e9},
    attention_bwd_flops={"float32": 1.25e10, "bfloat16": 1.45e10, "float64": 4e9, "float16": 1.7e9},
    overlap=False,
    backend_overhead={"ulysses": 0.0, "allgather": 4.94e-9, "ring": 9.61e-9, "hybrid-u2": 2.86e-9},
    backend_overhead_kv={"ulysses": 0.0, "allgather": 2.2e-9, "ring": 9.44e-9, "hybrid-u2": 7.61e-9},
    ulysses_head_groups=1,
)
"""Built-in profile of gloo on one CPU machine, 4 ranks of one thread on 2 cores.

Each figure is the median of four runs of ``sp-bench calibrate --nproc 4 --repeat 9``
(``benchmarks/results/cpu-gloo-profile-P4-gqa*.json``), rounded; the float64 and float16 rates
are the 2-rank guesses scaled like float32. Every rank computes at about half the 2-rank rate,
and the ring's overhead per shard byte is 3-6x the 2-rank figure (it merges P - 1 blocks a pass,
and a rank waits at every step for one that is not running). Head groups stay at 1: paired runs
(``benchmarks/results/cpu-gloo-profile-P4-paired-run*.json``) went either way.
"""

NVLINK_PROFILE = Profile(
    name="nvlink-gpu (built in)",
    collectives={c: LinkCost(latency=2e-5, bandwidth=3.5e11) for c in COLLECTIVES},
    inter_node=LinkCost(latency=2e-5, bandwidth=4.5e10),
    attention_fwd_flops={"bfloat16": 3e14, "float16": 3e14, "float32": 4e13, "float64": 2e13},
    attention_bwd_flops={"bfloat16": 1.2e14, "float16": 1.2e14, "float32": 1.6e13, "float64": 8e12},
    overlap=True,
    kernel_half_rate_tokens=530.0,
    kernel_efficiency={"ulysses": 1.0, "ring": 0.957, "hybrid": 0.957, "allgather": 0.733},
)
"""Built-in profile of H100/H200 GPUs: NVLink inside a node, 400 Gb/s InfiniBand across nodes.

Taken from published figures, not measured by this project: ``sp-bench calibrate`` on the
machine replaces it. No memory budget: ``auto`` takes what the device reports free.

- Links: NVLink 4 carries 900 GB/s per GPU both ways together (NVIDIA's H100 and H200
  datasheets), of which NCCL's collectives reach a bus bandwidth of about 350 GB/s in nccl-tests
  on 8-GPU nodes; NDR InfiniBand is 50 GB/s per GPU on the wire, about 45 GB/s achieved.
- Kernel rates: flash-attn 2's published H100 figures, rounded down.
- ``kernel_half_rate_tokens`` 530: the least-squares fit of n / (n + n0) to flash-attn 2's H100
  SXM5 forward+backward rates, causal, head dim 128, at 512 to 16k tokens (163 to 328 TFLOP/s;
  within 1% RMS).
- ``kernel_efficiency``: ``ring`` 0.957 from ring-flash-attn's README (8xH800, Llama-3-8B heads,
  8k tokens per GPU: the zigzag ring reaches 90.2% of eight local flash-attn calls); ``allgather``
  0.733 (the same README's varlen table: 58.1% where the ring reaches 75.9%); ``hybrid`` 0.957
  (its ring part is the ring's code); ``ulysses`` 1.0 (one local kernel call over the whole
  sequence). No figure for ``halo`` or ``comm_exposed`` (none published).

``tests/test_gpu_profile.py`` checks that the model reproduces each source. The direction these
give (Ulysses ahead of the ring inside a node by 5-10%, the all-gather behind both, the hybrid
with Ulysses inside a node ahead across nodes) is the one published end-to-end comparisons
report (EasyContext issue 37, prime-rl PR 2418, maxtext PR 4687, USP arXiv 2405.07719).
"""


def default_profile(device_type: str, sp_size: int = 2) -> Profile:
    """The built-in profile for a device type and SP size.

    A backend's overhead per shard byte changes with the rank count (the ring merges P - 1
    blocks; 4 ranks share 2 cores), so on CPU the profile measured at the largest rank count up
    to ``sp_size`` serves best.

    Args:
        device_type: ``cuda`` or ``cpu``.
        sp_size: Ranks per SP group.

    Returns:
        `NVLINK_PROFILE` on CUDA; on CPU `CPU_GLOO_PROFILE_P4` from 4 ranks, else `CPU_GLOO_PROFILE`.
    """
    if device_type == "cuda":
        return NVLINK_PROFILE
    return CPU_GLOO_PROFILE_P4 if sp_size >= 4 else CPU_GLOO_PROFILE


def profile_for(topo, profile: Profile | None = None) -> Profile:
    """What a call estimates with: ``profile``, else the topology's, else the built-in one
    for the topology's device and SP size."""
    return profile or getattr(topo, "profile", None) or default_profile(topo.device.type, topo.sp_size)
