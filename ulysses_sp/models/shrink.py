"""``shrink_config``: a small copy of a transformers config that keeps what SP depends on, for
`verify_sequence_parallel` and the family sweep: every kind of layer, head counts, unequal head
dims (multi-head latent attention's; Gemma 4's per-layer ones), layers that reuse an earlier
layer's keys and values (Gemma 3n's and Gemma 4's KV sharing); small widths, vocab and experts.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import transformers

__all__ = ["shrink_config"]

_WIDTHS = {  # attribute: value in the small copy (only where the config has it and it is larger)
    "intermediate_size": 32, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16, "ffn_dim": 32, "n_inner": 32,
    "vocab_size": 96, "kv_lora_rank": 16, "q_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 6,
    "n_routed_experts": 4, "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
    "max_position_embeddings": 512, "head_dim": 8, "rotary_dim": 4, "vocab_size_per_layer_input": 96, "hidden_size_per_layer_input": 8,
    "laurel_rank": 8, "index_topk": 6, "index_n_heads": 8, "index_head_dim": 8, "o_lora_rank": 8,
}
"""v_head_dim 6 against a query/key head dim of 8 + 4 keeps multi-head latent attention's
unequal head dims in the copy; DeepSeek Sparse Attention's indexer keeps 6 keys a query, far
fewer than a row holds, so its choice decides the result."""


def _layer_signature(layer) -> tuple:
    return tuple(sorted({type(m).__name__ for m in layer.modules()}))


def _decoder_layers(model, n: int) -> list:
    """The model's stack of ``n`` layers: its first module list of that length."""
    stacks = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) == n]
    return list(stacks[0]) if stacks else []


_MAMBA_HEADS = (("mamba_n_heads", "mamba_d_head"), ("mamba_num_heads", "mamba_head_dim"), ("n_mamba_heads", "mamba_headdim"), ("num_heads", "head_dim"))
_MAMBA_GROUPS = ("mamba_n_groups", "mamba_ngroups", "n_groups")
_MAMBA_STATES = ("mamba_d_state", "state_size", "ssm_state_size")  # Nemotron-H's is ssm_state_size
_MAMBA_CHUNKS = ("chunk_size", "mamba_chunk_size")


