"""Tiny random-init configs of many transformers families, built in code (no hub access), for
the coverage check and the exactness of SP across families: those that attend through the
attention interface, those that compute attention in their own code, and hybrids."""

from __future__ import annotations

_ATTN = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, attention_dropout=0.0, use_cache=False)

FAMILIES = {
    # attention through transformers' attention interface: exact under SP
    "llama": ("LlamaConfig", dict(_ATTN, head_dim=8)),
    "gpt2": ("GPT2Config", dict(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=256, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                use_cache=False)),
    "gpt_neox": ("GPTNeoXConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                       max_position_embeddings=256, attention_dropout=0.0, hidden_dropout=0.0, use_cache=False)),
    "starcoder2": ("Starcoder2Config", dict(_ATTN, residual_dropout=0.0, embedding_dropout=0.0, sliding_window=None)),
    "mixtral": ("MixtralConfig", dict(_ATTN, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=None)),
    "gemma3": ("Gemma3TextConfig", dict(_ATTN, head_dim=8, query_pre_attn_scalar=8, sliding_window=8,
                                        layer_types=["sliding_attention", "full_attention"])),
    # multi-head latent attention: value head dim 6, query/key head dim 8 + 4
    "deepseek_v3": ("DeepseekV3Config", dict(_ATTN, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                             n_group=1, topk_group=1, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6)),
    # learned attention sinks (s_aux) beside alternating sliding (window 8) and full layers
    "gpt_oss": ("GptOssConfig", dict(_ATTN, head_dim=8, num_local_experts=2, num_experts_per_tok=1, sliding_window=8,
                                     layer_types=["sliding_attention", "full_attention"], rope_parameters={"rope_type": "default", "rope_theta": 1e4})),
    # Llama 4: a chunked layer (chunks of 8 tokens) and a NoPE layer whose query temperature grows with the token's index
    # (floor_scale 4, so it changes within a row of a few dozen tokens); MoE in both
    "llama4_text": ("Llama4TextConfig", dict(_ATTN, head_dim=8, intermediate_size_mlp=48, attention_chunk_size=8, floor_scale=4, attn_scale=0.5,
                                             no_rope_layers=[1, 0], num_local_experts=2, num_experts_per_tok=1)),
    "opt": ("OPTConfig", dict(vocab_size=64, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=256,
                              word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, use_cache=False)),
    # BERT-style and Whisper decoders; BioGPT with its default dropout (verify runs without it)
    "bert-decoder": ("BertConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=256, is_decoder=True, hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1)),
    "whisper": ("WhisperConfig", dict(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48, encoder_layers=1,
                                      encoder_attention_heads=4, encoder_ffn_dim=48, max_target_positions=256, pad_token_id=0, bos_token_id=1,
                                      eos_token_id=2, decoder_start_token_id=1, use_cache=False)),
    "biogpt": ("BioGptConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                    max_position_embeddings=256, use_cache=False)),
    # BERT without is_decoder attends both ways; BART-style decoders number positions themselves
    "bert-bidirectional": ("BertConfig", dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                              max_position_embeddings=256, is_decoder=False)),
    "bart": ("BartConfig", dict(vocab_size=64, d_model=32, decoder_layers=2, decoder_attention_heads=4, decoder_ffn_dim=48, encoder_layers=1,
                                encoder_attention_heads=4, encoder_ffn_dim=48, max_position_embeddings=256, use_cache=False)),
    # attention in the model's own code
    "bloom": ("BloomConfig", dict(vocab_size=64, hidden_size=32, n_layer=2, n_head=4, use_cache=False)),
    "falcon-alibi": ("FalconConfig", dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=True, use_cache=False)),
    "falcon-rotary": ("FalconConfig", dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, alibi=False, use_cache=False)),
    "mpt": ("MptConfig", dict(vocab_size=64, d_model=32, n_heads=4, n_layers=2, max_seq_len=256, use_cache=False)),
    # DeepSeek Sparse Attention: an indexer keeping 6 of the earlier keys for each query (8 heads of 8), latent attention over those
    "deepseek_v32": ("DeepseekV32Config", dict(_ATTN, num_key_value_heads=4, moe_intermediate_size=16, n_routed_experts=4, num_experts_per_tok=2,
                                               n_group=1, topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=16,
                                               qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=6, index_topk=6, index_n_heads=8, index_head_dim=8)),
    # DeepSeek-V4: a sliding layer (window 8), a compressed sparse one (entries of 4 tokens, 6 chosen) and a heavily compressed one
    # (entries of 8), one K=V head of 16 (RoPE on 4), sinks, hyper-connections; hash-routed MoE in its first layers
    "deepseek_v4": ("DeepseekV4Config", dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, head_dim=16,
                                             partial_rotary_factor=0.25, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=8,
                                             layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
                                             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
                                             mlp_layer_types=["hash_moe", "moe", "moe"], moe_intermediate_size=16, n_routed_experts=4,
                                             num_experts_per_tok=2, index_topk=6, index_n_heads=8, index_head_dim=8, max_position_embeddings=256,
                                             use_cache=False)),
    # hybrids: token mixers other than attention
    "qwen3_next": ("Qwen3NextConfig", dict(_ATTN, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                           linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    "qwen3_next_12kh": ("Qwen3NextConfig", dict(_ATTN, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=24,
                                                linear_num_key_heads=12, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)),
    "qwen3_5": ("Qwen3_5TextConfig", dict(_ATTN, head_dim=8, layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
                                          linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4)),
    "lfm2": ("Lfm2Config", dict(_ATTN, layer_types=["conv", "full_attention"], conv_L_cache=3)),
    # RWKV: a recurrence in its "attention" and a token shift in its feed-forward; Mamba2 alone: no attention, no positions
    "rwkv": ("RwkvConfig", dict(vocab_size=64, hidden_size=32, attention_hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                context_length=256, use_cache=False)),
    "mamba2": ("Mamba2Config", dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16, expand=2, state_size=8,
                                    n_groups=1, conv_kernel=4, chunk_size=8, use_cache=False)),
    "bamba": ("BambaConfig", dict(_ATTN, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_d_state=8, mamba_n_groups=1,
                                  mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=8)),
    # 12 Mamba2 heads in 12 groups: ulysses splits both at P = 2, 3 and 4
    "bamba_12h": ("BambaConfig", dict(_ATTN, attn_layer_indices=[1], mamba_n_heads=12, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=12,
                                      mamba_d_conv=4, mamba_expand=3, mamba_chunk_size=8)),
    # Zamba2: Mamba2 layers and hybrid layers (a shared attention block beside a Mamba2 decoder layer)
    "zamba2": ("Zamba2Config", dict(vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                                    intermediate_size=48, mamba_d_state=8, mamba_headdim=8, mamba_ngroups=1, n_mamba_heads=8, mamba_expand=2,
                                    layers_block_type=["mamba", "hybrid", "mamba"], num_mem_blocks=1, max_position_embeddings=256,
                                    chunk_size=8, use_cache=False)),
    # Kimi Linear: Kimi Delta Attention (per-channel decay) beside multi-head latent attention
    "kimi_linear": ("KimiLinearConfig", dict(_ATTN, num_key_value_heads=4, layer_types=["linear_attention", "full_attention"],
                                             mlp_layer_types=["dense", "sparse"], moe_intermediate_size=16, num_local_experts=4,
                                             num_experts_per_tok=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=4, qk_nope_head_dim=8,
                                             v_head_dim=6, linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0,
                                             bos_token_id=1, eos_token_id=2)),
    # MiniMax: lightning attention (a linear attention with a fixed per-head decay, in blocks of 8 here) beside softmax attention
    "minimax": ("MiniMaxConfig", dict(_ATTN, head_dim=8, layer_types=["linear_attention", "full_attention"], block_size=8,
                                      num_local_experts=4, num_experts_per_tok=2)),
}
FAMILIES["kimi_linear_12h"] = (FAMILIES["kimi_linear"][0], dict(FAMILIES["kimi_linear"][1], linear_num_heads=12))
"""12 Kimi Delta Attention heads: ulysses splits them at P = 2, 3 and 4."""
EXACT = ("llama", "gpt2", "gpt_neox", "starcoder2", "mixtral", "gemma3", "deepseek_v3", "gpt_oss", "llama4_text", "opt", "bert-decoder", "whisper", "biogpt")
HYBRID = ("qwen3_next", "qwen3_5", "lfm2", "bamba", "rwkv", "mamba2", "zamba2", "kimi_linear", "minimax")
"""Exact under SP through a mixer strategy for their Gated DeltaNet, short-convolution, Mamba2, RWKV, Kimi Delta Attention and
lightning attention layers."""
MIXER_HEADS = {"qwen3_next": (4, 2), "qwen3_next_12kh": (24, 12), "qwen3_5": (4, 2), "bamba": (4, 1), "bamba_12h": (12, 12), "mamba2": (4, 1),
               "zamba2": (8, 1), "kimi_linear": (4, 4), "kimi_linear_12h": (12, 12)}
