"""Image-text models under SP (ulysses_sp/models/image_text.py), inside the pool's ranks;
assertions in tests/test_multimodal.py. Each case builds a tiny fp64 model of one family, a row of
text with images (and, where the family has them, a video) placed so that one straddles a shard
boundary at every P, and compares the loss and every gradient (vision tower included) with one
process, which runs each packed document on its own."""

from __future__ import annotations

import contextlib
import copy
import inspect

import torch
import torch.nn.functional as F

import ulysses_sp as usp

from ulysses_sp.models.image_text import AUDIO as AUDIO_FAMILIES

from .cases import Env, case

IMAGE, VIDEO, START, END = 63, 62, 61, 60
"""Placeholder ids of an image's and a video's tokens, and Qwen's vision start and end markers."""
AUDIO, AUDIO_START, AUDIO_END = 59, 58, 57
"""Qwen2.5-Omni's audio placeholder and markers (its text tokens stay below them)."""
TEXT = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=512, tie_word_embeddings=False)
TOKENS = 16
"""Tokens per image (and per video) in every family here."""


def _qwen2_vl(hidden: int = 32):
    import transformers

    cfg = transformers.Qwen2VLConfig(
        text_config=dict(TEXT, hidden_size=hidden, rope_scaling={"type": "mrope", "mrope_section": [hidden // 32, hidden // 32, hidden // 16]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=hidden, num_heads=4, mlp_ratio=2, patch_size=4, spatial_merge_size=2,
                           temporal_patch_size=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen2VLForConditionalGeneration(cfg)


def _joined(parts: list[dict]) -> dict:
    """The inputs of a document's items (each a dict), joined along their first dim in the items' order."""
    out: dict = {}
    for part in parts:
        for key, value in part.items():
            out[key] = torch.cat([out[key], value]) if key in out else value
    return out


def _qwen_item(kind: str, g: torch.Generator) -> dict:
    grid = [1, 8, 8] if kind == "image" else [2, 4, 8]
    pixels = torch.randn(grid[0] * grid[1] * grid[2], 3 * 2 * 4 * 4, generator=g, dtype=torch.float64)
    return {"pixel_values" if kind == "image" else "pixel_values_videos": pixels, f"{kind}_grid_thw": torch.tensor([grid])}


def _qwen_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """Qwen's flattened patches: an image is 1 x 8 x 8 patches and a video 2 x 4 x 8 (two frame pairs),
    16 tokens each after the 2 x 2 merge; each patch is 3 channels x 2 frames x 4 x 4 pixels."""
    return _joined([_qwen_item(kind, g) for kind in kinds])


def _glm4v(config: str = "Glm4vConfig", model: str = "Glm4vForConditionalGeneration"):
    import transformers

    cfg = getattr(transformers, config)(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "partial_rotary_factor": 1.0}),
        vision_config=_qwen_vision(image_size=32), image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START,
        image_end_token_id=END, video_start_token_id=START, video_end_token_id=END)
    return getattr(transformers, model)(cfg)


def _glm4v_moe():
    import transformers

    text = dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2], "partial_rotary_factor": 0.5},
                head_dim=16, moe_intermediate_size=16, num_experts_per_tok=2, n_routed_experts=4, n_shared_experts=1, first_k_dense_replace=1)
    cfg = transformers.Glm4vMoeConfig(
        text_config=text, vision_config=_qwen_vision(image_size=32), image_token_id=IMAGE, video_token_id=VIDEO, image_start_token_id=START,
        image_end_token_id=END, video_start_token_id=START, video_end_token_id=END)
    return transformers.Glm4vMoeForConditionalGeneration._from_config(cfg, experts_implementation="eager")  # grouped_mm: no fp64


def _kimi_k25():
    import transformers

    text = dict(TEXT, model_type="deepseek_v3", num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=6)  # multi-head latent attention
    cfg = transformers.Kimi_K25Config(
        text_config=text, projection_hidden_size=32, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START,
        vision_end_token_id=END, tie_word_embeddings=False,
        vision_config=dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, num_attention_heads=4, num_hidden_layers=2, hidden_size=32,
                           intermediate_size=48))
    return transformers.Kimi_K25ForConditionalGeneration._from_config(cfg, experts_implementation="eager")  # grouped_mm: no fp64


def _kimi_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """MoonViT's patch rows: an image of 8 x 8 patches of 3 x 4 x 4 pixels, merged 2 x 2: 16 tokens; a video of 2 such
    frames, averaged in time: 16 tokens too."""
    def item(kind):
        frames = 1 if kind == "image" else 2
        return {"pixel_values" if kind == "image" else "pixel_values_videos": torch.randn(64 * frames, 3, 4, 4, generator=g, dtype=torch.float64),
                f"{kind}_grid_thw": torch.tensor([[frames, 8, 8]])}
    return _joined([item(kind) for kind in kinds])


def _llava():
    import transformers

    cfg = transformers.LlavaConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=32, patch_size=8, projection_dim=32),
        image_token_id=IMAGE, projector_hidden_act="gelu", vision_feature_layer=-1)
    return transformers.LlavaForConditionalGeneration(cfg)


def _llava_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """CLIP at 32 x 32 pixels in 8 x 8 patches: 16 tokens (the class token dropped)."""
    return {"pixel_values": torch.randn(len(kinds), 3, 32, 32, generator=g, dtype=torch.float64)} if kinds else {}


def _qwen_vision(**extra) -> dict:
    return dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=4, out_hidden_size=32, patch_size=4, spatial_merge_size=2,
                temporal_patch_size=2, **extra)


