"""Image- and video-text models under SP (ulysses_sp/models/image_text.py): only the text
decoder is switched, the sequence is split at its input. Cases in tests/vlm_cases.py: fp64, loss
within 1e-12 and every gradient (vision tower included) within 1e-7 of one process running each
packed document on its own (observed: loss 9e-16; gradients 1.3e-15, and 3.7e-12 on CLIP's key
bias, whose exact gradient is 0), the decoder's positions equal to each document's own, and each
Qwen and LLaVA image encoded once per SP group (SmolVLM's on every rank). Other image-text families and audio-text models are refused
by name."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed")

import ulysses_sp as usp  # noqa: E402
from ulysses_sp.topology import Topology  # noqa: E402

from .conftest import values  # noqa: E402
from .vlm_cases import AUDIO_PLACEMENTS, FAMILIES, HIDDEN, IMAGE, VERIFIED, VERIFIED_ONLY, PLACEMENTS, _qwen2_vl, _qwen_visuals  # noqa: E402


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("lay,packed", PLACEMENTS, ids=[f"{lay}-{'packed' if p else 'unpacked'}" for lay, p in PLACEMENTS])
@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.quick(world=2, lay="zigzag", packed=True)
def test_image_text_model_equals_one_process(ranks, world, lay, packed, family):
    """An image straddling a shard boundary, a video (Qwen: whole, or Qwen3-VL's frames after
    timestamps), three packed documents of which one has no image, so that some rank holds none."""
    for rank, r in enumerate(values(ranks(world), f"vlm/{family}/{lay}{'-packed' if packed else ''}")):
        _assert_exact(rank, r, lay, world)


def _assert_exact(rank, r, lay, world, rows=1):
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-12 * r["ref_loss"] and abs(r["tiled_loss"] - r["ref_loss"]) <= 1e-12 * r["ref_loss"], (rank, r)
    assert r["positions_equal"], (rank, r)
    assert r["missing"] == [] and r["worst"][1] < 1e-7 and r["vision_grad"] < 1e-7, (rank, r)
    assert r["grads_alike"], (rank, r)  # the same parameters hold a gradient on every rank, as DeepSpeed's reduction needs
    assert r["padded"] % usp.layout.required_multiple(lay, world) == 0 and r["logits"] == (rows, r["padded"] // world, 64), (rank, r)
    assert r["encoded"][1] == r["encoded"][2], (rank, r)  # each image and video encoded on one rank of the group


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gemma3_rows_with_their_own_image_blocks_equal_one_process(ranks, world):
    """Two rows whose images sit at different places: each row's attention gets its own blocks."""
    for rank, r in enumerate(values(ranks(world), "vlm/gemma3/zigzag-rows")):
        _assert_exact(rank, r, "zigzag", world, rows=2)


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("placement", ["zigzag", "zigzag-packed"])
def test_gemma3_image_blocks_cut_at_the_shards_are_caught(ranks, world, placement):
    """Each image's block cut where the shards' chunks end (the block found in each rank's own shard):
    the loss and the gradients move far beyond the parity bounds (observed: loss 7e-5 to 3.7e-4 relative,
    worst gradient 0.05 to 0.19)."""
    for rank, r in enumerate(values(ranks(world), f"vlm-planted/gemma3-blocks-cut/{placement}")):
        assert abs(r["loss"] - r["ref_loss"]) > 1e-5 * r["ref_loss"] and r["worst"][1] > 1e-2, (rank, r)


@pytest.mark.parametrize("world", [2, 4])
def test_gemma4_image_blocks_on_its_full_layers_are_caught(ranks, world):
    """Gemma 4's images attend both ways on its sliding layers only: the blocks applied on its full
    layers too move the loss and the gradients beyond the parity bounds."""
    for rank, r in enumerate(values(ranks(world), "vlm-planted/gemma4-blocks-on-full-layers")):
        assert abs(r["loss"] - r["ref_loss"]) > 1e-6 * r["ref_loss"] and r["worst"][1] > 1e-3, (rank, r)


def _switched_qwen2_vl():
    model = _qwen2_vl().double()
    usp.apply_sequence_parallel(model, Topology.for_planning(2))
    return model