"""Families with a Ulysses adapter for their mixer: its (heads, head groups): value and key heads
for Gated DeltaNet, heads and B/C groups for Mamba2, heads twice for Kimi Delta Attention (no shared inputs)."""
HALO_MIXER = ("lfm2",)
"""Families whose mixer is a short convolution the halo strategy runs."""


def auto_mixer(family: str, p: int) -> set[str]:
    """What ``mixer="auto"`` may take for the family's mixers at SP size ``p``: halo for a short
    convolution; ulysses where P divides the heads and P and the groups divide one another (it moves
    the fewest bytes at the tests' lengths), else allgather; MiniMax's lightning attention (no Ulysses
    adapter): state or allgather, whichever is estimated faster at the call's shape (the layout's
    fragments per rank decide at these lengths)."""
    if family in HALO_MIXER:
        return {"halo"}
    if family == "minimax":
        return {"state", "allgather"}
    heads, groups = MIXER_HEADS.get(family, (1, 0))
    return {"ulysses" if groups and heads % p == 0 and (groups % p == 0 or p % groups == 0) else "allgather"}
def _falcon_routed() -> bool:
    """Whether transformers' Falcon attention goes through the attention interface (from 5.25; its ALiBi
    then comes as a float attention mask) rather than its own code."""
    import inspect

    try:
        from transformers.models.falcon.modeling_falcon import FalconAttention
    except ImportError:
        return False
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(FalconAttention.forward)


