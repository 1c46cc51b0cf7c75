"""Autograd-aware collectives with byte accounting.

Every collective of ulysses-sp goes through this module, and every call
records the bytes this rank sends and receives in each open
`CommCounter`. Counts are logical payload bytes: what leaves this rank
for another rank (a rank's own chunk of an all-to-all is not sent), whatever
algorithm the process-group backend uses underneath.

Sequence <-> head all-to-all (Ulysses) is fused: q, k and v (or dq, dk, dv)
travel in one ``all_to_all_single``, packed into one buffer with one copy per
tensor, and the token layout is restored in the same copy on the receiving
side. Layouts are passed as a chunk table (see ``layout.chunk_table``), so this
module knows nothing of layouts.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "CollectiveError",
    "CommCounter",
    "OpBytes",
    "all_to_all",
    "seq_to_heads",
    "heads_to_seq",
    "seq_to_heads_start",
    "heads_to_seq_start",
    "heads_view",
    "all_gather",
    "reduce_scatter",
    "ring_send_recv",
    "exchange",
    "rows_to_ranks",
    "all_gather_ints",
    "broadcast_object",
    "kv_heads_sent",
    "head_scatter_problem",
    "head_scatter_bytes",
    "replicate_kv_for_scatter",
    "all_gather_start",
    "all_reduce_sum",
    "all_reduce_sums",
    "reduce_scatter_sum",
    "group_size",
    "drain",
]


@dataclass
class OpBytes:
    """Bytes this rank sent and received through one kind of collective."""

    sent: int = 0
    recv: int = 0
    calls: int = 0


class CommCounter:
    """Counts the bytes this rank sends and receives through ulysses-sp's collectives while open.

    Counts are logical payload bytes: what leaves this rank for another rank, whatever algorithm
    the process-group backend uses underneath. Counters nest; each open one sees every call. A
    backward pass is counted by the counters open while ``backward()`` runs.

    Example:
        ```python
        with CommCounter() as c:
            out = attn(q, k, v)
        c.bytes_sent, c.bytes_recv, c.by_op["all_to_all"].sent
        ```

    Attributes:
        by_op: Per kind of collective (``all_to_all``, ``all_gather``, ``reduce_scatter``,
            ``all_reduce``, ``send_recv``, ``all_to_all_rows``): bytes ``sent``, ``recv`` and
            ``calls``.
    """

    def __init__(self) -> None:
        self.by_op: dict[str, OpBytes] = {}

    @property
    def bytes_sent(self) -> int:
        """Bytes sent, all collectives together."""
        return sum(o.sent for o in self.by_op.values())

    @property
    def bytes_recv(self) -> int:
        """Bytes received, all collectives together."""
        return sum(o.recv for o in self.by_op.values())

    def record(self, op: str, sent: int, recv: int) -> None:
        """Add one call of collective ``op`` (what `ulysses_sp.comm` does for every open counter).

        Args:
            op: The kind of collective.
            sent: Bytes this rank sent.
            recv: Bytes this rank received.
        """
        entry = self.by_op.setdefault(op, OpBytes())
        entry.sent += sent
        entry.recv += recv
        entry.calls += 1

    def __enter__(self) -> "CommCounter":
        _OPEN_COUNTERS.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _OPEN_COUNTERS.remove(self)

    def __repr__(self) -> str:
        return f"CommCounter(sent={self.bytes_sent}, recv={self.bytes_recv}, by_op={self.by_op})"


# The counters open in this process. A plain list rather than a ContextVar:
# CUDA backward runs on autograd worker threads, which do not inherit contexts.
_OPEN_COUNTERS: list[CommCounter] = []


def _record(op: str, sent: int, recv: int) -> None:
    for counter in _OPEN_COUNTERS:
        counter.record(op, sent, recv)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def group_size(group) -> int:
    return dist.get_world_size(group)


# --------------------------------------------------------------------------- raw collectives

class CollectiveError(RuntimeError):
    """A collective of an SP group failed: another rank died, timed out, or called a different
    collective. Raised on the ranks still alive instead of a hang (every group has a timeout)."""


@contextmanager
def _failing_clearly(op: str, group):
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:  # gloo/NCCL failures and timeouts (DistBackendError is one)
        raise CollectiveError(
            f"ulysses-sp: {op} over {group_size(group)} ranks failed on global rank {dist.get_rank()}: {e}\n"
            "Another rank of the group probably died (see its log) or stopped making the same attention calls; "
            "a rank that is merely slow fails this way after the timeout given to init_sequence_parallel."
        ) from e


def _all_to_all_rows(buf: torch.Tensor, group) -> torch.Tensor:
    """Row j of ``buf`` ([P, n]) goes to rank j; row i of the result came from rank i."""
    recv = torch.empty_like(buf)
    with _failing_clearly("all_to_all", group):
        dist.all_to_all_single(recv, buf, group=group)
    moved = (buf.shape[0] - 1) * buf[0].numel() * buf.element_size()
    _record("all_to_all", moved, moved)
    return recv


_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather_raw(x: torch.Tensor, group, dim: int, op: str = "all_gather") -> torch.Tensor:
    p = group_size(group)
    out = x.new_empty((p,) + tuple(x.shape))
    with _failing_clearly(op, group):
        _all_gather_flat(out.view(-1), x.contiguous().view(-1), group=group)
    _record(op, (p - 1) * _nbytes(x), (p - 1) * _nbytes(x))
    return out.movedim(0, dim).flatten(dim, dim + 1)


def _reduce_scatter_raw(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    p = group_size(group)
    chunks = x.unflatten(dim, (p, -1)).movedim(dim, 0).contiguous()
    out = x.new_empty(chunks.shape[1:])
    with _failing_clearly("reduce_scatter", group):
        _reduce_scatter_flat(out.view(-1), chunks.view(-1), group=group)
    moved = (p - 1) * _nbytes(out)
    _record("reduce_scatter", moved, moved)
    return out


def _natural_order(table: list[list[int]]) -> list[tuple[int, int]]:
    """For each chunk the group holds, in increasing chunk id: which rank holds it and at which local slot."""
    where = {n: (r, i) for r, chunks in enumerate(table) for i, n in enumerate(chunks)}
    return [where[n] for n in sorted(where)]


def _fused_all_to_all_start(views, group, pack):
    """Post one all-to-all for several tensors. Each owns a ``[P, numel/P]`` column slice
    of the send and receive buffers, which ``pack(view, rows)`` fills (row j goes to rank j).
    Returns ``wait() -> [received slice per tensor]`` (row i came from rank i); the send
    buffer is freed at the wait, before the caller's unpack copies allocate."""
    p = group_size(group)
    bounds = [0]
    for t in views:
        bounds.append(bounds[-1] + t.numel() // p)
    buf = views[0].new_empty(p, bounds[-1])
    for t, start, end in zip(views, bounds, bounds[1:]):
        pack(t, buf[:, start:end])
    recv = torch.empty_like(buf)
    with _failing_clearly("all_to_all", group):
        work = dist.all_to_all_single(recv, buf, group=group, async_op=True)
    moved = (p - 1) * bounds[-1] * buf.element_size()
    _record("all_to_all", moved, moved)

    def wait():  # idempotent, so drain() may call it again
        nonlocal buf, work
        if work is not None:
            with _failing_clearly("all_to_all", group):
                work.wait()
            buf = work = None
        return [recv[:, start:end] for start, end in zip(bounds, bounds[1:])]

    return wait


def _pack_to_heads(t_bsphd, rows):
    """A ``[B, s, P, h, D]`` view of sequence-shard heads (head slot j goes to rank j) into its rows."""
    b, s, p, h, d = t_bsphd.shape
    rows.view(p, b, s, h, d).copy_(t_bsphd.permute(2, 0, 1, 3, 4))


def _unpack_heads(rows, shape_bsphd, order):
    """Received rows -> ``[B, S, h, D]`` head shard, the chunks (``order``: source rank and
    slot of each chunk in increasing id) in global order: one block copy per chunk, 10x
    faster on CPU than one advanced-index copy."""
    b, s, p, h, d = shape_bsphd
    k = len(order) // p
    blocks = rows.view(p, b, k, s // k, h, d)
    out = rows.new_empty(b, p * k, s // k, h, d)
    for n, (src, slot) in enumerate(order):
        out[:, n].copy_(blocks[src, :, slot])
    return out.view(b, s * p, h, d)


def _pack_to_seq(t_bshd, rows, table):
    """A ``[B, S, h, D]`` head shard (chunks in increasing id) into rows: rank r's row gets
    its chunks ``table[r]``, wire block ``[k, B, c, h, D]``."""
    p, k = len(table), len(table[0])
    b, s_full, h, d = t_bshd.shape
    c = s_full // (k * p)
    position = {n: i for i, n in enumerate(sorted(n for chunks in table for n in chunks))}
    chunks, blocks = t_bshd.unflatten(1, (k * p, c)), rows.view(p, k, b, c, h, d)
    for dest, mine in enumerate(table):
        for i, chunk in enumerate(mine):
            blocks[dest, i].copy_(chunks[:, position[chunk]])


def _unpack_seq(rows, dest_bsphd, k: int):
    """Received rows (wire blocks ``[k, B, c, h, D]``) into ``dest_bsphd``, a ``[B, s, P, h, D]``
    view of sequence-shard heads."""
    b, s, p, h, d = dest_bsphd.shape
    dest_bsphd.unflatten(1, (k, s // k)).copy_(rows.view(p, k, b, s // k, h, d).permute(2, 1, 3, 0, 4, 5))


def seq_to_heads_start(views_bsphd, group, table):
    """Post `seq_to_heads` of ``[B, s, P, h, D]`` views (head slot j goes to rank j: a
    pipeline stage sends a head group); returns ``wait() -> [B, S, h, D]`` head shards.
    Not differentiable: for backends' own autograd Functions."""
    order = _natural_order(table)
    wait = _fused_all_to_all_start(views_bsphd, group, _pack_to_heads)
    return lambda: [_unpack_heads(r, v.shape, order) for v, r in zip(views_bsphd, wait())]


def heads_to_seq_start(tensors_bshd, group, table, dests_bsphd=None):
    """Post `heads_to_seq` of ``[B, S, h, D]`` head shards; ``wait()`` writes each result
    into its ``[B, s, P, h, D]`` view of ``dests_bsphd`` (None: new ``[B, s, P*h, D]`` tensors,
    allocated once the send buffer is freed) and returns them. Not differentiable."""
    p, k = group_size(group), len(table[0])
    wait = _fused_all_to_all_start(tensors_bshd, group, lambda t, rows: _pack_to_seq(t, rows, table))
    shapes = [(t.shape, t.dtype, t.device) for t in tensors_bshd]  # not the tensors: they are freed once packed

    def finish() -> list:
        received = wait()
        dests = dests_bsphd or [heads_view(torch.empty(s[0], s[1] // p, p * s[2], s[3], dtype=dtype, device=device), p)
                                for s, dtype, device in shapes]
        for dest, rows in zip(dests, received):
            _unpack_seq(rows, dest, k)
        return dests

    return finish


def heads_view(t_bshd, p: int, groups: int = 1, g: int = 0):
    """``[B, s, P, h, D]`` view of head group ``g`` of ``groups`` of a sequence shard: what
    each of P ranks gets of it (rank j's heads are ``[j*H/P, (j+1)*H/P)``, split in groups)."""
    return t_bshd.unflatten(2, (p, groups, -1))[:, :, :, g]


def _seq_to_heads_raw(tensors, group, table):
    """[B, S/P, H, D] sequence shards -> [B, S, H/P, D] head shards, the group's
    chunks in increasing id. Wire block for one destination: [B, S/P, H/P, D]."""
    return seq_to_heads_start([heads_view(t, group_size(group)) for t in tensors], group, table)()


def _heads_to_seq_raw(tensors, group, table):
    """[B, S, H/P, D] head shards (chunks in increasing id) -> [B, S/P, H, D] sequence shards.
    Wire block for one destination: [k, B, c, H/P, D] (its k chunks of c tokens)."""
    return [d.flatten(2, 3) for d in heads_to_seq_start(tensors, group, table)()]


# --------------------------------------------------------------------------- autograd wrappers

def _grads_for(ctx, first_tensor_arg: int, grads, fn):
    """Run ``fn`` on the gradients of the tensor inputs that need one; None for the rest."""
    needed = [i for i, need in enumerate(ctx.needs_input_grad[first_tensor_arg:]) if need]
    done = dict(zip(needed, fn([grads[i] for i in needed]))) if needed else {}
    return tuple(done.get(i) for i in range(len(grads)))


class _SeqHeadsAllToAll(torch.autograd.Function):
    """``to_heads=True``: sequence shards -> head shards; False: back. Each is the other's backward."""

    @staticmethod
    def forward(ctx, to_heads, group, table, *tensors):
        ctx.to_heads, ctx.group, ctx.table = to_heads, group, table
        outs = tuple((_seq_to_heads_raw if to_heads else _heads_to_seq_raw)(tensors, group, table))
        # An output of a frozen input stays frozen, so nothing downstream computes or sends its gradient.
        ctx.mark_non_differentiable(*(o for o, need in zip(outs, ctx.needs_input_grad[3:]) if not need))
        return outs

    @staticmethod
    def backward(ctx, *grads):
        inverse = _heads_to_seq_raw if ctx.to_heads else _seq_to_heads_raw
        return (None, None, None) + _grads_for(ctx, 3, grads, lambda gs: inverse(gs, ctx.group, ctx.table))


def _check_fusable(tensors, p: int, dim: int, what: str) -> None:
    for t in tensors:
        if t.dim() != 4 or t.shape[dim] % p:
            raise ValueError(f"seq/head all-to-all needs [B, S, H, D] tensors with {what} divisible by {p}, got {tuple(t.shape)}")
    if len({t.dtype for t in tensors}) > 1:
        raise ValueError(f"fused all-to-all needs one dtype, got {[t.dtype for t in tensors]}")


def seq_to_heads(tensors, group, table) -> list[torch.Tensor]:
    """Sequence-sharded ``[B, S/P, H, D]`` tensors to head-sharded ``[B, S, H/P, D]``.

    One fused all-to-all for all tensors. ``table[r]`` lists the global chunk
    ids group rank r holds (the layout's chunk table, or the rows of it that
    belong to a sub-group); the result holds those chunks in increasing id,
    i.e. global token order. Rank j receives heads ``[j*H/P, (j+1)*H/P)``.
    Differentiable.
    """
    p = group_size(group)
    if p == 1:
        return list(tensors)
    _check_fusable(tensors, p, 2, "H")
    return list(_SeqHeadsAllToAll.apply(True, group, table, *tensors))


def heads_to_seq(tensors, group, table) -> list[torch.Tensor]:
    """Inverse of `seq_to_heads`. Differentiable."""
    p = group_size(group)
    if p == 1:
        return list(tensors)
    _check_fusable(tensors, p, 1, "S")
    return list(_SeqHeadsAllToAll.apply(False, group, table, *tensors))


def kv_heads_sent(kv_heads: int, degree: int) -> int:
    """KV heads a head-scatter all-to-all moves: ``kv_heads`` if ``degree`` divides it,
    else ``degree`` (each KV head replicated ``degree / kv_heads`` times)."""
    return kv_heads if kv_heads % degree == 0 else degree


def head_scatter_bytes(spec, degree: int) -> int:
    """Bytes one rank sends in the forward all-to-alls of q, k, v and out when heads are
    scattered over ``degree`` ranks: head_bytes * (2*Hq + 2*Hkv') * (degree-1)/degree."""
    return spec.head_bytes * (2 * spec.q_heads + 2 * kv_heads_sent(spec.kv_heads, degree)) * (degree - 1) // degree


def head_scatter_problem(q_heads: int, kv_heads: int, degree: int) -> str | None:
    """Why heads cannot be scattered over ``degree`` ranks, or None."""
    if q_heads % degree:
        return f"q heads ({q_heads}) must divide by the all-to-all degree ({degree})"
    if kv_heads % degree and degree % kv_heads:
        return f"kv heads ({kv_heads}) and the all-to-all degree ({degree}) must divide one another (scatter or replicate KV heads)"
    return None


def replicate_kv_for_scatter(k: torch.Tensor, v: torch.Tensor, degree: int):
    """Repeat each KV head so that ``degree`` ranks can each get the one their q heads
    use (rank j gets KV head ``j * kv_heads // degree``); autograd sums the replicas."""
    kv_heads = k.shape[2]
    if kv_heads % degree == 0:
        return k, v
    return k.repeat_interleave(degree // kv_heads, dim=2), v.repeat_interleave(degree // kv_heads, dim=2)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, scatter_dim, gather_dim):
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        p = group_size(group)
        rows = x.unflatten(scatter_dim, (p, -1)).movedim(scatter_dim, 0).contiguous()
        recv = _all_to_all_rows(rows.view(p, -1), group).view(rows.shape)
        return recv.movedim(0, gather_dim).flatten(gather_dim, gather_dim + 1)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _AllToAll.apply(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split ``scatter_dim`` into P parts, send part j to rank j, concatenate what
    arrives along ``gather_dim`` in rank order. Differentiable."""
    p = group_size(group)
    scatter_dim, gather_dim = scatter_dim % x.dim(), gather_dim % x.dim()
    if x.shape[scatter_dim] % p:
        raise ValueError(f"all_to_all: dim {scatter_dim} of size {x.shape[scatter_dim]} does not split into {p} parts")
    if p == 1:
        return x
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def _rows_to_raw(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv),) + tuple(x.shape[1:]))
    with _failing_clearly("all_to_all_rows", group):
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
    row = x.shape[1:].numel() * x.element_size()
    me = dist.get_rank(group)
    _record("all_to_all_rows", (sum(send) - send[me]) * row, (sum(recv) - recv[me]) * row)
    return out


class _RowsTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send, recv, group):
        ctx.counts, ctx.group = (send, recv), group
        return _rows_to_raw(x, send, recv, group)

    @staticmethod
    def backward(ctx, grad):
        send, recv = ctx.counts
        return _rows_to_raw(grad, recv, send, ctx.group), None, None, None


def rows_to_ranks(x: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    """Uneven all-to-all of rows: ``x``'s first ``send[0]`` rows go to rank 0, the next ``send[1]``
    to rank 1, ...; the result holds ``recv[i]`` rows from each rank ``i`` in rank order (every
    rank's ``send`` to this one). Differentiable: the backward sends each row's gradient back."""
    if len(recv) != len(send) or sum(send) != x.shape[0] or (len(send) > 1 and len(send) != group_size(group)):
        raise ValueError(f"rows_to_ranks: {x.shape[0]} rows cannot be sent as {send}, receiving {recv}")
    return x if len(send) == 1 else _RowsTo.apply(x, list(send), list(recv), group)


class _GatherScatter(torch.autograd.Function):
    """``gather=True``: all-gather along ``dim``; False: reduce-scatter. Each is the other's backward."""

    @staticmethod
    def forward(ctx, x, gather, group, dim):
        ctx.gather, ctx.group, ctx.dim = gather, group, dim
        return (_all_gather_raw if gather else _reduce_scatter_raw)(x, group, dim)

    @staticmethod
    def backward(ctx, grad):
        inverse = _reduce_scatter_raw if ctx.gather else _all_gather_raw
        return inverse(grad, ctx.group, ctx.dim), None, None, None


def all_gather(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order.

    Differentiable; the backward is a reduce-scatter (sum), i.e. the gradient
    of the sum of every rank's loss.
    """
    if group_size(group) == 1:
        return x
    return _GatherScatter.apply(x, True, group, dim % x.dim())


def reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's 1/P slice of ``dim``. Differentiable."""
    p = group_size(group)
    dim = dim % x.dim()
    if x.shape[dim] % p:
        raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} does not split into {p} parts")
    if p == 1:
        return x
    return _GatherScatter.apply(x, False, group, dim)


def all_reduce_sum(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of every rank's ``x`` (a new tensor; not differentiable). Counted as op
    ``"all_reduce"`` with the logical volume: this rank's value reaches P-1 others."""
    return all_reduce_sums([x], group)[0]


def all_reduce_sums(tensors, group) -> list[torch.Tensor]:
    """``[all_reduce_sum(t, group) for t in tensors]`` in one all-reduce per dtype and device, of
    the tensors laid end to end: on small tensors (a model's gradients) a collective costs its
    thread hand-offs and round trips, not its bytes. Counted as one ``"all_reduce"`` each."""
    out, by_kind, p = [None] * len(tensors), {}, group_size(group)
    for i, t in enumerate(tensors):
        by_kind.setdefault((t.dtype, t.device), []).append(i)
    for idx in by_kind.values():
        flat = torch.cat([tensors[i].reshape(-1) for i in idx])
        with _failing_clearly("all_reduce", group):
            dist.all_reduce(flat, group=group)
        _record("all_reduce", (p - 1) * _nbytes(flat), (p - 1) * _nbytes(flat))
        for i, piece in zip(idx, flat.split([tensors[i].numel() for i in idx])):
            out[i] = piece.view(tensors[i].shape)
    return out


def all_gather_ints(values, group, device) -> list[tuple[int, ...]]:
    """Every rank's tuple of ints, in rank order (for cheap cross-rank agreement checks).
    Counted as op ``"handshake"``."""
    local = torch.tensor(values, dtype=torch.int64, device=device)
    rows = _all_gather_raw(local, group, 0, op="handshake")
    return [tuple(r) for r in rows.view(group_size(group), -1).tolist()]


def broadcast_object(obj, src: int, group):
    """Global rank ``src``'s picklable ``obj`` on every rank of ``group`` (a decision one rank made
    from the file system, e.g. which checkpoint to resume). Not counted: not attention traffic."""
    holder = [obj]
    with _failing_clearly("broadcast_object", group):
        dist.broadcast_object_list(holder, src=src, group=group)
    return holder[0]


def all_gather_start(x: torch.Tensor, group, dim: int):
    """Post an all-gather of ``x`` along ``dim`` (rank order); returns ``wait() -> tensor``.
    Not differentiable: for backends that prefetch inside their own autograd Function."""
    p = group_size(group)
    out = x.new_empty((p,) + tuple(x.shape))
    with _failing_clearly("all_gather", group):
        work = _all_gather_flat(out.view(-1), x.contiguous().view(-1), group=group, async_op=True)
    _record("all_gather", (p - 1) * _nbytes(x), (p - 1) * _nbytes(x))

    def wait() -> torch.Tensor:  # idempotent, so drain() may call it again
        with _failing_clearly("all_gather", group):
            work.wait()
        return out.movedim(0, dim).flatten(dim, dim + 1)

    return wait


def reduce_scatter_sum(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """Not-differentiable reduce-scatter (sum) along ``dim``, for backends' own backward passes."""
    return _reduce_scatter_raw(x, group, dim)


def ring_send_recv(tensors, group, *, send_to: int, recv_from: int, tag: int = 0):
    """Post sends of ``tensors`` to group rank ``send_to`` and receives of same-shaped
    buffers from ``recv_from`` in one ``batch_isend_irecv``.

    Returns ``(received, wait)``: call ``wait()`` before reading ``received``.
    Exchanges in flight at the same time between the same ranks need distinct
    ``tag``s (gloo matches by tag).
    Not differentiable: ring backends call it inside their own autograd Function.
    """
    return exchange([(send_to, t) for t in tensors], [(recv_from, t) for t in tensors], group, tag=tag)


def exchange(sends, recvs, group, *, tag: int = 0):
    """Post point-to-point sends ``[(to, tensor), ...]`` and receives ``[(from, like), ...]``
    (group ranks; a receive buffer gets ``like``'s shape and dtype) in one ``batch_isend_irecv``.

    Returns ``(received, wait)`` as `ring_send_recv`; empty tensors are not sent.
    Not differentiable: backends call it inside their own autograd Function.
    """
    received = [torch.empty(like.shape, dtype=like.dtype, device=like.device) for _, like in recvs]
    ops = [dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(group, to), group, tag) for to, t in sends if t.numel()]
    ops += [dist.P2POp(dist.irecv, buf, dist.get_global_rank(group, src), group, tag) for (src, _), buf in zip(recvs, received) if buf.numel()]
    works = []
    if ops:
        with _failing_clearly("send_recv", group):
            works = dist.batch_isend_irecv(ops)
    _record("send_recv", sum(_nbytes(t) for _, t in sends), sum(_nbytes(b) for b in received))

    def wait() -> None:  # idempotent, so drain() may call it again
        with _failing_clearly("send_recv", group):
            while works:
                works.pop().wait()

    return received, wait


def drain(waits) -> None:
    """Wait for exchanges posted but not yet waited for, before an exception propagates, so
    that none is still in flight when the caller's next collective starts (yunchang's ring
    hangs there). Their own failures are dropped: the error being raised is the one to report."""
    for wait in waits:
        try:
            wait()
        except Exception:
            pass
