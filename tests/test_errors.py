"""Bad input to the attention interface: a clear error on every rank, no hang."""

import pytest

from .conftest import WORLDS, values

EXPECTED = {
    "q 3-D": "ValueError: q must be [batch, local_seq, heads, head_dim] (4-D)",
    "q not a tensor": "TypeError: q must be a torch.Tensor",
    "integer input": "TypeError: q must be a floating-point tensor",
    "dtype mismatch": "TypeError: q, k, v must share one dtype",
    "device mismatch": "ValueError: q, k, v must be on this rank's cpu device",
    "k and v differ": "ValueError: k and v must have the same shape",
    "sequence mismatch": "ValueError: q and k/v must agree in batch and local sequence length",
    "batch mismatch": "ValueError: q and k/v must agree in batch and local sequence length",
    "head dim mismatch": "ValueError: q and k/v must have the same head dim",
    "kv heads not dividing q heads": "ValueError: q heads (4) must be a multiple of kv heads (3)",
    "zero batch": "ValueError: q must have non-zero batch",
    "zigzag odd local length": "pad_to_multiple",
    "bad softmax_scale": "ValueError: softmax_scale must be a positive finite number",
    "cu_seqlens not ending at length": "ValueError: cu_seqlens must be the cumulative document lengths",
    "cu_seqlens not increasing": "ValueError: cu_seqlens must be the cumulative document lengths",
    "unknown backend (module)": "ValueError: unknown SP backend 'ringg'; known: auto, ulysses, allgather, ring, hybrid",
    "unknown backend (functional)": "ValueError: unknown SP backend 'ringg'; known: auto, ulysses, allgather, ring, hybrid",
    "shard length not divisible": "pad_to_multiple",
    "ulysses q heads not divisible": "ValueError: ulysses: q heads",
    "ulysses kv heads incompatible": "ValueError: ulysses: kv heads",
    "allgather heads_k_stride above kv heads": "ValueError: allgather_stride3: heads_k_stride (3) exceeds the kv heads (2)",
    "shard length differs per rank": "ValueError: the ranks of the SP group called attention with different local_seq_len",
    "cu_seqlens differ per rank": "ValueError: the ranks of the SP group called attention with different cu_seqlens",
    "requires_grad differs per rank": "ValueError: the ranks of the SP group called attention with different requires_grad",
    "dtype differs per rank": "ValueError: the ranks of the SP group called attention with different dtype",
    "seen shape differs per rank (always)": "ValueError: the ranks of the SP group called attention with different local_seq_len",
    "window not positive": "ValueError: window must be an int >= 1 with causal=True",
    "window without causal": "ValueError: window must be an int >= 1 with causal=True (query i sees keys i - window < j <= i), got window=4 with causal=False",
    "negative softcap": "ValueError: softcap must be a finite float >= 0",
    "halo without a window": "ValueError: halo: only for sliding-window layers (window=W)",
    "blocks overlapping": "ValueError: blocks must be (start, end) integer pairs, 0 <= start < end <= the global length",
    "blocks past the end": "ValueError: blocks must be (start, end) integer pairs, 0 <= start < end <= the global length",
    "blocks without causal": "ValueError: blocks overlay a causal mask (causal=True)",
    "blocks crossing a document": "ValueError: blocks [(1, 3)] cross a document boundary of cu_seqlens [0, 2, ",
    "blocks differ per rank": "ValueError: the ranks of the SP group called attention with different cu_seqlens/backend/scale/kernel/window/softcap/sinks/blocks",
}
MULTI_ONLY = {k for k in EXPECTED if "per rank" in k or k.startswith(("ulysses ", "allgather "))}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.quick(world=2)
def test_bad_input_raises_on_every_rank(ranks, world):
    for rank, got in enumerate(values(ranks(world), "errors/attention")):
        assert got.pop("still works") == (2, 4, 12, 8), "the group must stay usable after the errors"
        assert set(got) == set(EXPECTED) - (MULTI_ONLY if world == 1 else set())
        for case, message in got.items():
            assert EXPECTED[case] in message, f"rank {rank}, {case}: {message}"


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
def test_a_failure_mid_exchange_leaves_nothing_in_flight(ranks, world):
    for r in values(ranks(world), "errors/raise-mid-exchange"):
        assert len(r) == (8 if world == 2 else 6)
        for where, (message, error_after) in r.items():
            assert message == "RuntimeError: injected kernel failure", where
            assert error_after < 1e-10, f"{where}: the next call is off by {error_after}"


@pytest.mark.parametrize("world", WORLDS)
def test_non_finite_input_gives_nan_on_every_rank(ranks, world):
    for rank, r in enumerate(values(ranks(world), "errors/non-finite")):
        assert len(r) == 8
        for where, got in r.items():
            assert got["nan masks as expected"] == [True] * 4, f"rank {rank}, {where}: NaN where one process has none, or none where it has: {got}"
            if where.endswith("inf in q"):  # some of out is NaN, not all: an output NaN everywhere fails the mask
                assert 0 < got["reference nan count"][0] < 1 * 48 * 12 * 8, got
            if where.endswith("nan in k"):  # every query sees key 0: all of out and every gradient is NaN
                assert got["local out has nan"] and all(got["grads have nan"]), f"rank {rank}, {where}: {got}"


def test_a_second_backward_through_head_groups_raises(ranks):
    for r in values(ranks(2), "errors/head-groups-backward-twice"):
        assert r["second"] and "retain_graph" in r["second"], r