FALCON_ROUTED = _falcon_routed()
REFUSED = {  # family: the module the refusal names, and why
    "bloom": ("BloomAttention (layer 0", "computes attention in its own code with ALiBi"),
    "falcon-alibi": ("FalconAttention (layer 0", "ALiBi position biases through its attention mask" if FALCON_ROUTED
                     else "computes attention in its own code with ALiBi"),
    **({} if FALCON_ROUTED else {"falcon-rotary": ("FalconAttention (layer 0", "computes attention in its own code,")}),
    "mpt": ("MptAttention (layer 0", "computes attention in its own code with ALiBi"),
    "bart": ("BartDecoder (no layer index, model.decoder)", "numbers token positions itself (its forward takes no position_ids)"),
}
REFUSED_WITHOUT_MIXER = {  # with mixer="none"
    "qwen3_next": ("Qwen3NextGatedDeltaNet (layer 0", "convolution over the sequence (kernel 4)"),
    "lfm2": ("Lfm2ShortConv (layer 0", "convolution over the sequence"),
    "bamba": ("BambaMixer (layer 0", "a state-space"),
    "rwkv": ("RwkvFeedForward (layer 0", "a token shift (RWKV's time mix"),
}
REFUSED_AT_FORWARD = {  # what only the first forward shows
    "bert-bidirectional": ("BertSelfAttention (layer 0)", ": bidirectional self-attention (is_causal=False) is not supported"),
    # transformers 5.25's Falcon attends through the interface but does not forward the model's keyword arguments
    **({"falcon-rotary": ("FalconAttention (layer 0)", " did not receive the packed documents' boundaries")} if FALCON_ROUTED else {}),
}


def config(family: str, **overrides):
    import transformers

    cls, settings = FAMILIES[family]
    return getattr(transformers, cls)(**{**settings, **overrides})
