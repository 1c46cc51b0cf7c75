"""Communication: the collectives of comm.py and the exact bytes Ulysses moves.

Ulysses forward (DESIGN.md): all-to-all of q, k, v and out,
B * N/P * (2*Hq + 2*Hkv') * D * (P-1)/P * b bytes sent per rank, Hkv' = Hkv if
P divides it, else P. Its backward moves dout (Hq), then dq (Hq) and dk, dv
(2*Hkv') for the inputs that need a gradient, so with every input trainable
it equals the forward.
"""

import pytest

from .cases import BYTES
from .conftest import WORLDS, values

B, N, D, ELT = 2, 32, 8, 4  # shape and float32 of the byte cases in tests/cases.py

MULTI = [w for w in WORLDS if w > 1]


def ulysses_formula(world, heads):
    return B * N // world * heads * D * (world - 1) // world * ELT


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", list(BYTES))
def test_ulysses_bytes_match_formula(ranks, world, name):
    hq, hkv, grads = BYTES[name]
    for r in values(ranks(world), f"bytes/{name}"):
        hkv_sent = r["hkv_sent"]
        assert hkv_sent == (hkv if hkv % world == 0 else world)
        fwd = ulysses_formula(world, 2 * hq + 2 * hkv_sent)
        bwd = ulysses_formula(world, hq + hq * ("q" in grads) + 2 * hkv_sent * ("k" in grads))
        sent, recv, by_op = r["fwd"]
        assert (sent, recv) == (fwd, fwd)
        assert r["estimate"] == fwd
        sent, recv, _ = r["bwd"]
        assert (sent, recv) == (bwd, bwd)
        if world > 1:  # one fused all-to-all in, one out: q, k, v never travel separately
            assert set(by_op) == {"all_to_all"} and by_op["all_to_all"][2] == 2


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
