"""Communication: the collectives of comm.py and the exact bytes every backend moves.

Per rank, forward, with per = B * N/P * D * b (one head of the local shard):

- ulysses: all-to-all of q, k, v and out, per * (2*Hq + 2*Hkv') * (P-1)/P, where
  Hkv' = Hkv if P divides it, else P (each KV head replicated P/Hkv times).
- allgather: all-gather of k and v, 2 * per * Hkv * (P-1).
- ring: P-1 hops of k and v, 2 * per * Hkv * (P-1).
- hybrid (U x R): the ulysses volume over U plus the ring volume over R hops of
  the U-times-longer, U-times-fewer-headed K/V: 2 * per * Hkv' * (R-1).

Backward: ulysses sends dout (Hq) and the gradients of the inputs that need
one (Hq; 2*Hkv'), so with all trainable it equals the forward; over G > 1 head
groups it also sends q (Hq), and K/V (2*Hkv') when they split into the groups,
so that no group's head shards outlive it. allgather
re-gathers K/V and reduce-scatters dK, dV (per * Hkv * (P-1) each). ring passes
K/V again (P-1 hops) and the dK/dV accumulators P hops (they return to their
owner); accumulators are fp32, here the same width as the float32 inputs.
"""

import pytest

from ulysses_sp.backends.ulysses import head_groups_for

from .cases import BACKENDS, BYTES, BYTES_SHAPE
from .conftest import WORLDS, values

B, N, D = BYTES_SHAPE
ELT = 4  # float32
MULTI = [w for w in WORLDS if w > 1]