@pytest.mark.quick
def test_only_the_text_decoder_is_switched_and_remove_undoes_it():
    model = _qwen2_vl()
    config = model.config
    before = (config.text_config._attn_implementation, config.vision_config._attn_implementation, config.text_config.use_cache)
    usp.apply_sequence_parallel(model, Topology.for_planning(2))
    assert config.text_config._attn_implementation == "ulysses_sp" and config.vision_config._attn_implementation == before[1]
    switched = [name for name, m in model.named_modules() if "_ulysses_sp_attention" in m.__dict__]
    assert switched and all(name.startswith("model.language_model.") for name in switched)
    usp.remove_sequence_parallel(model)
    assert (config.text_config._attn_implementation, config.vision_config._attn_implementation, config.text_config.use_cache) == before
    assert not any(key.startswith("_ulysses_sp") for m in model.modules() for key in m.__dict__)
    assert not model._forward_pre_hooks and not model.model.language_model._forward_pre_hooks


@pytest.mark.quick
def test_position_ids_given_to_an_image_text_model_raise():
    """The text-model calls (local ids and [B, S] positions) would give Qwen 1-D RoPE instead of its
    multimodal RoPE (a relative error of 1.1 in the issue's trial): refused before any collective."""
    model = _switched_qwen2_vl()
    ids = torch.randint(0, 60, (1, 24))
    with pytest.raises(ValueError, match="numbers its positions itself.*pass no position_ids"):
        model(input_ids=ids, position_ids=torch.arange(24)[None])


def test_an_image_text_model_under_zero3_raises_before_any_collective():
    """DeepSpeed ZeRO-3 gathers a module's weights on every rank at each of its calls, a collective, but each image is
    encoded on one rank: the vision tower's calls differ between ranks (it crashed inside autograd, the lm_head's
    weight read as ZeRO-3's empty partition). Refused by name at the first call."""
    model = _switched_qwen2_vl()
    next(model.parameters()).ds_id = 0  # what ZeRO-3 marks its partitioned parameters with
    with pytest.raises(ValueError, match="DeepSpeed ZeRO-3 gathers a module's weights on every rank.*use ZeRO stage 1 or 2"):
        model(input_ids=torch.randint(0, 60, (1, 24)))


@pytest.mark.quick
def test_a_padding_mask_raises_before_any_collective():
    model = _switched_qwen2_vl()
    ids = torch.randint(0, 60, (1, 24))
    ids[0, 2:18] = IMAGE
    g = torch.Generator().manual_seed(0)
    mask = torch.ones(1, 24, dtype=torch.long)
    mask[0, 20:] = 0
    with pytest.raises(ValueError, match="Qwen2VLForConditionalGeneration was given a 2-D attention mask.*cannot split"):
        model(input_ids=ids, attention_mask=mask, mm_token_type_ids=(ids == IMAGE).int(), **_qwen_visuals(["image"], g))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_verify_checks_image_text_models_with_random_images(ranks, world):
    """Each family's default config, shrunk, with random images (one across a shard boundary; packed,
    a document without any): exact. A planted defect (the packed row's document boundaries dropped)
    is caught, in the packed run only."""
    for r in values(ranks(world), "vlm/verify"):
        for name in VERIFIED[world]:
            assert ": exact, worst relative error" in r[name], r[name]
        if world == 2:
            passed, loss_error, worst = r["planted"]
            assert not passed and loss_error["packed"] > 1e-3 and loss_error["unpacked"] < 1e-12 and worst[0] == "packed", r["planted"]