def _shrink_mamba(small, put) -> None:
    """Mamba2 mixers: 4 heads whose dims fill ``mamba_expand * hidden_size`` (the width the mixer
    projects to), a state of at most 16, and scan chunks of 8 tokens: the check's short rows then
    cross chunk boundaries (the shipped 128 or 256 pads each document to one chunk)."""
    hidden, expand = getattr(small, "hidden_size", None), getattr(small, "mamba_expand", getattr(small, "expand", None))
    if not any(isinstance(getattr(small, name, None), int) for name in _MAMBA_STATES):
        return  # not a Mamba config
    for heads_name, dim_name in _MAMBA_HEADS:
        heads = getattr(small, heads_name, None)
        if not isinstance(heads, int):
            continue
        heads = min(heads, 4)
        put(heads_name, heads)
        if dim_name and isinstance(getattr(small, dim_name, None), int):
            put(dim_name, expand * hidden // heads if isinstance(expand, int) and isinstance(hidden, int) else 8)
            if isinstance(getattr(small, "mamba_d_ssm", None), int):
                put("mamba_d_ssm", heads * getattr(small, dim_name))
    for names, most in ((_MAMBA_STATES, 16), (_MAMBA_CHUNKS, 8), (_MAMBA_GROUPS, 2)):  # groups must divide the 4 heads
        for name in names:
            if isinstance(getattr(small, name, None), int) and getattr(small, name) > most:
                put(name, most)


def _shrink_compression(small, put) -> None:
    """DeepSeek-V4: windows of 8 tokens for its heavily compressed layers (128) and its sliding window (128), so that
    the check's short rows make entries of both kinds and cross the window; its compressed sparse layers' 4 stay."""
    rates = getattr(small, "compress_rates", None)
    if not isinstance(rates, dict):
        return
    put("compress_rates", {kind: min(rate, 8) for kind, rate in rates.items()})
    if isinstance(getattr(small, "sliding_window", None), int):
        put("sliding_window", min(small.sliding_window, 8))


def shrink_config(config, min_layers: int = 2) -> transformers.PretrainedConfig:
    """A small copy of a transformers config that keeps what SP depends on.

    Head counts are kept (they decide which backends can run); head dims become 8 (query/key 12
    and value 6 under multi-head latent attention; a layer's own larger head dim 16); MLPs, vocab
    and expert counts shrink; the layers are the shortest prefix that holds every kind of layer
    the full model has (built on the meta device to find them), and where the last layers reuse
    earlier layers' keys and values (``num_kv_shared_layers``), the shortest run of those that
    holds every kind of them.

    Args:
        config (PretrainedConfig): the model's config.
        min_layers: the fewest layers kept (fewer when the model has fewer).

    Returns:
        The small config (a copy; ``config`` is unchanged).
    """
    import transformers

    small = _shrink_widths(config)
    # every kind of layer: its module types on the full model (built without memory), its layer_types entry and its own settings
    n = config.num_hidden_layers
    with torch.device("meta"):
        full = transformers.AutoModelForCausalLM.from_config(small)  # small widths, all n layers
    types = list(getattr(config, "layer_types", None) or [None] * n)
    own = _overrides(small)
    signatures = [_layer_signature(layer) for layer in _decoder_layers(full, n)] or [None] * n
    return _keep_kinds(small, [(sig, kind, repr(own.get(i))) for i, (sig, kind) in enumerate(zip(signatures, types))], min_layers)


def _keep_kinds(small, kinds: list, min_layers: int):
    """``small`` with the layers that hold every one of ``kinds`` (one per layer): the shortest prefix, at
    least ``min_layers``, of those that compute their own keys and values, then the shortest run of the
    last ``num_kv_shared_layers`` (which reuse them: Gemma 3n, Gemma 4) holding every kind of those."""
    n, shared = len(kinds), getattr(small, "num_kv_shared_layers", None) or 0
    head, tail = kinds[:n - shared], kinds[n - shared:]
    keep = next(k for k in range(min(min_layers, len(head)), len(head) + 1) if set(head[:k]) == set(head))
    reuse = next(k for k in range(len(tail) + 1) if set(tail[:k]) == set(tail))
    small = _keep_layers(small, list(range(keep)) + list(range(n - shared, n - shared + reuse)))
    if shared:
        small.num_kv_shared_layers = reuse
    return small


def _overrides(config) -> dict[int, dict]:
    """A heterogeneous config's settings of its own per layer (Gemma 4's full layers' head dim),
    by layer index; empty for a config whose layers all share its settings."""
    spec = getattr(config, "_heterogeneity_spec", None) if getattr(config, "is_heterogeneous", False) else None
    return copy.deepcopy(spec.per_layer_overrides) if spec is not None else {}


def _keep_layers(small, layers: list[int]):
    """``small`` with only the given ``layers`` (indices, in order), no training-time randomness and no
    cache: each per-layer list (``layer_types``, Gemma 3n's MLP widths) and per-layer setting follows them."""
    n, own = small.num_hidden_layers, _overrides(small)
    lists = {name: value for name, value in vars(small).items() if isinstance(value, list) and len(value) == n != len(layers)}
    if own:
        small.per_layer_config = None
    small.num_hidden_layers = len(layers)
    for name, value in lists.items():
        try:
            setattr(small, name, [value[i] for i in layers])
        except AttributeError:  # derived from other fields (Bamba's attn_layer_indices): they still hold
            pass
    if own:
        small.per_layer_config = {new: own[old] for new, old in enumerate(layers) if old in own}
    no_randomness(small)
    small.use_cache = False
    return small


def shrink_text(config):
    """An image-text model's text config, small: as `shrink_config`'s, its kinds of layer read from
    ``layer_types`` and the layers' own settings alone (a hybrid's linear and full attention, Gemma 4's
    full layers and those reusing keys and values), without building the model."""
    small = _shrink_widths(config)
    own, n = _overrides(small), config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [None] * n)
    return _keep_kinds(small, [(kind, repr(own.get(i))) for i, kind in enumerate(types)], 2)


