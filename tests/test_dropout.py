"""Dropout per SP rank: masks differ across the group where they used to repeat, at the rate p;
nothing changes without dropout; recomputation redraws the forward's masks; layer drop keeps the
group in step. Cases in tests/dropout_cases.py."""

import math

import pytest

from .conftest import values

hf = pytest.mark.skipif(not __import__("importlib").util.find_spec("transformers"), reason="the hf extra (transformers) is not installed")


@hf
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.quick(world=2)
def test_masks_differ_across_the_group_at_the_rate_p(ranks, world):
    for r in values(ranks(world), "dropout/masks"):
        masks = r["masks"]
        assert all(m == masks["shared"][0] for m in masks["shared"]), "control: without the rank's stream the masks repeat"
        for name in ("mine", "functional"):
            assert len({tuple(m) for m in masks[name]}) == world, f"{name}: two ranks drew the same mask"
        for name, n in zip(("mine", "functional"), r["sizes"]):  # kept share 1 - p = 0.5 within 5 standard deviations
            assert abs(r["kept"][name] - 0.5) < 5 * math.sqrt(0.25 / n), (name, r["kept"])


@hf
def test_no_dropout_changes_nothing_bit_for_bit(ranks):
    for r in values(ranks(2), "dropout/zero"):
        assert r == {"p=0": True, "eval": True}, r


@hf
def test_checkpointing_recomputes_the_forwards_masks(ranks):
    for r in values(ranks(2), "dropout/recompute"):
        assert r["dropout changes the loss"] > 1e-3, r
        for name in ("layers", "offload", "transformers"):
            assert r[name] < 1e-12, (name, r)


@hf
@pytest.mark.parametrize("world", [2, 3])
def test_layer_drop_keeps_the_group_in_step(ranks, world):
    for r in values(ranks(world), "dropout/layerdrop"):
        first = r["ran"][0]
        assert all(ran == first for ran in r["ran"]), r
        assert 0 < sum(i >= 0 for i in first) < 12, first  # some layers dropped, some ran, over three steps of four layers