@pytest.mark.quick
def test_verify_shrinks_an_image_text_config_to_a_small_model():
    """ulysses_sp.models.verify_image_text on Qwen2.5-VL's default config (a 75B model): one of
    1.5 million parameters whose multimodal RoPE sections fill the small head dim and whose
    placeholder ids lie in the small vocabulary; its rows hold 16 tokens an image."""
    from ulysses_sp.models.shrink import shrink_text
    from ulysses_sp.models.verify_image_text import rows, shrink_image_text_config

    small = shrink_image_text_config(transformers.Qwen2_5_VLConfig(), shrink_text)
    text = small.text_config
    with torch.device("meta"):
        n = sum(p.numel() for p in transformers.Qwen2_5_VLForConditionalGeneration(small).parameters())
    assert n < 2_000_000 and text.num_hidden_layers == 2 and small.vision_config.depth == 2, n
    assert sum(text.rope_parameters["mrope_section"]) == text.hidden_size // text.num_attention_heads // 2
    assert max(small.image_token_id, small.video_token_id, small.vision_start_token_id) < text.vocab_size
    batch, docs = rows(small, 2, packed=True, seed=0)
    assert len(docs) == 3 and int((batch["input_ids"] == small.image_token_id).sum()) == 32
    assert batch["input_ids"].shape[1] == sum(d["input_ids"].shape[1] for d in docs) and "video_grid_thw" in batch


def test_verify_makes_images_for_every_switched_family():
    from ulysses_sp.models import image_text, verify_image_text

    assert sorted(verify_image_text.BUILDS) == sorted(image_text.TESTED)


def test_runs_of_image_tokens_are_counted_row_by_row():
    """LLaVA-NeXT's tokens per image: each run of placeholders (a run never crosses rows)."""
    from ulysses_sp.models.image_text import _runs

    assert _runs(torch.tensor([[0, 1, 1, 0, 1], [1, 1, 0, 0, 1]]).bool()) == [2, 1, 2, 1]


def test_verify_refuses_other_image_text_models_by_name():
    """Before any collective; it used to stop with an AttributeError (no num_hidden_layers on the composite config)."""
    with pytest.raises(ValueError, match="checks text causal LMs and the image-text families .*; AyaVisionConfig \\(aya_vision\\) is neither"):
        usp.verify_sequence_parallel(transformers.AyaVisionConfig(), Topology.for_planning(2))


@pytest.mark.quick
def test_a_block_overlay_mask_raises():
    """create_causal_mask(block_sequence_ids=...) (Gemma 3's and PaliGemma's image blocks, HRM's prefix)
    used to return no mask under "ulysses_sp" and raise nothing."""
    from transformers.masking_utils import create_causal_mask

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4)
    config._attn_implementation = "ulysses_sp"
    embeds = torch.zeros(1, 8, 32)
    assert create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=torch.arange(8)[None]) is None
    blocks = torch.tensor([[-1, 0, 0, 0, -1, -1, -1, -1]])
    with pytest.raises(ValueError, match="bidirectional block overlay"):
        create_causal_mask(config=config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=torch.arange(8)[None],
                           block_sequence_ids=blocks)


def test_glm_videos_without_their_token_types_are_refused_by_name():
    """GLM-4.1V's video tokens are image tokens; only mm_token_type_ids (2) tells them apart: without it, a video raises,
    before any collective."""
    from .vlm_cases import _glm4v

    model = _glm4v()
    usp.apply_sequence_parallel(model, Topology.for_planning(2))
    ids = torch.tensor([[1, 2] + [63] * 16 + [3, 4]])
    with pytest.raises(ValueError, match=r"Glm4vForConditionalGeneration \(glm4v\) under sequence parallelism tells its video tokens "
                                         r"from its image tokens \(one id\) by mm_token_type_ids"):
        model(input_ids=ids, pixel_values_videos=torch.zeros(64, 96), video_grid_thw=torch.tensor([[2, 4, 8]]))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("lay,packed", AUDIO_PLACEMENTS, ids=[f"{lay}-{'packed' if p else 'unpacked'}" for lay, p in AUDIO_PLACEMENTS])
@pytest.mark.quick(world=2, lay="zigzag", packed=False)
def test_gemma4_audio_equals_one_process(ranks, world, lay, packed):
    """Gemma 4's audio clip (16 tokens between its markers, across a shard boundary unpacked) beside an image and a video:
    each clip encoded on one rank, its rows merged by the model's own code on the ranks holding its tokens, whose
    per-layer inputs the model computes from their own ids."""
    for rank, r in enumerate(values(ranks(world), f"vlm/gemma4-audio/{lay}{'-packed' if packed else ''}")):
        _assert_exact(rank, r, lay, world)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_glm_rows_in_kind_order_are_caught(ranks, world):
    """Control for GLM's videos: its image and video rows handed over by kind, not in token order (balanced, packed)."""
    for rank, r in enumerate(values(ranks(world), "vlm-planted/glm-stream-in-kind-order")):
        assert abs(r["loss"] - r["ref_loss"]) > 1e-6 * r["ref_loss"] and r["worst"][1] > 1e-3, (rank, r)


