"""The data side: shard_batch, the SP loss, the sampler, and a tiny model end to end."""

import pytest
import torch

import ulysses_sp as usp

from .cases import BACKENDS, TINY_BATCHES
from .conftest import WORLDS, values

TOL = 1e-12  # fp64; observed ~1e-16


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("kind", TINY_BATCHES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.quick(world=2)
def test_tiny_model_loss_and_gradients_match_one_process(ranks, world, backend, kind):
    results = values(ranks(world), f"model/{backend}/{kind}")
    for r in results:
        assert r["loss_err"] < TOL and r["grad_err"] < TOL, r
    assert len({r["loss"] for r in results}) == 1, "every rank of the SP group reports the same loss"
    if kind == "mostly-padding" and world == 4:
        assert min(r["valid_here"] for r in results) == 0, "a rank with padding only must be part of the test"


@pytest.mark.parametrize("world", WORLDS)
def test_shard_batch_round_trip_and_targets(ranks, world):
    for r in values(ranks(world), "data/shard_batch"):
        for (lay, kind), got in r.items():
            multiple = world * (1 if lay == "contiguous" else 2)
            assert got["ids_roundtrip"]
            assert got["padded_len"] == -(-45 // multiple) * multiple
            # labels shifted before sharding: no target lost at a shard boundary
            assert got["valid_targets_sp"] == got["valid_targets_one_process"], (lay, kind)
            if kind == "packed":
                docs = [0, 5, 14, 15, 32, 45]
                assert got["cu_seqlens"] == docs + ([got["padded_len"]] if got["padded_len"] > 45 else [])
                assert got["positions"][:45] == [p for a, b in zip(docs, docs[1:]) for p in range(b - a)]
            else:  # balanced: one document, which carries the placement
                assert got["cu_seqlens"] == ([0, got["padded_len"]] if lay == "balanced" else None), (lay, got["cu_seqlens"])
                assert got["positions"] == list(range(got["padded_len"]))


def test_sampler_sp_groups_share_and_dp_groups_split(ranks):
    per_rank = values(ranks(4), "data/sampler")
    for (sp, drop_last) in per_rank[0]:
        by_dp = {}
        for r in per_rank:
            got = r[(sp, drop_last)]
            by_dp.setdefault(got["dp_rank"], []).append(got["epochs"])
        for dp, draws in by_dp.items():
            assert all(d == draws[0] for d in draws), f"SP group {dp} ranks drew different samples"
        for epoch in (0, 1):
            groups = [draws[0][epoch] for draws in by_dp.values()]
            flat = [i for g in groups for i in g]
            assert len({len(g) for g in groups}) == 1, "every DP group gets as many samples"
            if drop_last:
                assert len(flat) == len(set(flat)) == 11 // len(groups) * len(groups)
            else:
                assert set(flat) == set(range(11)) and len(flat) == -(-11 // len(groups)) * len(groups)
        assert by_dp[0][0][0] != by_dp[0][0][1], "set_epoch reshuffles"


@pytest.mark.quick
def test_cu_seqlens_from_position_ids():
    pos = torch.tensor([[0, 1, 2, 0, 0, 1]])
    assert usp.cu_seqlens_from_position_ids(pos).tolist() == [0, 3, 4, 6]
    assert usp.cu_seqlens_from_position_ids(pos[0]).tolist() == [0, 3, 4, 6]
    with pytest.raises(ValueError, match="differ between the rows"):
        usp.cu_seqlens_from_position_ids(torch.tensor([[0, 1, 0], [0, 1, 2]]))
    with pytest.raises(ValueError, match="starting at 0"):
        usp.cu_seqlens_from_position_ids(torch.tensor([1, 2, 0]))


def test_left_padding_is_refused():
    from types import SimpleNamespace

    topo = SimpleNamespace(layout="zigzag", sp_size=2, sp_rank=0)
    batch = {"input_ids": torch.ones(1, 8, dtype=torch.long), "attention_mask": torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])}
    with pytest.raises(ValueError, match="pad on the right"):
        usp.shard_batch(batch, topo)