def expected_bytes(backend, world, hq, hkv, grads):
    """(forward, backward) bytes sent per rank, or None where the backend refuses the shape."""
    per = B * N // world * D * ELT
    need_q, need_kv = "q" in grads, "k" in grads

    def a2a(p, hkv_sent):
        fwd = per * (2 * hq + 2 * hkv_sent) * (p - 1) // p
        bwd = per * (hq + hq * need_q + 2 * hkv_sent * need_kv) * (p - 1) // p
        return fwd, bwd

    def ring(r, heads):
        fwd = 2 * per * heads * (r - 1)
        return fwd, fwd + (2 * per * heads * r if need_kv and r > 1 else 0)

    if backend.startswith("ulysses"):
        if hkv % world and world % hkv:
            return None
        hkv_sent = hkv if hkv % world == 0 else world
        fwd, bwd = a2a(world, hkv_sent)
        groups = head_groups_for(2, hq // world, hkv_sent // world) if backend == "ulysses-g2" else 1
        if groups > 1:  # the backward sends each group's q again, and its K/V heads when they split into the groups
            bwd += per * (hq + 2 * hkv_sent * ((hkv_sent // world) % groups == 0)) * (world - 1) // world
        return fwd, bwd
    if backend == "allgather":
        fwd = 2 * per * hkv * (world - 1)
        return fwd, fwd + 2 * per * hkv * (world - 1) * need_kv
    if backend == "ring":
        return ring(world, hkv)
    u = 2 if world % 2 == 0 else 1
    hkv_sent = hkv if hkv % u == 0 else u
    (a_fwd, a_bwd), (r_fwd, r_bwd) = a2a(u, hkv_sent), ring(world // u, hkv_sent)
    return a_fwd + r_fwd, a_bwd + r_bwd


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(BYTES))
@pytest.mark.parametrize("backend", (*BACKENDS, "ulysses-g2"))
@pytest.mark.quick(world=2, name="gqa")
def test_bytes_match_formula(ranks, world, name, backend):
    expected = expected_bytes(backend, world, *BYTES[name])
    for r in values(ranks(world), f"bytes/{backend}/{name}"):
        if expected is None:
            assert r is None, "check() should refuse this shape"
            continue
        fwd, bwd = expected
        assert r["fwd"][:2] == (fwd, fwd), f"forward sent/received, formula {fwd}"
        assert r["estimate"][0] == fwd, "estimate() must predict the forward bytes"
        if name in ("mha", "gqa", "mqa"):  # every input trainable
            assert r["estimate"][1] == bwd, "estimate() must predict the backward bytes"
        assert r["bwd"][:2] == (bwd, bwd), f"backward sent/received, formula {bwd}"
        if backend.startswith("ulysses") and world > 1:  # one fused all-to-all in, one out, per head group
            hq, hkv = BYTES[name][0] // world, max(1, BYTES[name][1] // world)
            groups = head_groups_for(2, hq, hkv) if backend == "ulysses-g2" else 1
            assert r["fwd"][2] == {"all_to_all": (fwd, fwd, 2 * groups)}


@pytest.mark.parametrize("world", WORLDS)
def test_all_to_all(ranks, world):
    for r in values(ranks(world), "comm/all_to_all"):
        assert r["err"] == 0 and r["grad_err"] == 0
        assert r["sent"] == r["expected_sent"]


@pytest.mark.parametrize("world", WORLDS)
def test_all_gather_and_reduce_scatter(ranks, world):
    for r in values(ranks(world), "comm/all_gather_reduce_scatter"):
        assert r["gather_err"] == 0 and r["scatter_err"] < 1e-12
        assert r["gather_grad_err"] < 1e-12
        assert r["ag_sent"] == r["ag_expected"]
        assert r["rs_sent"] == r["rs_expected"]
        # all-gather's backward is a reduce-scatter of the gathered gradient: the same bytes back
        assert r["bwd_rs_sent"] == r["ag_expected"]


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_sums_makes_one_collective_per_dtype(ranks, world):
    """Three tensors of two dtypes and shapes: each rank gets every sum, in its own shape and dtype,
    from two all-reduces whose bytes are the tensors' (fp32 sums of 2 to 4 terms: exact to rounding)."""
    for r in values(ranks(world), "comm/all_gather_reduce_scatter"):
        assert [(shape, dtype) for shape, dtype, _ in r["sums"]] == [(shape, dtype) for shape, dtype, _ in r["sums_expected"]], r["sums"]
        assert max(err for *_, err in r["sums"]) < 1e-6, r["sums"]
        assert r["sums_counted"] == (2, r["sums_bytes"]), r["sums_counted"]


@pytest.mark.parametrize("world", MULTI)
def test_rows_to_ranks(ranks, world):
    """The uneven all-to-all that sends each image's features to the ranks holding its tokens."""
    for r in values(ranks(world), "comm/rows_to_ranks"):
        assert r["err"] == 0 and r["grad_err"] == 0, r
        sent, recv = r["expected"]
        assert r["bytes"] == (sent, recv, recv, sent), r  # the backward sends each row's gradient back


@pytest.mark.parametrize("world", MULTI)
def test_ring_send_recv(ranks, world):
    for r in values(ranks(world), "comm/ring_send_recv"):
        assert r["err"] == 0
        assert r["sent"] == r["recv"] == r["expected"]


@pytest.mark.parametrize("world", WORLDS)
def test_seq_to_heads_is_exact_and_fused(ranks, world):
    for r in values(ranks(world), "comm/seq_heads_roundtrip"):
        for lay, got in r.items():
            assert got["heads_err"] == 0, lay
            assert got["back_err"] == 0, lay
            assert got["calls"] == 1, f"{lay}: three tensors should travel in one all-to-all"


@pytest.mark.parametrize("world", WORLDS)
def test_shard_and_gather_sequence(ranks, world):
    for r in values(ranks(world), "data/shard_gather"):
        for lay, got in r.items():
            assert got == {"shard_err": 0, "roundtrip_err": 0, "grad_err": 0, "dim0_err": 0}, lay


@pytest.mark.parametrize("world", WORLDS)
def test_sinks_move_no_bytes(ranks, world):
    """Learned sinks cost no transfer: every backend sends and receives what it does without them,
    forward and backward, and ``estimate()`` says so (ulysses slices the replicated sinks locally)."""
    for r in values(ranks(world), "bytes/sinks"):
        for backend, (plain, with_sinks) in r.items():
            assert with_sinks == plain, (backend, plain, with_sinks)
            if world > 1 and backend != "halo":  # halo at a window of 5 may send nothing where chunks are long
                assert plain[0] > 0, (backend, plain)