def _shrink_widths(config):
    """A copy of ``config`` with `shrink_config`'s small widths, all its layers; a layer's own
    setting (`_overrides`) shrinks with the global one it departs from (`_shrink_own`)."""
    small = copy.deepcopy(config)
    own = _overrides(small)
    if own:
        small.per_layer_config = None  # its global fields readable while they shrink
        before = {name: getattr(small, name, None) for settings in own.values() for name in settings}

    def put(name, value):
        try:
            setattr(small, name, value)
        except AttributeError:  # a property derived from other fields (Falcon's head_dim)
            pass

    heads = getattr(small, "num_attention_heads", None)
    for name, value in _WIDTHS.items():
        current = getattr(small, name, None)
        if isinstance(current, int) and not isinstance(current, bool) and current > value:
            put(name, value)
        elif isinstance(current, list) and current and all(isinstance(c, int) and c > value for c in current):
            put(name, [value] * len(current))  # one per layer (Gemma 3n's MLP widths)
    if not isinstance(heads, int) and isinstance(getattr(small, "hidden_size", None), int) and small.hidden_size > 64:
        put("hidden_size", 64)  # no attention heads (Mamba, RWKV): a narrow width
        for name in ("attention_hidden_size",):
            if isinstance(getattr(small, name, None), int):
                put(name, 64)
    if isinstance(heads, int):
        put("hidden_size", heads * 8)
        for name, value in (("head_dim", 8), ("num_key_value_heads", heads)):  # left None by some default configs
            if hasattr(small, name) and getattr(small, name) is None:
                put(name, value)
    if getattr(small, "num_experts_per_tok", 0) is None and any(isinstance(getattr(small, n, None), int) for n in ("n_routed_experts", "num_experts")):
        put("num_experts_per_tok", 2)  # DeepSeek-V2's default config routes to None experts
    if getattr(small, "qk_nope_head_dim", None) is not None and getattr(small, "qk_rope_head_dim", None) is not None:
        put("qk_head_dim", small.qk_nope_head_dim + small.qk_rope_head_dim)
        put("head_dim", small.qk_rope_head_dim)
    _shrink_mamba(small, put)
    _shrink_compression(small, put)
    try:  # what the config derives from the widths (Zamba2's attention_hidden_size, 2 x hidden), derived again
        small.__post_init__()
    except (AttributeError, TypeError, ValueError, KeyError):  # a config without one, or one that cannot run twice: as set
        pass
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token = getattr(small, name, None)
        if isinstance(token, int) and token >= small.vocab_size:
            put(name, small.vocab_size - 1)
    if own:
        small.per_layer_config = None  # as __post_init__ may have set it again, from the defaults
        small.per_layer_config = {i: {name: _shrink_own(value, before[name], getattr(small, name, None)) for name, value in settings.items()}
                                  for i, settings in own.items()}
    return small


def _shrink_own(value, before, after):
    """A layer's own setting ``value`` where the global one shrank from ``before`` to ``after``:
    the small global value where they were equal, twice or half of it where the layer's was larger
    or smaller (Gemma 4's full layers' head dim 512 beside 256 becomes 16 beside 8)."""
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (value, before, after)) or before == after:
        return value
    return after if value == before else 2 * after if value > before else max(1, after // 2)


_RANDOM = ("drop", "jitter")
"""Config fields and module attributes of training-time randomness (dropout, layer drop, router
jitter): one process and SP draw different random numbers, so the check runs without them."""


def no_randomness(config_or_model) -> None:
    """Zero every float field named like dropout, layer drop or jitter, in a config or in each
    module of a built model (whose ``nn.Dropout`` and functional-dropout floats it also zeroes)."""
    objects = [config_or_model] if not isinstance(config_or_model, torch.nn.Module) else list(config_or_model.modules())
    for obj in objects:
        if isinstance(obj, torch.nn.Dropout):
            obj.p = 0.0
        for name, value in list(vars(obj).items()):
            if isinstance(value, float) and value > 0 and any(w in name for w in _RANDOM):
                try:
                    setattr(obj, name, 0.0)
                except AttributeError:  # a property derived from other fields
                    pass


_MAX_SHRUNK_PARAMETERS = 250_000_000


def check_small(config) -> None:
    """Refuse a shrunk copy that is still large (widths under names ``shrink_config`` does not
    know), before it is built in fp64 on every rank."""
    import transformers

    with torch.device("meta"):
        auto = transformers.AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else transformers.AutoModelForCausalLM
        n = sum(p.numel() for p in auto.from_config(config).parameters())
    if n > _MAX_SHRUNK_PARAMETERS:
        raise ValueError(f"the shrunk copy of {type(config).__name__} still has {n / 1e6:.0f}M parameters (its widths use names "
                         "shrink_config does not know); pass a small config of the same architecture with shrink=False")


