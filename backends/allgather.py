"""All-gather (Llama 3 context parallelism): gather K/V a chunk of KV heads at a time.

Queries stay local. For each chunk of ``heads_k_stride`` KV heads, K and V
are all-gathered over the SP group (the next chunk's gather posted before the
current one is computed), put in global token order, and each local query
chunk attends to the key prefix it may see: full blocks before it, the
causal diagonal, nothing after. Under the zigzag layout every rank has the
same work. The backward recomputes from the saved ``(q, k, v, out, lse)``,
re-gathers each K/V chunk and reduce-scatters dK/dV. Only one or two head
chunks of full-length K/V are alive at once.

``heads_k_stride`` may be any value from 1 to kv_heads (a last, smaller chunk
takes the remainder); by default the largest that keeps two chunks of
gathered K and V within ``max_gather_bytes``.
"""

from __future__ import annotations

import torch

from ulysses_sp import comm, layout
from ulysses_sp.blocks import blocks_backward, blocks_forward, cached_plan
from ulysses_sp.kernels import accumulator_dtype
from ulysses_sp.profile import Profile
from ulysses_sp.spec import AttnSpec, Estimate

__all__ = ["AllGatherBackend"]


def _head_chunks(kv_heads: int, stride: int) -> list[tuple[int, int]]:
    return [(h, min(h + stride, kv_heads)) for h in range(0, kv_heads, stride)]


def _token_orders(table: list[list[int]], chunk: int, device):
    """Token index tensors on ``device``: rank-major (as gathered) -> global order, and back."""
    gathered = [n for chunks in table for n in chunks]
    to_global = torch.tensor(sorted(range(len(gathered)), key=gathered.__getitem__))
    to_gathered = torch.tensor(gathered)

    def expand(chunks: torch.Tensor) -> torch.Tensor:
        return (chunks[:, None] * chunk + torch.arange(chunk)).flatten().to(device)

    return expand(to_global), expand(to_gathered)


def _plan(q, spec: AttnSpec, topo):
    """(gathered->global token index, global->gathered, the kernel calls of every head chunk),
    kept in ``topo.cache`` per (table, chunk, device) and per packing."""
    table = layout.chunk_table(spec.layout, topo.sp_size)
    c = q.shape[1] // len(table[topo.sp_rank])
    orders = topo.cached(("allgather-orders", spec.layout, topo.sp_size, c, str(q.device)), lambda: _token_orders(table, c, q.device))
    return (*orders, cached_plan(topo, table[topo.sp_rank], range(sum(map(len, table))), c, spec, q.device))


def _gathered_head_chunks(k, v, group, stride: int, to_global):
    """Yield ``(h0, h1, k_full, v_full)``: KV heads h0..h1-1 of every rank in global
    token order; the next chunk's all-gather is posted before this one is used."""
    chunks = _head_chunks(k.shape[2], stride)
    pending = _gather(k, v, chunks[0], group)
    try:
        for n, (h0, h1) in enumerate(chunks):
            k_full, v_full = (wait().index_select(1, to_global) for wait in pending)
            if n + 1 < len(chunks):
                pending = _gather(k, v, chunks[n + 1], group)
            yield h0, h1, k_full, v_full
    except BaseException:  # the consumer raised (GeneratorExit here): no prefetch may stay in flight
        comm.drain(pending)
        raise


def _gather(k, v, heads: tuple[int, int], group):
    h0, h1 = heads
    return [comm.all_gather_start(t[:, :, h0:h1], group, dim=1) for t in (k, v)]