def test_gemma4_audio_rows_in_reverse_are_caught(ranks):
    """Control for Gemma 4's audio: its clip's rows merged in reverse order."""
    for rank, r in enumerate(values(ranks(2), "vlm-planted/gemma4-audio-reversed")):
        assert abs(r["loss"] - r["ref_loss"]) > 1e-6 * r["ref_loss"] and r["worst"][1] > 1e-3, (rank, r)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_gemma4_whose_images_attend_causally_equals_one_process(ranks, world):
    """Gemma 4 as its small models ship (use_bidirectional_attention None): no blocks on any layer, packed."""
    for rank, r in enumerate(values(ranks(world), "vlm/gemma4-causal/zigzag-packed")):
        _assert_exact(rank, r, "zigzag", world)


def test_gemma4_blocks_where_its_images_attend_causally_are_caught(ranks):
    """Control for the causal case above: the blocks applied on every layer move the loss and gradients."""
    for rank, r in enumerate(values(ranks(2), "vlm-planted/gemma4-causal-blocks")):
        assert abs(r["loss"] - r["ref_loss"]) > 1e-6 * r["ref_loss"] and r["worst"][1] > 1e-3, (rank, r)


def test_multi_image_samples_of_llava_onevision_are_refused_by_name():
    """Its images of a sample with several are not tiled (batch_num_images > 1); no test holds that yet."""
    from .vlm_cases import _llava_onevision

    model = _llava_onevision()
    usp.apply_sequence_parallel(model, Topology.for_planning(2))
    ids = torch.tensor([[1, 2] + [IMAGE] * 10 + [3, 4]])
    with pytest.raises(ValueError, match=r"takes one image per sample \(batch_num_images \[2\]\)"):
        model(input_ids=ids, pixel_values=torch.zeros(2, 3, 3, 16, 16), image_sizes=torch.tensor([[16, 32], [16, 32]]),
              batch_num_images=torch.tensor([2]))


@pytest.mark.parametrize("types,where", [([0] * 24, "[(0, 24)]"), ([0] * 4 + [1] * 8 + [0] * 4 + [1] * 8, "[(0, 4), (12, 16)]")])
def test_paligemma_prefixes_it_cannot_place_are_refused(types, where):
    """A prefix running to the end of an unpacked row (where padding, also token type 0, would join it), and a
    second prefix inside a document (transformers makes one block of both): refused before any collective."""
    from .vlm_cases import _paligemma

    model = _paligemma()
    usp.apply_sequence_parallel(model, Topology.for_planning(2))
    with pytest.raises(ValueError, match=f"takes one prefix .* document \\[0, 24\\) has its 0s at {re.escape(where)}"):
        model(input_ids=torch.randint(0, 60, (1, 24)), token_type_ids=torch.tensor([types]))


def test_an_attention_that_drops_the_blocks_is_refused():
    """The model was given bidirectional blocks and a layer's attention call lacks them (its code does not pass
    the keyword arguments on): refused, as a layer that drops the packed documents' boundaries is."""
    from ulysses_sp.models import coverage

    model = _switched_qwen2_vl()
    layer = next(m for m in model.modules() if coverage._CALLS in m.__dict__)
    layer.__dict__[coverage._CALLS][1][:] = [coverage.BLOCKS]
    with pytest.raises(ValueError, match=r"did not receive the bidirectional blocks \(ulysses_sp_blocks\) that the model was given"):
        coverage.mark_called(layer, {})


def test_audio_inside_videos_is_refused_by_name():
    """Qwen2.5-Omni's use_audio_in_video interleaves a video's audio with its frames in the positions: not tested yet."""
    from .vlm_cases import _qwen2_5_omni

    model = _qwen2_5_omni()
    usp.apply_sequence_parallel(model, Topology.for_planning(2))
    with pytest.raises(ValueError, match="takes audio clips apart from videos: use_audio_in_video is not tested yet"):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]), use_audio_in_video=True)


