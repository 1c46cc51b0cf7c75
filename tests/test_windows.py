"""Sliding windows across SP: the exact bytes each backend moves for a windowed layer.

Parity of every backend with windows (P = 1..4, both layouts, packed or not, soft-capped)
is in tests/test_parity.py (cases ``parity/*window*``). Here the expected bytes are counted
token by token from the layout, independently of the backends' own range arithmetic:

- halo: rank r receives every token j it does not hold that one of its queries i sees
  (i - W < j < i); forward K/V of those tokens, backward their dK/dV (fp32) to the owner.
- ring: K/V hops up to the farthest rank distance at which a query sees a key; the
  backward passes K/V as far and the dK/dV accumulators one hop more (back to the owner).
- hybrid (U = 2 on even P): the all-to-alls of q, k, v and out, and the ring's hops
  between the Ulysses groups, counted as for the ring.
- allgather: each chunk's last W - 1 tokens (every token when W exceeds a chunk).
"""

import pytest

from ulysses_sp import layout

from .cases import BLOCKS, BYTES_SHAPE, HALO_WINDOWS
from .conftest import WORLDS, values

B, N, D = BYTES_SHAPE
HKV, ELT = 4, 4  # float32
TOKEN = 2 * B * HKV * D * ELT  # K and V of one token


def _owned(lay, p):
    return [set(layout.positions(lay, N, p, r, (0, N)).tolist()) for r in range(p)]


def expected(backend, lay, p, w, blocks=()):
    def _sees(i, j, w):  # bidirectional blocks: a block's query also sees its later keys
        return i - w < j <= i or any(a <= i < j < b for a, b in blocks)

    owned = _owned(lay, p)
    if backend == "halo":
        needed = [{j for i in mine for j in range(N) if j not in mine and _sees(i, j, w)} for mine in owned]
        recv = [len(n) for n in needed]
        sent = [sum(len(needed[r] & owned[s]) for r in range(p) if r != s) for s in range(p)]
        return [((sent[r] * TOKEN, recv[r] * TOKEN), (recv[r] * TOKEN, sent[r] * TOKEN)) for r in range(p)]
    if backend in ("ring", "hybrid"):  # the hybrid: U = 2 where P is even (all-to-all inside), a ring of P / U groups
        u = 2 if backend == "hybrid" and p % 2 == 0 else 1
        groups = [set().union(*owned[g * u : (g + 1) * u]) for g in range(p // u)]
        r_ = len(groups)
        hops = max((d for d in range(1, r_) for r in range(r_) for i in groups[r] for j in groups[(r - d) % r_] if _sees(i, j, w)), default=0)
        fwd = hops * TOKEN * N // p  # U ranks' tokens, KV heads / U
        bwd = fwd + (hops + 1) * TOKEN * N // p if hops else 0
        a2a = B * N // p * D * ELT * (2 * 12 + 2 * HKV) * (u - 1) // u
        return [((fwd + a2a, fwd + a2a), (bwd + a2a, bwd + a2a))] * p
    chunk = N // (layout.chunks_per_rank(lay, N, p) * p)
    tail = chunk if w > chunk or blocks else w - 1
    fwd = TOKEN * tail * layout.chunks_per_rank(lay, N, p) * (p - 1)
    return [((fwd, fwd), (2 * fwd, 2 * fwd))] * p


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("window", HALO_WINDOWS)
@pytest.mark.parametrize("lay", layout.LAYOUTS)
@pytest.mark.quick(world=2, window=13)
def test_windowed_bytes_are_exact(ranks, world, lay, window):
    for rank, r in enumerate(values(ranks(world), f"bytes/windowed/{lay}-{window}")):
        for backend, got in r.items():
            fwd, bwd = expected(backend, lay, world, window)[rank]
            assert got["fwd"] == fwd, (backend, rank, got)
            assert got["bwd"] == bwd, (backend, rank, got)
            assert got["estimate"] == (fwd[0], bwd[0]), f"{backend}: estimate() must predict the bytes"


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("window", [5, 13])
@pytest.mark.parametrize("lay", layout.LAYOUTS)
def test_windowed_bytes_with_bidirectional_blocks_are_exact(ranks, world, lay, window):
    """Blocks across chunks and ranks: halo also receives each block's keys past a chunk, the ring runs
    as many hops as a block reaches, the all-gather gathers every token (its tails are off)."""
    for rank, r in enumerate(values(ranks(world), f"bytes/windowed/{lay}-{window}-blocks")):
        for backend, got in r.items():
            fwd, bwd = expected(backend, lay, world, window, BLOCKS[""])[rank]
            assert (got["fwd"], got["bwd"]) == (fwd, bwd), (backend, rank, got)
            assert got["estimate"] == (fwd[0], bwd[0]), f"{backend}: estimate() must predict the bytes"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("lay", layout.LAYOUTS)
def test_halo_sends_what_the_window_needs_not_the_sequence(ranks, world, lay):
    """Per rank, the bytes halo sent (counted by the library) grow with W, stay within W - 1 tokens
    per chunk, at most what all-gather sent and below what ring sent, for a short window."""
    small, large = values(ranks(world), f"bytes/windowed/{lay}-5"), values(ranks(world), f"bytes/windowed/{lay}-13")
    assert sum(s["halo"]["fwd"][0] for s in small) > 0  # (contiguous: the last rank sends nothing)
    for s, l in zip(small, large):
        assert s["halo"]["fwd"][0] <= l["halo"]["fwd"][0]
        assert s["halo"]["fwd"][0] <= 4 * TOKEN * layout.chunks_per_rank(lay, N, world)
        assert s["halo"]["fwd"][0] <= s["allgather"]["fwd"][0] and s["halo"]["fwd"][0] < s["ring"]["fwd"][0]