def _qwen2_5_vl():
    import transformers

    cfg = transformers.Qwen2_5_VLConfig(
        text_config=dict(TEXT, rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=_qwen_vision(window_size=16, fullatt_block_indexes=[1]),  # windows of 2 x 2 merged patches, then a full block
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return transformers.Qwen2_5_VLForConditionalGeneration(cfg)


def _qwen3_vl(moe: bool = False):
    import transformers

    text = dict(TEXT, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                                   "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    config, model = ((transformers.Qwen3VLMoeConfig, transformers.Qwen3VLMoeForConditionalGeneration) if moe
                     else (transformers.Qwen3VLConfig, transformers.Qwen3VLForConditionalGeneration))
    cfg = config(text_config=text, vision_config=_qwen_vision(num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
                 image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END)
    return model._from_config(cfg, experts_implementation="eager") if moe else model(cfg)  # grouped_mm takes no fp64


def _smolvlm():
    import transformers

    cfg = transformers.SmolVLMConfig(
        text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE, scale_factor=2,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=8))
    return transformers.SmolVLMForConditionalGeneration(cfg)


def _smolvlm_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """64 x 64 pixels in 8 x 8 patches, 4 patches a token (pixel shuffle): 16 tokens; the images of a row in one [1, N, ...]."""
    return {"pixel_values": torch.randn(1, len(kinds), 3, 64, 64, generator=g, dtype=torch.float64)} if kinds else {}


def _idefics3():
    import transformers

    cfg = transformers.Idefics3Config(
        text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE, scale_factor=2,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=64, patch_size=8))
    return transformers.Idefics3ForConditionalGeneration(cfg)


def _mistral3():
    import transformers

    cfg = transformers.Mistral3Config(
        text_config=dict(TEXT, model_type="mistral", head_dim=8), image_token_index=IMAGE, spatial_merge_size=2, projector_hidden_act="gelu",
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, head_dim=8, image_size=32, patch_size=4),
        vision_feature_layer=-1)
    return transformers.Mistral3ForConditionalGeneration(cfg)


def _mistral3_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """32 x 32 pixels in 4 x 4 patches, merged 2 x 2: 16 tokens in 4 rows of 4 (a break token after each row but the last);
    a document's second image 16 x 32 (8 tokens in 2 rows), padded to 32 x 32 as the processor pads."""
    if not kinds:
        return {}
    return {"pixel_values": torch.randn(len(kinds), 3, 32, 32, generator=g, dtype=torch.float64),
            "image_sizes": torch.tensor([[32, 32], [16, 32]][:len(kinds)])}


def _llava_next():
    import transformers

    cfg = transformers.LlavaNextConfig(
        text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE, vision_feature_layer=-1,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8, projection_dim=32),
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]])
    return transformers.LlavaNextForConditionalGeneration(cfg)


NEXT_SIZES = ([16, 32], [24, 16])
"""LLaVA-NeXT: a document's first and second image, each a 16 x 16 base tile and two anyres tiles; 14 and 16 tokens
(the base tile's 4, the unpadded tiles', a newline token per row)."""


def _llava_next_visuals(kinds: list[str], g: torch.Generator) -> dict:
    if not kinds:
        return {}
    return {"pixel_values": torch.randn(len(kinds), 3, 3, 16, 16, generator=g, dtype=torch.float64),
            "image_sizes": torch.tensor(NEXT_SIZES[:len(kinds)])}


def _llava_next_video():
    import transformers

    cfg = transformers.LlavaNextVideoConfig(
        text_config=dict(TEXT, model_type="llama"), image_token_id=IMAGE, video_token_id=VIDEO, vision_feature_layer=-1,
        vision_config=dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8, projection_dim=32),
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]])
    return transformers.LlavaNextVideoForConditionalGeneration(cfg)


def _next_video_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """LLaVA-NeXT's images of 14 tokens (`_llava_onevision_visuals`) and videos of 16 frames of 16 x 16, each pooled to a token: 16."""
    return _llava_onevision_visuals(kinds, g, frames=16)


def _llava_onevision():
    import transformers

    cfg = transformers.LlavaOnevisionConfig(
        text_config=dict(TEXT, model_type="qwen2"), image_token_id=IMAGE, video_token_id=VIDEO, vision_feature_layer=-1,
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                           image_size=16, patch_size=8),
        image_grid_pinpoints=[[16, 16], [16, 32], [32, 16], [32, 32]])
    return transformers.LlavaOnevisionForConditionalGeneration(cfg)


def _llava_onevision_visuals(kinds: list[str], g: torch.Generator, frames: int = 15) -> dict:
    """Each image 16 x 32 (a base tile and two anyres tiles): 14 tokens; each video 15 frames of 16 x 16, pooled to a token
    a frame and a newline token: 16."""
    out = _joined([{"pixel_values": torch.randn(1, 3, 3, 16, 16, generator=g, dtype=torch.float64)} if kind == "image" else
                   {"pixel_values_videos": torch.randn(1, frames, 3, 16, 16, generator=g, dtype=torch.float64)} for kind in kinds])
    if "image" in kinds:
        out["image_sizes"] = torch.tensor([NEXT_SIZES[0]] * kinds.count("image"))
    return out


def _qwen2_5_omni():
    import transformers

    cfg = transformers.Qwen2_5OmniThinkerConfig(
        text_config=dict(TEXT, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2]}),
        vision_config=_qwen_vision(window_size=16, fullatt_block_indexes=[1]),
        audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, d_model=32, output_dim=32, n_window=8,
                          max_source_positions=64),
        image_token_index=IMAGE, video_token_index=VIDEO, audio_token_index=AUDIO, vision_start_token_id=START, vision_end_token_id=END,
        audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END)
    return transformers.Qwen2_5OmniThinkerForConditionalGeneration(cfg)