def test_shard_batch_keeps_the_whole_ids_and_images_for_the_model():
    ids = torch.randint(0, 60, (1, 45))
    batch = {"input_ids": ids, "labels": ids, "mm_token_type_ids": torch.zeros_like(ids), "pixel_values": torch.ones(64, 96),
             "image_grid_thw": torch.tensor([[1, 8, 8]])}
    local = usp.shard_batch(batch, Topology.for_planning(2, layout="zigzag"))
    inputs = usp.model_inputs(local)
    assert set(inputs) == {"input_ids", "mm_token_type_ids", "pixel_values", "image_grid_thw"}
    assert inputs["input_ids"].shape == inputs["mm_token_type_ids"].shape == (1, 48) and inputs["pixel_values"] is batch["pixel_values"]
    assert torch.equal(inputs["input_ids"][:, :45], ids) and local["input_ids"].shape == local["shift_labels"].shape == (1, 24)


@pytest.mark.quick
def test_audio_text_models_are_refused_by_name_and_left_as_they_were():
    config = transformers.Qwen2AudioConfig(
        text_config=dict(model_type="qwen2", vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2),
        audio_config=dict(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=48, num_mel_bins=16))
    model = transformers.Qwen2AudioForConditionalGeneration(config)
    before = model.config.text_config._attn_implementation
    with pytest.raises(ValueError, match="Qwen2AudioForConditionalGeneration \\(qwen2_audio\\) takes inputs besides text \\(input_features"):
        usp.apply_sequence_parallel(model, Topology.for_planning(2))
    assert model.config.text_config._attn_implementation == before
    assert not any("_ulysses_sp" in key for m in model.modules() for key in m.__dict__)


def test_text_models_have_no_other_inputs():
    from ulysses_sp.models.coverage import other_modalities

    for cls in (transformers.LlamaForCausalLM, transformers.Gemma3ForCausalLM, transformers.WhisperForCausalLM, transformers.MoshiForCausalLM):
        assert other_modalities(cls.__new__(cls)) == [], cls


def test_every_other_image_text_family_is_refused_by_name():
    """transformers' image-text-to-text families: those tests/vlm_cases.py holds exact are switched,
    every other one is refused with its class and model type (no model is built: the refusal reads
    the class's forward and the config's model type)."""
    from types import SimpleNamespace

    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from ulysses_sp.models.image_text import TESTED

    assert sorted([*FAMILIES, *VERIFIED_ONLY]) == sorted(TESTED)
    refused = []
    for model_type, name in sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.items()):
        if model_type in TESTED or name.endswith("ForCausalLM"):  # a text model's class (Mistral 4): the family sweep's
            continue
        cls = getattr(transformers, name)
        model = cls.__new__(cls)
        object.__setattr__(model, "config", SimpleNamespace(model_type=model_type))
        with pytest.raises(ValueError, match=f"^{name} \\({model_type}\\) takes inputs besides text"):
            usp.apply_sequence_parallel(model, Topology.for_planning(2))
        refused.append(model_type)
    assert len(refused) > 70


def test_embed_and_merge_memory_falls_as_one_over_p(ranks):
    """16 images of 16 tokens in a row of 512: each rank encodes 16 / P images and embeds 512 / P
    tokens, and its peak memory up to the text decoder's input falls with them (observed: 0.54 of
    one process's at P=2, 0.31 at P=4; embedding the whole row on every rank, as before, gave 0.74
    and 0.59)."""
    one = values(ranks(1), "vlm/embed-memory")[0]
    assert one["images"] == 16 and one["embeds"] == (1, 512, HIDDEN), one
    for world in (2, 4):
        for r in values(ranks(world), "vlm/embed-memory"):
            assert r["images"] == 16 // world and r["embeds"] == (1, 512 // world, HIDDEN), (world, r)
            assert r["peak"] <= (1 / world + 0.1) * one["peak"], (world, r["peak"] / one["peak"])
