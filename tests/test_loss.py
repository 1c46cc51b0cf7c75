"""The fused LM head + loss (ulysses_sp/loss.py) equals sp_cross_entropy of the full logits.

Cases in tests/loss_cases.py. Tolerances, relative to the largest reference value: fp32
1e-5 on the loss and every gradient (observed about 3e-7), fp64 1e-12; bf16: the tiled
loss is no further from the fp32 computation of the same bf16 inputs than 2e-2, and no
more than 2x (+ one bf16 ulp) further than the untiled bf16 loss is.
"""

import pytest
import torch

from .conftest import values

TOL = 1e-5
GRADS = ("dhidden", "dweight", "dbias")


def _check(result: dict, tol: float = TOL) -> None:
    for chunk, r in result.items():
        if chunk in ("ref_loss", "dtype"):
            continue
        for key, err in r.items():
            if key != "dtype":
                assert err < tol, f"chunk_tokens={chunk}: {key} off by {err:.3g} ({r})"


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.quick(world=2)
def test_tiles_equal_full_logits(ranks, world):
    """Tiles of 1, 3, 5, 7 (not dividing 26 tokens), 26, 100 and the default; bias and none;
    ignored tokens (whole tiles without a target); a rank, and a group, without any target."""
    for rank, r in enumerate(values(ranks(world), "loss/tiles")):
        _check(r["bias"])
        assert set(r["bias"]) >= {1, 3, 5, 7, 26, 100, None}
        _check(r["no bias"])
        _check(r["fp64"], 1e-12)
        assert r["fp64"]["dtype"] == "torch.float64"
        _check(r["1-d tokens"])
        _check(r["rank without targets"])
        if world == 2:  # the other rank holds the targets
            assert r["rank without targets"]["ref_loss"] > 0
        _check(r["no targets anywhere"])
        assert r["no targets anywhere"]["ref_loss"] == 0
        if world == 2:
            _check(r["count_group world"])


def test_bf16_within_bf16_tolerance(ranks):
    (r,) = values(ranks(1), "loss/bf16")
    tiled, untiled = r["tiled"], r["untiled"]
    assert tiled["dtype"] == "torch.float32"
    assert tiled["grad dtypes"] == ["torch.bfloat16"] * 3
    for key in ("loss", *GRADS):
        assert tiled[key] < 2e-2, r
        assert tiled[key] <= 2 * untiled[key] + 2**-8, r


@pytest.mark.parametrize("world", [1, 2])
def test_tied_weight_gradients_add_up(ranks, world):
    for r in values(ranks(world), "loss/tied"):
        assert max(r.values()) < TOL, r


def test_errors_name_the_constraint(ranks):
    (r,) = values(ranks(1), "loss/errors")
    expected = {
        "hidden width": "hidden_local must be [..., 16]",
        "weight 1-d": "weight must be [vocab, hidden]",
        "labels length": "one label per token",
        "labels float": "integer class indices",
        "label out of range": "outside [0, 50)",
        "bias shape": "bias must be [vocab=50]",
        "dtype mismatch": "same dtype",
        "chunk 0": "chunk_tokens must be a positive int",
        "chunk -3": "chunk_tokens must be a positive int",
        "chunk 2.5": "chunk_tokens must be a positive int",
        "softcap model": "final_logit_softcapping",
    }
    if r["softcap model"] is None:
        del expected["softcap model"]  # transformers is not installed: not checked (tests/test_transformers.py says so)
    for name, text in expected.items():
        assert r[name].startswith("ValueError") and text in r[name], (name, r[name])


def test_default_tile_is_256_mib():
    from ulysses_sp.loss import default_chunk_tokens

    for vocab in (64, 32000, 128256, 262144, 2**27):
        chunk = default_chunk_tokens(vocab)
        assert chunk >= 1 and (chunk == 1 or chunk * vocab * 4 <= 256 * 2**20)
        assert (chunk + 1) * vocab * 4 > 256 * 2**20
    assert default_chunk_tokens(128 * 1024) == 512


@pytest.mark.quick
def test_validation_before_any_collective():
    """Shape errors raise without a process group (so before the count's all-reduce)."""
    from ulysses_sp.loss import sp_linear_cross_entropy

    with pytest.raises(ValueError, match="chunk_tokens"):
        sp_linear_cross_entropy(torch.zeros(2, 4), torch.zeros(8, 4), torch.zeros(2, dtype=torch.long), None, chunk_tokens=0)


def _hf_names():
    from .loss_cases import HF_LOSS

    return list(HF_LOSS)


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", _hf_names())
def test_causal_lm_loss_matches_logits_loss(ranks, world, name):
    pytest.importorskip("transformers")
    for r in values(ranks(world), f"loss/hf/{name}"):
        assert r["loss"] < TOL and r["grad_rel"] < TOL, f"worst parameter {r['worst_param']}: {r}"
        assert r["tied"] == ("tied" in name), r
        assert r["forward restored"], r


@pytest.mark.parametrize("name", ["zero2", "zero3", "zero3/tied"])
def test_deepspeed_step_matches_untiled(ranks, name):
    pytest.importorskip("deepspeed")
    for r in values(ranks(2), f"loss/deepspeed/{name}"):
        assert r["loss"] < TOL and r["grad_rel"] < TOL and r["param_rel"] < TOL, r
        assert r["moved"] > 1e-3, r  # the step changed the weights: the comparison is not vacuous
        assert r["grad_shapes_full"] and r["restored"], r
        assert r["partitioned"] == name.startswith("zero3"), r


def test_no_tensor_larger_than_a_tile(ranks):
    """400 tokens, vocab 1000, hidden 8, tiles of 16: nothing beyond one tile of logits (16 x 1000)
    is ever made, while the untiled loss makes the full 400 x 1000 logits."""
    (r,) = values(ranks(1), "loss/memory")
    assert r["tiled"] <= 16 * 1000 < r["untiled"] == 400 * 1000, r