def _qwen3_omni():
    import transformers

    text = dict(TEXT, head_dim=8, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                                   "mrope_interleaved": True},
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, decoder_sparse_step=1)
    cfg = transformers.Qwen3OmniMoeThinkerConfig(
        text_config=text, vision_config=_qwen_vision(num_position_embeddings=64, deepstack_visual_indexes=[0, 1]),
        audio_config=dict(num_mel_bins=16, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=48, d_model=32, output_dim=32,
                          max_source_positions=64, downsample_hidden_size=8),
        image_token_id=IMAGE, video_token_id=VIDEO, audio_token_id=AUDIO, vision_start_token_id=START, vision_end_token_id=END,
        audio_start_token_id=AUDIO_START, audio_end_token_id=AUDIO_END)
    return transformers.Qwen3OmniMoeThinkerForConditionalGeneration._from_config(cfg, experts_implementation="eager")  # grouped_mm: no fp64


def _omni_visuals(kinds: list[str], g: torch.Generator, frames: int = 64) -> dict:
    """Qwen's image and video patches (`_qwen_visuals`; a video's seconds per frame pair) and audio clips of 64 mel frames
    (Qwen2.5-Omni's tower: 16 tokens after its two halvings; Qwen3-Omni's: 100 frames, 13 tokens), in order."""
    def item(kind):
        if kind == "audio":
            return {"input_features": torch.randn(1, 16, frames, generator=g, dtype=torch.float64),
                    "feature_attention_mask": torch.ones(1, frames, dtype=torch.long)}
        seconds = {"video_second_per_grid": torch.tensor([0.5])} if kind == "video" else {}  # the thinkers' positions count time
        return {**_qwen_item(kind, g), **seconds}
    return _joined([item(kind) for kind in kinds])


def _internvl():
    import transformers

    cfg = transformers.InternVLConfig(
        text_config=dict(TEXT, model_type="qwen2"), image_token_id=IMAGE, downsample_ratio=0.5,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=[32, 32], patch_size=[4, 4]))
    return transformers.InternVLForConditionalGeneration(cfg)


def _internvl_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """One 32 x 32 tile per image in 4 x 4 patches, 4 patches a token (pixel shuffle at 0.5): 16 tokens."""
    return {"pixel_values": torch.randn(len(kinds), 3, 32, 32, generator=g, dtype=torch.float64)} if kinds else {}


def _gemma3():
    import transformers

    cfg = transformers.Gemma3Config(
        text_config=dict(TEXT, head_dim=8, query_pre_attn_scalar=8, sliding_window=8, layer_types=["sliding_attention", "full_attention"]),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8),
        mm_tokens_per_image=16, image_token_index=IMAGE, boi_token_index=START, eoi_token_index=END)
    return transformers.Gemma3ForConditionalGeneration(cfg)


def _paligemma():
    import transformers

    cfg = transformers.PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma", head_dim=8), projection_dim=32, image_token_index=IMAGE,
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, image_size=32, patch_size=8,
                           projection_dim=32))
    return transformers.PaliGemmaForConditionalGeneration(cfg)


def _gemma4(bidirectional: str | None = "vision", audio: bool = False):
    import transformers

    cfg = transformers.Gemma4Config(
        text_config=dict(TEXT, model_type="gemma4_text", head_dim=8, global_head_dim=16, sliding_window=8, pad_token_id=0, num_hidden_layers=3,
                         layer_types=["full_attention", "sliding_attention", "full_attention"], use_bidirectional_attention=bidirectional,
                         hidden_size_per_layer_input=8, vocab_size_per_layer_input=TEXT["vocab_size"]),
        vision_config=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                           patch_size=4, pooling_kernel_size=2, position_embedding_size=16),
        audio_config=dict(hidden_size=32, num_attention_heads=4, num_hidden_layers=2, subsampling_conv_channels=[16, 4], output_proj_dims=32,
                          attention_chunk_size=4, attention_context_left=5) if audio else None,
        image_token_id=IMAGE, video_token_id=VIDEO, boi_token_id=START, eoi_token_id=END, audio_token_id=AUDIO, boa_token_id=AUDIO_START,
        eoa_token_index=AUDIO_END)
    return transformers.Gemma4ForConditionalGeneration(cfg)


def _gemma4_visuals(kinds: list[str], g: torch.Generator) -> dict:
    """Each image 8 x 8 patches of 4 x 4 pixels, each patch's (x, y) in image_position_ids, pooled 2 x 2: 16 tokens; each
    video 2 frames of 8 x 4 patches: 8 tokens a frame (`num_frames_per_video`, video_position_ids); each audio clip 64
    frames of 16 mel bins, 4 frames a token: 16."""
    def where(width, height, n):
        ys, xs = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
        return torch.stack([xs.flatten(), ys.flatten()], -1).repeat(n, 1, 1)

    return _joined([{"pixel_values": torch.rand(1, 64, 48, generator=g, dtype=torch.float64), "image_position_ids": where(8, 8, 1)}
                    if kind == "image" else
                    {"input_features": torch.randn(1, 64, 16, generator=g, dtype=torch.float64), "input_features_mask": torch.ones(1, 64, dtype=torch.bool)}
                    if kind == "audio" else
                    {"pixel_values_videos": torch.rand(2, 32, 48, generator=g, dtype=torch.float64), "video_position_ids": where(8, 4, 2),
                     "num_frames_per_video": torch.tensor([2])} for kind in kinds])


