"""Image-, video- and audio-text models are refused by name until SP of their sequences is built
(issue 46): SmolVLM (Idefics3) used to run with its vision tower's attention switched too and the
loss off by a relative 1.04, Qwen2-VL stopped with an AttributeError."""

import pytest

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

import ulysses_sp as usp  # noqa: E402
from ulysses_sp.topology import Topology  # noqa: E402

TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
VLMS = {
    "Idefics3ForConditionalGeneration": lambda: transformers.Idefics3Config(
        text_config=dict(TEXT, model_type="llama"), image_token_id=63,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4, image_size=32, patch_size=16)),
    "Qwen2VLForConditionalGeneration": lambda: transformers.Qwen2VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}), image_token_id=63, video_token_id=62,
        vision_config=dict(depth=1, embed_dim=32, hidden_size=32, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2)),
}


@pytest.mark.quick
@pytest.mark.parametrize("name", sorted(VLMS))
def test_image_text_models_are_refused_by_name_and_left_as_they_were(name):
    model = getattr(transformers, name)(VLMS[name]())
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match=f"{name} takes inputs besides text \\(pixel_values.*not supported by ulysses_sp"):
        usp.apply_sequence_parallel(model, Topology.for_planning(2))
    assert model.config._attn_implementation == before
    assert not any("_ulysses_sp" in key for m in model.modules() for key in m.__dict__)


def test_text_models_have_no_other_inputs():
    from ulysses_sp.integrations.coverage import other_modalities

    for cls in (transformers.LlamaForCausalLM, transformers.Gemma3ForCausalLM, transformers.WhisperForCausalLM, transformers.MoshiForCausalLM):
        assert other_modalities(cls.__new__(cls)) == [], cls
