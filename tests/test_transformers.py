"""Hugging Face models with SP give the one-process logits, loss and gradients.

Tolerances, relative to the largest reference value: fp32 1e-5 (observed up to
about 8e-7), fp64 1e-12. A gradient off by a factor 2 (the DeepSpeed-recipe
mistake) is a relative error of 1 and fails by five orders of magnitude. The
windowed models (Mistral, Qwen2, Gemma 2 with softcap, Gemma 3; window 8 of 45
tokens) also check that the window and the softcap change the one-process logits
by far more than the tolerance, so their parity is not vacuous.
"""

import pytest

pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

from .conftest import values  # noqa: E402
from .hf_cases import HF_CASES  # noqa: E402

TOL = {"fp32": 1e-5, "fp64": 1e-12}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(HF_CASES))
@pytest.mark.quick(world=2)
def test_hf_model_matches_one_process(ranks, world, name):
    tol = TOL["fp64" if name.endswith("fp64") else "fp32"]
    backend = HF_CASES[name]["backend"]
    for r in values(ranks(world), f"hf/{name}"):
        assert r["logits_rel"] < tol and r["eval_logits_rel"] < tol, r
        assert r["loss_err"] < tol * 10, r  # absolute, on a loss of about 4
        assert r["grad_rel"] < tol, f"worst parameter {r['worst_param']}: {r['grad_rel']:.3g}"
        assert r["restored"] == r["original"], "remove_sequence_parallel restores the previous attention"
        assert all(effect > 1000 * tol for effect in r["effects"].values()), r["effects"]
        if "+" in backend:  # e.g. halo on the sliding layers, ring on the full ones
            sliding, full = backend.split("+")
            assert r["chosen_by_layer"] == {i: [sliding if i in r["sliding_layers"] else full] for i in r["chosen_by_layer"]}, r
        elif backend != "auto":
            assert r["chosen"] == [backend]


def test_windowed_models_mix_layers():
    """What the windowed cases cover: every layer sliding (Mistral), and sliding next to full layers."""
    from .hf_cases import WINDOWED, sliding_layers, tiny_model

    layers = {family: sliding_layers(tiny_model(family).config) for family in WINDOWED}
    assert layers == {"mistral-window": [0, 1], "qwen2-window": [1], "gemma2": [0], "gemma3": [0]}


def test_no_mask_is_built_for_full_or_sliding_layers():
    """Under "ulysses_sp" transformers' causal and sliding-window mask creators (plain and
    packed position ids) return None: no S x S mask; what the backends cannot reproduce raises."""
    import torch
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask, create_sliding_window_causal_mask

    from ulysses_sp.models.switch import ATTN_IMPLEMENTATION

    from .hf_cases import SEQ, WINDOWED, batch, tiny_model

    def config_of(family, **overrides):
        config = tiny_model(family, **overrides).config
        config._attn_implementation = ATTN_IMPLEMENTATION
        return config

    embeds = torch.zeros(1, SEQ, 32)
    for family in WINDOWED:
        for position_ids in (torch.arange(SEQ)[None], batch(True)["position_ids"]):
            for create in (create_causal_mask, create_sliding_window_causal_mask):
                mask = create(config=config_of(family), inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=position_ids)
                assert mask is None, (family, create.__name__)
    def both_ways(batch_idx, head_idx, q_idx, kv_idx):  # the overlay Gemma 3 adds with use_bidirectional_attention
        return abs(q_idx - kv_idx) < 5

    with pytest.raises(ValueError, match="mask overlay"):
        create_sliding_window_causal_mask(config=config_of("gemma3"), inputs_embeds=embeds, attention_mask=None, cache=None, or_mask_function=both_ways)
    # Llama 4's chunked layers: no mask either (their chunks are boundaries the attention function adds)
    assert ALL_MASK_ATTENTION_FUNCTIONS[ATTN_IMPLEMENTATION](config=config_of("llama", attention_chunk_size=8)) is None


@pytest.mark.parametrize("world", [2, 4])
def test_unsupported_features_name_themselves(ranks, world):
    for r in values(ranks(world), "hf/errors"):
        assert "attention dropout (0.1)" in r["dropout in training"]
        assert "a KV cache with past tokens" in r["kv cache"]
        assert "a padding attention mask or an additive bias" in r["additive mask"]