FAMILIES = {
    "qwen2_vl": (_qwen2_vl, _qwen_visuals, "whole"),
    "qwen2_5_vl": (_qwen2_5_vl, _qwen_visuals, "whole"),
    "qwen3_vl": (_qwen3_vl, _qwen_visuals, "frames"),
    "qwen3_vl_moe": (lambda: _qwen3_vl(moe=True), _qwen_visuals, "frames"),
    "glm4v": (_glm4v, _qwen_visuals, "frames"),  # each video frame its own run after a timestamp, its tokens image tokens typed 2
    "glm4v_moe": (_glm4v_moe, _qwen_visuals, "frames"),  # GLM-4.5V: GLM-4.1V's vision, a MoE text model (layer 0 dense)
    "glm46v": (lambda: _glm4v("Glm46VConfig", "Glm46VForConditionalGeneration"), _qwen_visuals, "frames"),  # GLM-4.6V: GLM-4.1V's parts
    "kimi_k25": (_kimi_k25, _kimi_visuals, "whole"),  # Kimi-K2.5: MoonViT's patch rows (a video's frames averaged), DeepSeek-V3 text
    "llava": (_llava, _llava_visuals, None),
    "smolvlm": (_smolvlm, _smolvlm_visuals, None),
    "internvl": (_internvl, _internvl_visuals, None),
    "idefics3": (_idefics3, _smolvlm_visuals, None),
    "mistral3": (_mistral3, _mistral3_visuals, "rows"),
    "llava_next": (_llava_next, _llava_next_visuals, "anyres"),
    "llava_onevision": (_llava_onevision, _llava_onevision_visuals, "onevision"),
    "llava_next_video": (_llava_next_video, _next_video_visuals, "onevision"),
    "gemma3": (_gemma3, _llava_visuals, None),  # each image's 16 tokens one bidirectional block; a window of 8 on sliding layers
    "paligemma": (_paligemma, _llava_visuals, None),  # each document's prefix (its first image and 3 tokens) one block
    # per-layer inputs, head dims 16 (full layers) and 8; each image and video frame a block on the (middle) sliding layer only: a
    # block on the first full layer would change the loss (on the last, only image tokens' outputs, which no loss reads)
    "gemma4": (_gemma4, _gemma4_visuals, "frames"),
    "qwen2_5_omni_thinker": (_qwen2_5_omni, _omni_visuals, "audio"),
    "qwen3_omni_moe_thinker": (_qwen3_omni, lambda kinds, g: _omni_visuals(kinds, g, frames=100), "audio13"),
}
"""name: (tiny model, the visual inputs of a list of "image"/"video", its videos: None, "whole" (one run of
tokens) or "frames" (Qwen3-VL, Gemma 4: each frame its own run, after a timestamp); "rows": no video, an image's
tokens in rows of 4 with a text token between (Mistral 3's break tokens); "anyres": no video, 14 and 16 tokens (LLaVA-NeXT);
"onevision": images of 14 tokens and videos of 16 without markers (LLaVA-OneVision); "audio" ("audio13"): an audio clip of 16
(13) tokens between its markers as the second item, and, packed, a whole video as the first document's (Qwen2.5-Omni,
Qwen3-Omni))."""
VARIANTS = {"gemma4-causal": (lambda: _gemma4(bidirectional=None), _gemma4_visuals, "frames"),
            "gemma4-audio": (lambda: _gemma4(audio=True), _gemma4_visuals, "frames-audio")}
"""Families built another way, held by cases of their own: Gemma 4 as its small models ship (``use_bidirectional_attention``
None: its images and frames attend causally, on every layer); Gemma 4 with its audio tower (an audio clip the second item,
packed, a video the first document's: "frames-audio")."""
_BUILT = {**FAMILIES, **VARIANTS}


_AUDIO_MODES = ("audio", "audio13", "frames-audio")


