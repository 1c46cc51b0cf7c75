"""What a backend is asked to do (`AttnSpec`) and what it costs (`Estimate`).

Kept below both the registry and the backends so that neither imports the other;
the machine figures costs come from are in `ulysses_sp.profile`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from . import layout as _layout
from .kernels import accumulator_dtype

__all__ = ["AttnSpec", "Estimate", "MixerEstimate"]


@dataclass(frozen=True)
class AttnSpec:
    """One attention call, identical on every rank of the SP group: what a backend is asked to run.

    Attributes:
        batch: Sequences in the batch.
        seq_len: Global sequence length (all ranks together).
        local_seq_len: Tokens this rank holds: ``seq_len / sp_size``.
        q_heads: Query heads.
        kv_heads: Key and value heads (a divisor of ``q_heads``).
        head_dim: Dimension of a head.
        dtype: The inputs' dtype.
        causal: Whether the mask is causal.
        softmax_scale: Scale of the scores.
        layout: The token layout of the shards (``contiguous``, ``zigzag``, ``balanced``).
        cu_seqlens: Global document boundaries of a packed sequence ``(0, ..., seq_len)``, or None.
        kernel: The local attention kernel that computes it (never ``auto``: resolved already).
        window: Sliding window, Hugging Face's convention: query i sees key j iff
            ``i - window < j <= i`` (causal only); None: every earlier key.
        softcap: Logit soft-capping (Gemma 2): scores become ``softcap * tanh(scores / softcap)``;
            0: none.
        sinks: Learned attention sinks (GPT-OSS): one logit per query head in each row's softmax
            denominator, no value; they cost no transfer beyond the ulysses backend's slice of them.
        blocks: Bidirectional blocks, global ``(start, end)`` sorted and disjoint, each within a
            document (causal only): a query of a block also sees the block's later keys (Gemma 3's
            image tokens; within the window on sliding layers); None: none. Costs ignore the pairs they add.
    """

    batch: int
    seq_len: int
    local_seq_len: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    causal: bool
    softmax_scale: float
    layout: str
    cu_seqlens: tuple[int, ...] | None = None
    kernel: str = "torch"
    window: int | None = None
    softcap: float = 0.0
    sinks: bool = False
    blocks: tuple[tuple[int, int], ...] | None = None

    def chunk_table(self, sp_size: int) -> list[list[int]]:
        """The layout's chunk table for this call (``balanced`` reads the documents)."""
        return _layout.chunk_table(self.layout, sp_size, self.seq_len, self.cu_seqlens)

    def chunks_per_rank(self, sp_size: int) -> int:
        return _layout.chunks_per_rank(self.layout, self.seq_len, sp_size)

    def query_run_tokens(self, table) -> int:
        """The tokens of one kernel call's queries when each row of ``table`` (ranks' chunks, or
        ring ranks' groups' chunks) runs its chunks joined into contiguous runs: the shortest
        row average, the one at which a rank's kernel runs least efficiently."""
        chunk = self.seq_len // sum(len(row) for row in table)
        return min(chunk * len(row) // (1 + sum(b != a + 1 for a, b in zip(row, row[1:]))) for row in map(sorted, table))

    def work_imbalance(self, table) -> float:
        """The slowest row of ``table`` (ranks' chunks, or ring ranks' groups' chunks) over the mean
        in attention work for this call's documents, mask and window: the factor by which a
        backend that splits the work by chunks waits on its slowest rank (ulysses splits by
        heads: 1)."""
        return _layout.table_imbalance(table, self.seq_len, self.cu_seqlens, causal=self.causal, window=self.window)

    def visible_pairs(self, length: int) -> float:
        """Query-key pairs one sequence of ``length`` tokens computes: length**2, halved
        under a causal mask, about length * window under a window shorter than it."""
        if self.window is not None and self.window < length:
            return length * self.window - self.window * (self.window - 1) / 2
        return length**2 / (2 if self.causal else 1)

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def head_bytes(self) -> int:
        """Bytes of one head of this rank's shard of q, k or v."""
        return self.batch * self.local_seq_len * self.head_dim * self.element_size

    @property
    def shard_bytes(self) -> int:
        """Bytes of this rank's q, k, v and output shards."""
        return self.head_bytes * (2 * self.q_heads + 2 * self.kv_heads)

    @property
    def accumulator_ratio(self) -> float:
        """Bytes of a partial-result accumulator (``kernels.accumulator_dtype``) per byte of input."""
        return torch.empty((), dtype=accumulator_dtype(self.dtype)).element_size() / self.element_size

    def kernel_workspace_bytes(self, heads: int, sq: int, sk: int) -> int:
        """Working memory of the kernel for its largest call (``heads`` q heads, ``sq`` queries,
        ``sk`` keys): the math kernel holds scores, probabilities and their gradient in fp32
        (fp64) per (query, key) pair; the fused kernels only an lse and a softmax-d row each."""
        pairs = sk if self.kernel == "math" else 2
        return int(3 * self.batch * heads * sq * pairs * self.element_size * self.accumulator_ratio)

    def attention_flops(self, ranks: int) -> float:
        """Forward attention FLOPs per rank when ``ranks`` share the work evenly:
        4 * B * (query-key pairs) * Hq * D / ranks, pairs (`visible_pairs`) counted
        per document for packed sequences."""
        bounds = self.cu_seqlens or (0, self.seq_len)
        pairs = sum(self.visible_pairs(b - a) for a, b in zip(bounds, bounds[1:]))
        return 4 * self.batch * pairs * self.q_heads * self.head_dim / ranks


@dataclass(frozen=True)
class MixerEstimate:
    """A mixer strategy's cost for one layer of a hybrid model, per rank (the slowest rank's)."""

    compute: float
    """Share of one process's mixer compute this rank does: about 1/P when the work splits, 1 when
    every rank runs the whole sequence."""
    comm_bytes: int
    """Bytes this rank sends in the forward."""
    bwd_comm_bytes: int
    """Bytes this rank sends in the backward."""
    seconds: float | None = field(default=None, compare=False)
    """Estimated forward and backward seconds (`ulysses_sp.mixers.auto`), where the plan computed them."""


@dataclass(frozen=True)
class Estimate:
    """A backend's predicted cost for one layer's attention, per rank.

    Attributes:
        seconds: Forward plus backward, on this rank.
        peak_bytes: Activation memory the backend holds at its peak (inputs and output included).
        comm_bytes: Bytes this rank sends in the forward (what `CommCounter.bytes_sent` reports).
        bwd_comm_bytes: Bytes this rank sends in the backward when q, k and v all need a gradient.
        work_imbalance: The slowest rank's attention work over the mean
            (`AttnSpec.work_imbalance`), by which ``seconds`` scaled the compute: above 1 where
            the layout splits packed rows unevenly.
        kernel_efficiency: The share of the local kernel's rate the estimate ran its attention at
            (`Profile.efficiency`): below 1 where the profile knows the backend's calls fall
            short of it (the built-in GPU profile).
    """

    seconds: float
    peak_bytes: int
    comm_bytes: int
    bwd_comm_bytes: int = 0
    work_imbalance: float = 1.0
    kernel_efficiency: float = 1.0