class _AllGatherAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, plan, kernel, scale, stride):
        to_global, _, calls = plan
        groups = q.shape[2] // k.shape[2]
        acc = accumulator_dtype(q.dtype)
        out_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        lse_acc = torch.full((q.shape[0], q.shape[2], q.shape[1]), float("-inf"), dtype=acc, device=q.device)
        for h0, h1, k_full, v_full in _gathered_head_chunks(k, v, group, stride, to_global):
            qh = slice(h0 * groups, h1 * groups)
            blocks_forward(kernel, q[:, :, qh], k_full, v_full, calls, scale, out_acc[:, :, qh], lse_acc[:, qh])
        out = out_acc.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse_acc)
        ctx.args = (group, plan, kernel, scale, stride)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        group, plan, kernel, scale, stride = ctx.args
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        to_global, to_gathered, calls = plan
        groups = q.shape[2] // k.shape[2]
        acc = accumulator_dtype(q.dtype)
        dq_acc = torch.zeros(q.shape, dtype=acc, device=q.device)
        dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_k else None
        dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_v else None
        for h0, h1, k_full, v_full in _gathered_head_chunks(k, v, group, stride, to_global):
            qh = slice(h0 * groups, h1 * groups)
            dk_full = torch.zeros(k_full.shape, dtype=acc, device=k.device)
            dv_full = torch.zeros(v_full.shape, dtype=acc, device=v.device)
            blocks_backward(
                kernel, dout[:, :, qh], q[:, :, qh], k_full, v_full, out[:, :, qh], lse[:, qh], calls, scale,
                dq_acc[:, :, qh], dk_full, dv_full,
            )
            for grad_full, dest in ((dk_full, dk), (dv_full, dv)):
                if dest is not None:  # back to rank-major order; each rank keeps the sum for its own tokens
                    dest[:, :, h0:h1] = comm.reduce_scatter_sum(grad_full.index_select(1, to_gathered), group, dim=1)
        return (dq_acc.to(q.dtype) if need_q else None), dk, dv, None, None, None, None, None


class AllGatherBackend:
    name = "allgather"

    def __init__(self, heads_k_stride: int | None = None, max_gather_bytes: int = 1 << 30):
        if heads_k_stride is not None and (isinstance(heads_k_stride, bool) or not isinstance(heads_k_stride, int) or heads_k_stride < 1):
            raise ValueError(f"heads_k_stride must be a positive integer or None, got {heads_k_stride!r}")
        self.heads_k_stride, self.max_gather_bytes = heads_k_stride, max_gather_bytes

    def stride(self, spec: AttnSpec) -> int:
        """KV heads gathered at once."""
        if self.heads_k_stride is not None:
            return min(self.heads_k_stride, spec.kv_heads)
        per_head = 4 * spec.batch * spec.seq_len * spec.head_dim * spec.element_size  # K and V, two chunks alive
        return max(1, min(spec.kv_heads, self.max_gather_bytes // per_head))

    def check(self, spec: AttnSpec, topo) -> str | None:
        if self.heads_k_stride is not None and self.heads_k_stride > spec.kv_heads:
            return f"{self.name}: heads_k_stride ({self.heads_k_stride}) exceeds the kv heads ({spec.kv_heads})"
        return None

    def estimate(self, spec: AttnSpec, topo, profile: Profile) -> Estimate:
        p = topo.sp_size
        kv_local = 2 * spec.head_bytes * spec.kv_heads
        acc = spec.accumulator_ratio
        comm_bytes = kv_local * (p - 1)
        chunks = -(-spec.kv_heads // self.stride(spec))
        spans = topo.spans_nodes("sp")
        # forward and backward each gather K and V per head chunk; the backward reduce-scatters dK, dV (fp32)
        transfer = 0.0
        if p > 1:
            transfer = profile.link("all_gather", spans).seconds(2 * comm_bytes, calls=4 * chunks)
            transfer += profile.link("reduce_scatter", spans).seconds(comm_bytes * acc, calls=2 * chunks)
        gathered = 4 * spec.batch * spec.seq_len * self.stride(spec) * spec.head_dim * spec.element_size
        q_bytes = spec.head_bytes * spec.q_heads
        # the first chunk's gather is exposed; the rest overlaps the previous chunk's compute
        seconds = transfer / chunks + profile.overlapped(profile.attention_fwd_bwd_seconds(spec, p), transfer * (1 - 1 / chunks))
        groups = spec.q_heads // spec.kv_heads
        workspace = spec.kernel_workspace_bytes(self.stride(spec) * groups, spec.local_seq_len // layout.chunks_per_rank(spec.layout), spec.seq_len)  # a query chunk, its prefix
        return Estimate(seconds=seconds, peak_bytes=int(q_bytes * (2 + acc) + kv_local + gathered + workspace), comm_bytes=comm_bytes,
                        bwd_comm_bytes=int(comm_bytes * (1 + acc)))  # re-gather K/V, reduce-scatter dK/dV

    def forward(self, q, k, v, spec: AttnSpec, topo) -> torch.Tensor:
        plan = _plan(q, spec, topo)
        return _AllGatherAttention.apply(q, k, v, topo.sp_group, plan, spec.kernel, spec.softmax_scale, self.stride(spec))