def _documents(world: int, videos: str | None, packed: bool, g: torch.Generator, rows: bool = False) -> list[tuple[list[int], list[str]]]:
    """Token ids and visuals (in order) of each document. Unpacked: one document of 24 P tokens, so
    that a zigzag chunk is 12 tokens and the first image (tokens 2 to 17) straddles its end.
    Packed: three documents of 23, 7 and 47 tokens, the middle one without an image (the Omni
    thinkers: the first document's item a video). Rows: that
    unpacked document and one as long with its images elsewhere, each a row of the batch."""
    def text(n):
        return torch.randint(0, AUDIO_END if videos in _AUDIO_MODES else END, (n,), generator=g).tolist()

    def visual(kind, i=0):  # i: the item's place in its document
        if videos == "anyres":
            return [IMAGE] * (14 if i == 0 else 16)
        if videos == "onevision":
            return [IMAGE] * 14 if kind == "image" else [VIDEO] * 16
        if kind == "audio":
            return [AUDIO_START] + [AUDIO] * (13 if videos == "audio13" else TOKENS) + [AUDIO_END]
        if videos == "rows":  # Mistral 3: a document's second image is half as tall (see _mistral3_visuals)
            return [IMAGE] * 4 + ([END] + [IMAGE] * 4) * (3 if i == 0 else 1)
        if kind == "video" and videos in ("frames", "frames-audio"):
            return [START] + [VIDEO] * (TOKENS // 2) + [END] + text(1) + [START] + [VIDEO] * (TOKENS // 2) + [END]
        return [START] + [IMAGE if kind == "image" else VIDEO] * TOKENS + [END]

    # the second item: a video, an audio clip, or (Mistral 3, LLaVA-NeXT, ...) a second image
    second = "video" if videos in ("whole", "frames", "onevision") else "audio" if videos in _AUDIO_MODES else "image"
    if not packed:
        leads = (1, 9) if rows else (1,)
        docs = [text(lead) + visual("image") + text(6 - lead // 2) + visual(second, 1) for lead in leads]
        return [(ids + text(24 * world - len(ids)), ["image", second]) for ids in docs]
    first = "video" if videos in _AUDIO_MODES else "image"  # the Omni thinkers' and Gemma 4's videos beside their audio and images
    return [(text(1) + visual(first) + text(4), [first]),
            (text(7), []),
            (text(3) + visual(second) + text(6) + visual("image", 1) + text(2), [second, "image"])]


GLM = ("glm4v", "glm4v_moe", "glm46v")
"""Families whose video tokens are image tokens typed 2 in ``mm_token_type_ids``."""


def _inputs(ids: list[int], kinds: list[str], visuals, g_state, prefix_lm: bool = False, glm: bool = False) -> dict:
    g = torch.Generator()
    g.set_state(g_state)
    input_ids = torch.tensor([ids])
    out = {"input_ids": input_ids, **visuals(kinds, g)}
    out["mm_token_type_ids"] = (input_ids == IMAGE).int() + 2 * (input_ids == VIDEO).int()
    if glm:  # a video's tokens are image tokens, told apart by their type (2)
        out["input_ids"] = input_ids.masked_fill(input_ids == VIDEO, IMAGE)
    out["token_type_ids"] = (input_ids == IMAGE).int()  # Gemma 3's: its image tokens see each other both ways
    if prefix_lm:  # PaliGemma's: 0 on the prefix (through its first image and two tokens more), which sees itself both ways; 1 after
        prefix = (ids.index(END) if END in ids else 0) + 3
        out["token_type_ids"] = (torch.arange(len(ids)) >= prefix).int()[None]
    return out


def _glm_frames_as_images(kinds: list[str], g: torch.Generator) -> dict:
    """GLM's visuals for its one-process reference: transformers' GLM forward cannot take an image and a video in one
    document (its image mask takes the video's tokens too), so each video frame goes in as an image of its patches, in
    the document's order. The same numbers as a video's: its tower encodes a video frame by frame, as images, and
    numbers each frame's positions from its own grid row (t = 1) either way."""
    items = [_qwen_item(kind, g) for kind in kinds]
    for item in items:
        if "pixel_values_videos" in item:
            t, h, w = item.pop("video_grid_thw")[0].tolist()
            item["pixel_values"], item["image_grid_thw"] = item.pop("pixel_values_videos"), torch.tensor([[1, h, w]] * t)
    return _joined(items)


def _labels(input_ids: torch.Tensor) -> torch.Tensor:
    return input_ids.masked_fill((input_ids == IMAGE) | (input_ids == VIDEO) | (input_ids == AUDIO), -100)


def _drop_untaken(model, inputs: dict) -> dict:
    """``inputs`` without the token types the model's forward does not take."""
    taken = inspect.signature(type(model).forward).parameters
    return {k: v for k, v in inputs.items() if k not in ("mm_token_type_ids", "token_type_ids") or k in taken}


@contextlib.contextmanager
def _encoded(model):
    """How many rows (Qwen's patches, LLaVA's and SmolVLM's images) the vision tower encodes, and
    audio clips the audio tower does (Qwen2.5-Omni)."""
    tower = next(getattr(model.model, name) for name in ("visual", "vision_tower", "vision_model") if hasattr(model.model, name))
    rows = [0]

    def count(module, args, kwargs):
        rows[0] += (args[0] if args else next(iter(kwargs.values()))).shape[0]

    def count_clips(module, args, kwargs):  # Omni's clips by their lengths; Gemma 4's [clips, frames, mels]
        rows[0] += kwargs["feature_lens"].shape[0] if "feature_lens" in kwargs else args[0].shape[0]

    handles = [tower.register_forward_pre_hook(count, with_kwargs=True)]
    if getattr(model.model, "audio_tower", None) is not None:  # Gemma 4 without its audio config: None
        handles.append(model.model.audio_tower.register_forward_pre_hook(count_clips, with_kwargs=True))
    try:
        yield rows
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def _decoder_positions(model):
    """The position ids each call of the text decoder gets (after ulysses_sp's split: its hook runs first)."""
    from ulysses_sp.models.image_text import text_decoder

    seen = []

    def record(decoder, args, kwargs):
        pos = kwargs.get("position_ids")
        seen.append(pos if pos is not None else torch.arange(kwargs["inputs_embeds"].shape[1])[None])

    handle = text_decoder(model).register_forward_pre_hook(record, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def _one_process(model, docs, visuals, states) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The loss of every document computed on its own (summed token losses over all targets), the
    positions its text decoder got, end to end, and the rows its vision tower encoded."""
    total, count, positions, encoded = 0, 0, [], 0
    for (ids, kinds), state in zip(docs, states):
        glm = model.config.model_type in GLM
        inputs = _drop_untaken(model, _inputs(ids, kinds, _glm_frames_as_images if glm else visuals, state, model.config.model_type == "paligemma", glm))
        if glm:  # every frame an image (type 1), as _glm_frames_as_images gives them
            inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE).int()
        if model.config.model_type in AUDIO_FAMILIES:  # Omni numbers its 3-D positions only given a mask, as its processor gives
            inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        with _decoder_positions(model) as seen, _encoded(model) as rows:
            logits = model(**inputs).logits
        encoded += rows[0]
        targets = F.pad(_labels(inputs["input_ids"])[:, 1:], (0, 1), value=-100)
        total = total + F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")
        count += int((targets != -100).sum())
        positions.append(seen[0])
    axes = max(p.shape[0] if p.dim() == 3 else 0 for p in positions)  # a text-only document's positions are [B, S]
    return total / count, torch.cat([p.expand(axes, *p.shape) if axes and p.dim() == 2 else p for p in positions], dim=-1), encoded


_REFERENCES: dict = {}
"""(family, world, packed) -> the one-process run every layout of it is compared with, kept by the
rank for the next layout's case (the model, its data and gradients do not depend on the layout)."""


def _reference(family: str, world: int, packed: bool, rows: bool = False) -> tuple:
    key = (family, world, packed, rows)
    if key not in _REFERENCES:
        make, visuals, videos = _BUILT[family]
        torch.manual_seed(0)
        ref = make().double()
        g = torch.Generator().manual_seed(1)
        docs = _documents(world, videos, packed, g, rows)
        states = []
        for _, kinds in docs:  # each document's pixels from its own generator state: the same in the row and alone
            states.append(g.get_state())
            visuals(kinds, g)
        ref_loss, ref_positions, ref_encoded = _one_process(ref, docs, visuals, states)
        ref_loss.backward()
        _REFERENCES[key] = ref, docs, states, ref_loss.detach(), ref_positions, ref_encoded
    return _REFERENCES[key]


LIFTED = ("paligemma", "glm4v_moe", "kimi_k25", "gemma4", "gemma4-causal", "gemma4-audio")
"""Families compared with float32 lifted to float64 (`fp64_throughout`): Gemma's RMSNorm and GLM's and DeepSeek's MoE routers compute in
float32 inside an fp64 model, which leaves their weights' gradients 1e-7 apart between a whole row and its shards (Gemma 4's vision
pooler too)."""


def vlm_parity(env: Env, family: str, layout: str, packed: bool, as_rows: bool = False) -> dict:
    from .coverage_cases import fp64_throughout

    with fp64_throughout() if family in LIFTED else contextlib.nullcontext():
        return _vlm_parity(env, family, layout, packed, as_rows)


def _vlm_parity(env: Env, family: str, layout: str, packed: bool, as_rows: bool) -> dict:
    visuals = _BUILT[family][1]
    ref, docs, states, ref_loss, ref_positions, ref_encoded = _reference(family, env.world, packed, as_rows)

    model = copy.deepcopy(ref)
    model.zero_grad(set_to_none=True)
    topo = env.topo(layout=layout)
    usp.apply_sequence_parallel(model, topo)
    parts = [_inputs(ids, kinds, visuals, state, family == "paligemma", family in GLM) for (ids, kinds), state in zip(docs, states)]
    batch = {}
    for key in {k for p in parts for k in p}:
        held = [p[key] for p in parts if key in p]  # ids, token types and SmolVLM's [1, N, ...] images join along dim 1
        rows_of_images = held[0].dim() == 5 and family in ("smolvlm", "idefics3")  # [1, N, ...]; LLaVA-NeXT's [N, tiles, ...]
        by_token = key in ("input_ids", "mm_token_type_ids", "token_type_ids")
        batch[key] = torch.cat(held, dim=1 if by_token and not as_rows or rows_of_images else 0)
    batch = _drop_untaken(model, batch)
    batch["labels"] = _labels(batch["input_ids"])
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(len(ids)) for ids, _ in docs])[None]
    local = usp.shard_batch(batch, topo)
    with _decoder_positions(model) as seen, _encoded(model) as rows:
        logits = model(**usp.model_inputs(local)).logits
    encoded = int(usp.comm.all_reduce_sum(torch.tensor([rows[0]]), topo.sp_group))
    # this rank's positions are its shard of each document's own, numbered alone (padding: -1, not compared)
    if as_rows:
        ref_positions = torch.cat(ref_positions.chunk(len(docs), dim=-1), dim=-2)
    expected = F.pad(ref_positions, (0, local["multimodal"]["input_ids"].shape[1] - ref_positions.shape[-1]), value=-1)
    cu = local.get("cu_seqlens")
    expected = usp.shard_sequence(expected, topo, dim=-1, cu_seqlens=None if cu is None else cu.tolist())
    positions_equal = bool(((seen[0] == expected) | (expected == -1)).all())
    loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    loss.backward()
    with torch.no_grad():  # the fused head-and-loss (the Trainer's tiled_loss) through the same split
        tiled = usp.causal_lm_loss(model, local, topo, chunk_tokens=8).item()
    # each gradient's error relative to its norm, or to 1e-8 of the whole gradient's where it is smaller
    # (CLIP's key bias: its exact gradient is 0, softmax ignores a score added to a whole row)
    floor = 1e-8 * torch.cat([q.grad.flatten() for q in ref.parameters() if q.grad is not None]).norm()
    both, missing = [], []
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if (p.grad is None) != (q.grad is None):
            if q.grad is not None or bool(p.grad.any()):  # zeros where one process has none: an unused parameter (LLaVA's
                missing.append(name)                       # post-layernorm) that every rank keeps in its graph
        elif q.grad is not None:
            both.append((name, p.grad, q.grad))
    held = usp.comm.all_gather_ints([p.grad is not None for p in model.parameters()], topo.sp_group, torch.device("cpu"))
    summed = usp.comm.all_reduce_sums([g for _, g, _ in both], topo.sp_group)
    errors = {name: ((s - q).norm() / torch.maximum(q.norm(), floor)).item() for (name, _, q), s in zip(both, summed)}
    usp.remove_sequence_parallel(model)
    assert "get_audio_features" not in vars(model.model)  # Gemma 4's, shadowed while split
    worst = max(errors, key=errors.get)
    return {"loss": loss.item(), "ref_loss": ref_loss.item(), "tiled_loss": tiled, "logits": tuple(logits.shape), "missing": missing, "positions_equal": positions_equal,
            "grads_alike": all(h == held[0] for h in held),
            "padded": local["multimodal"]["input_ids"].shape[1], "encoded": (rows[0], encoded, ref_encoded),
            "worst": (worst, errors[worst]), "vision_grad": max(v for k, v in errors.items() if "visual" in k or "vision" in k),
            "params": len(errors)}


PLACEMENTS = [("zigzag", False), ("zigzag", True), ("balanced", False), ("balanced", True), ("contiguous", True)]
"""(layout, packed): contiguous packed only, where the third document's images straddle the boundary at every P."""
AUDIO_PLACEMENTS = [("zigzag", False), ("zigzag", True), ("balanced", True), ("contiguous", True)]
"""Gemma 4 with its audio tower: every layout, packed, and zigzag unpacked (the clip across a shard boundary)."""

for _family in FAMILIES:
    for _layout, _packed in PLACEMENTS:
        case(f"vlm/{_family}/{_layout}{'-packed' if _packed else ''}", (2, 3, 4))(
            lambda env, f=_family, lay=_layout, p=_packed: vlm_parity(env, f, lay, p))
case("vlm/gemma3/zigzag-rows", (2, 3, 4))(lambda env: vlm_parity(env, "gemma3", "zigzag", False, as_rows=True))  # each row its own blocks
case("vlm/gemma4-causal/zigzag-packed", (2, 3, 4))(lambda env: vlm_parity(env, "gemma4-causal", "zigzag", True))
for _layout, _packed in AUDIO_PLACEMENTS:
    case(f"vlm/gemma4-audio/{_layout}{'-packed' if _packed else ''}", (2, 3, 4))(lambda env, lay=_layout, p=_packed: vlm_parity(env, "gemma4-audio", lay, p))


def planted_blocks_cut_at_shards(env: Env, layout: str, packed: bool) -> dict:
    """Control: Gemma 3's image blocks cut at the layout's chunk edges, as if each rank had found them
    in its own shard of the token types (and so all ranks agree on them). The parity case must see it."""
    from ulysses_sp.models import image_text

    honest = image_text.image_blocks

    def cut(types, cu_seqlens=None, marker=(1,)):
        n = types.shape[1] // (usp.layout.chunks_per_rank(layout, types.shape[1], env.world) * env.world)  # a chunk's tokens
        return tuple(tuple((max(a, e), min(b, e + n)) for a, b in row for e in range(a - a % n, b, n))
                     for row in honest(types, cu_seqlens, marker))

    image_text.image_blocks = cut
    try:
        return vlm_parity(env, "gemma3", layout, packed)
    finally:
        image_text.image_blocks = honest


for _layout, _packed in (("zigzag", False), ("zigzag", True)):
    case(f"vlm-planted/gemma3-blocks-cut/{_layout}{'-packed' if _packed else ''}", (2, 3, 4))(
        lambda env, lay=_layout, p=_packed: planted_blocks_cut_at_shards(env, lay, p))


def planted_gemma4_blocks_on_every_layer(env: Env, family: str = "gemma4", packed: bool = False) -> dict:
    """Control: Gemma 4's image blocks applied on every layer (as Gemma 3 applies them): on its full layers, which
    transformers keeps causal, and, for ``gemma4-causal``, on every layer of a model whose images attend causally.
    The parity cases must see it."""
    from ulysses_sp.models import image_text

    honest = image_text.takes_blocks
    image_text.takes_blocks = lambda attention, sliding_window: True
    try:
        return vlm_parity(env, family, "zigzag", packed)
    finally:
        image_text.takes_blocks = honest


def planted_glm_stream_in_kind_order(env: Env, layout: str = "zigzag", packed: bool = True) -> dict:
    """Control: GLM's image and video rows handed to its forward in kind order (every video's, then every image's), not
    in the order of this rank's tokens. It shows where a rank holds an image's tokens before a video's: under balanced
    (packed or not) at P=2, 3, 4, contiguous and zigzag unpacked at P=2; the other placements' ranks hold videos first."""
    from ulysses_sp.models import image_text

    honest = image_text._one_stream

    def kind_order(model, topo, encoded, kwargs, cu):
        rows = torch.cat([encoded[kind].pooler_output[0] for kind in ("video", "image") if kind in encoded])
        return {"image": image_text.EncodedVisuals(pooler_output=(rows,))}

    image_text._one_stream = kind_order
    try:
        return vlm_parity(env, "glm4v", layout, packed)
    finally:
        image_text._one_stream = honest


def planted_gemma4_audio_rows_reversed(env: Env) -> dict:
    """Control: Gemma 4's audio rows handed to its merge in reverse order (each clip's tokens then get another's features)."""
    from ulysses_sp.models import image_text

    honest = image_text._encoded_audio

    def reversed_rows(model, state):
        handle = honest(model, state)
        shadow = model.model.__dict__["get_audio_features"]

        def flipped(*args, **kwargs):
            merging = "audio" in state  # the forward's call, not the encoding's
            out = shadow(*args, **kwargs)
            if merging:
                out.pooler_output = out.pooler_output.flip(1)
            return out

        model.model.__dict__["get_audio_features"] = flipped
        return handle

    image_text._encoded_audio = reversed_rows
    try:
        return vlm_parity(env, "gemma4-audio", "zigzag", False)
    finally:
        image_text._encoded_audio = honest


case("vlm-planted/gemma4-blocks-on-full-layers", (2, 4))(planted_gemma4_blocks_on_every_layer)
case("vlm-planted/glm-stream-in-kind-order", (2, 3, 4))(lambda env: planted_glm_stream_in_kind_order(env, "balanced", True))
case("vlm-planted/gemma4-audio-reversed", (2,))(planted_gemma4_audio_rows_reversed)
case("vlm-planted/gemma4-causal-blocks", (2,))(lambda env: planted_gemma4_blocks_on_every_layer(env, "gemma4-causal", True))


HIDDEN = 512
"""The text width of the embed-memory case: wide enough that the row's embeddings, not the tiny vision tower, dominate."""


def embed_memory_row(images: int, g: torch.Generator) -> dict:
    """A row of ``images`` images of 16 tokens, each after 14 text tokens and between Qwen's markers,
    with labels and token types."""
    ids = []
    for _ in range(images):
        ids += torch.randint(0, END, (14,), generator=g).tolist() + [START] + [IMAGE] * TOKENS + [END]
    batch = _inputs(ids, ["image"] * images, _qwen_visuals, g.get_state())
    batch["labels"] = _labels(batch["input_ids"])
    return batch


@case("vlm/embed-memory", (1, 2, 4))
def embed_memory(env: Env) -> dict:
    """Per-rank peak bytes (``peak_until``) from the model's call to its text decoder's input, with
    autograd recording, for a row of 16 images (256 image tokens among 512), and the images each
    rank's vision tower encodes."""
    from ulysses_sp.models.image_text import text_decoder
    from ulysses_sp.testing.memory import peak_until

    torch.manual_seed(0)
    model = _qwen2_vl(hidden=HIDDEN).double()
    topo = env.topo()
    usp.apply_sequence_parallel(model, topo)
    inputs = usp.model_inputs(usp.shard_batch(embed_memory_row(16, torch.Generator().manual_seed(2)), topo))
    with _encoded(model) as rows:
        peak, seen = peak_until(text_decoder(model), lambda: model(**inputs))
    usp.remove_sequence_parallel(model)
    return {"peak": peak, "images": rows[0] // 64, "embeds": tuple(seen["inputs_embeds"].shape)}


VERIFIED = {2: ("LlavaConfig", "Qwen2_5_VLConfig", "Qwen3VLMoeConfig", "SmolVLMConfig", "Qwen3_5Config", "Qwen3_5MoeConfig", "Gemma3Config",
                "Kimi_K25Config", "LlavaNextVideoConfig"),
            3: ("LlavaConfig", "Qwen3VLConfig", "InternVLConfig", "Mistral3Config", "Glm4vConfig", "Glm46VConfig", "PaliGemmaConfig",
                "Qwen2_5OmniThinkerConfig", "LlavaOnevisionConfig"),
            4: ("SmolVLMConfig", "Qwen2VLConfig", "Idefics3Config", "Glm4vMoeConfig", "Gemma4Config", "Qwen3OmniMoeThinkerConfig",
                "LlavaNextConfig")}
"""The default (full-size) configs ``verify_sequence_parallel`` shrinks and checks, per P: each family at some P,
each way of giving images (patch rows, [N, ...] and [B, N, ...] pixels) at every P, LLaVA-NeXT's anyres tiles and its
videos' runs at one P each. Qwen3.5 (Gated DeltaNet and attention layers, its DeltaNet under the ulysses mixer) only here,
with 2 layers, one of each kind. Gemma 4's default config has
no vision tower: its vision config's defaults, an audio tower (dropped: it casts to float32 inside fp64), its images' blocks on and its last 12
layers reusing earlier layers' keys and values, as E2B/E4B's (`_SETTINGS`)."""
VERIFIED_ONLY = ("qwen3_5", "qwen3_5_moe")
"""Image-text families held exact by the verify case alone (the parity cases above hold the others)."""
_HYBRID_TEXT = dict(text_config=dict(num_hidden_layers=2, layer_types=["linear_attention", "full_attention"]))
_SETTINGS = {"Qwen3_5Config": _HYBRID_TEXT, "Qwen3_5MoeConfig": _HYBRID_TEXT,
             "Gemma4Config": dict(vision_config={}, audio_config={}, text_config=dict(use_bidirectional_attention="vision", num_kv_shared_layers=12))}


@case("vlm/verify", (2, 3, 4))
def vlm_verify(env: Env) -> dict:
    """verify_sequence_parallel on each family's default config (shrunk, random images), and on
    Qwen2-VL with a planted defect: the packed row's document boundaries dropped on their way to
    the model (its documents then attend to each other)."""
    import transformers

    topo = env.topo()
    out = {name: str(usp.verify_sequence_parallel(getattr(transformers, name)(**_SETTINGS.get(name, {})), topo))
           for name in VERIFIED[env.world]}
    if env.world == 2:
        from ulysses_sp.models import verify

        planted = verify.model_inputs
        verify.model_inputs = lambda local: {k: v for k, v in planted(local).items() if k != "cu_seq_lens_q"}
        try:
            report = usp.verify_sequence_parallel(transformers.Qwen2VLConfig(), topo, raise_on_mismatch=False)
        finally:
            verify.model_inputs = planted
        out["planted"] = (report.passed, report.loss_error, report.worst)
    return out
