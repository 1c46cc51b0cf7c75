"""Which modules of a transformers model mix tokens, and whether sequence parallelism covers them.

Under SP each rank holds a slice of every sequence. A module that mixes
information across tokens and does not go through the ``"ulysses_sp"``
attention function sees only that slice: the model still runs, and computes
something else. `check_coverage` finds such modules from the model's
structure (module types, parameters, ``config.layer_types``, the source of each
attention class's ``forward``, whether the embedding model's ``forward`` takes
``position_ids``), never from a list of model names, so families
nobody has tried are caught too; `install_guards` checks at the first
forward what the structure cannot show (an attention layer that did not call
our function, a call without global ``position_ids``). Every check reads only
local, identical state, so every rank raises the same error at the same point,
before any collective of the step that could hang.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import re

import torch
from torch import nn

__all__ = ["Finding", "ATTENTION_LAYER_TYPES", "MIXER", "attention_modules", "find_uncovered", "check_coverage", "other_modalities", "install_guards", "remove_guards"]

ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})
"""``config.layer_types`` entries that are softmax attention through the attention interface."""
CHANNEL_LAYER_TYPES = frozenset({"mlp", "moe"})
"""``config.layer_types`` entries of layers that mix no tokens (Nemotron-H's MLP and MoE layers)."""
_LAYER_TYPE_REASONS = {
    "compressed_sparse_attention": "DeepSeek-V4's compressed sparse attention: keys compressed over windows of 4 tokens aligned "
                                   "to the row's start (not to documents: packed rows would mix), chosen by an indexer",
    "heavily_compressed_attention": "DeepSeek-V4's heavily compressed attention: keys compressed over windows of 128 tokens aligned "
                                    "to the row's start (not to documents: packed rows would mix)",
}
"""What some ``config.layer_types`` entries that ulysses_sp does not split are, for their refusal."""
_POSITIONAL = re.compile(r"position|rotary|\bwpe\b", re.IGNORECASE)
"""Module paths or class names of position embeddings (learned, sinusoidal or rotary)."""

RECURRENT_PARAMETERS = {
    "A_log": "a state-space / linear-attention decay (Mamba, Mamba2, Gated DeltaNet)",
    "dt_bias": "a state-space time step (Mamba2, Gated DeltaNet)",
    "time_decay": "a recurrent time decay (RWKV)",
    "recurrent_param": "a linear recurrence (RG-LRU)",
}
RECURRENT_BUFFERS = {
    "slope_rate": "a linear-attention decay (MiniMax's lightning attention)",
}
"""Buffers that only a recurrence over the sequence reads: a decay fixed at construction, not learned."""
TOKEN_SHIFT_PARAMETERS = ("time_mix", "time_maa")
"""Parameter-name prefixes of RWKV's token shift, which mixes each token with the one before it."""
_ROUTED = ("ALL_ATTENTION_FUNCTIONS",)
_CALLS = "_ulysses_sp_calls"
_HOOKS = "_ulysses_sp_coverage_hooks"
MIXER = "_ulysses_sp_mixer"
"""Where `ulysses_sp.models.token_mixers` keeps a covered mixer's strategy (in the module's ``__dict__``)."""


@dataclasses.dataclass(frozen=True)
class Finding:
    """One module that mixes tokens without SP covering it."""

    path: str
    """Its name in ``model.named_modules()``."""
    cls: str
    layer: int | None
    reason: str
    kind: str = "mixer"
    """``attention`` (attention in the model's own code), ``mixer`` (a convolution or recurrence a
    mixer strategy can take), ``positions`` or ``layer_type``."""

    def __str__(self) -> str:
        layer = f"layer {self.layer}" if self.layer is not None else "no layer index"
        return f"{self.cls} ({layer}, {self.path or 'the model'}): {self.reason}"


def _layer_of(path: str, module=None) -> int | None:
    idx = getattr(module, "layer_idx", None)
    if isinstance(idx, int):
        return idx
    numbers = re.findall(r"(?:^|\.)(\d+)(?:\.|$)", path)
    return int(numbers[0]) if numbers else None


def _mixer_path(path: str) -> str:
    """The module under a decoder layer that owns ``path`` (``model.layers.3.linear_attn``
    for ``model.layers.3.linear_attn.conv1d``); the parent where no layer index is in the path."""
    parts = path.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i + 2])
    return ".".join(parts[:-1])


def _owner(key: str, sources: list[str], modules: dict) -> str:
    """The module a mixer finding names: the layer's child ``key`` (run whole by the allgather
    strategy), or, where that child only wraps a mixer with an adapter or a reach registered (Zamba2's
    hybrid layer: ``mamba_decoder.mamba``), that mixer, the innermost module holding every source."""
    from ..mixers.halo import REACH
    from ..mixers.ulysses import ADAPTERS
    from . import adapters  # noqa: F401 - the families register their classes

    common = []
    for parts in zip(*[p.split(".") for p in sources]):
        if len(set(parts)) > 1:
            break
        common.append(parts[0])
    inner = ".".join(common)
    adapted = len(inner) > len(key) and type(modules.get(inner)).__name__ in set(ADAPTERS) | set(REACH)
    return inner if adapted else key


_COMPUTES = ("softmax", "scaled_dot_product_attention", "flash_attn")
"""What in a forward's source computes softmax attention (the module's own, or routed)."""


def _attention_in(module, path: str, held: list[str]) -> tuple[bool, bool]:
    """Whether the forward of ``module`` or anything it holds outside the mixers ``held`` routes
    attention through the attention interface, and whether any computes attention at all."""
    sources = [_forward_source(type(m)) for n, m in module.named_modules(prefix=path) if not any(_within(n, o) for o in held)]
    routed = any(word in source for source in sources for word in _ROUTED)
    return routed, routed or any(word in source for source in sources for word in _COMPUTES)


@functools.lru_cache(maxsize=None)
def _forward_source(cls) -> str:
    """Once per class: a model repeats one attention class in every layer."""
    try:
        return inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return ""


def routes_attention(module) -> bool:
    """Whether the module's own forward calls transformers' attention interface."""
    return any(word in _forward_source(type(module)) for word in _ROUTED)


def is_attention(module) -> bool:
    """Whether the class name says attention (``...Attention``, ``...Attention2``) or its own forward
    calls the attention interface (LongCat-Flash's ``LongcatFlashMLA``)."""
    return "Attention" in type(module).__name__ or routes_attention(module)


def attention_modules(model, innermost: bool = False) -> list[tuple[str, nn.Module]]:
    """The attention modules (`is_attention`); with ``innermost``, only those without another inside
    (a wrapper's forward need not name the attention interface: the forward check covers it)."""
    named = [(n, m) for n, m in model.named_modules() if is_attention(m)]
    if not innermost:
        return named
    return [(n, m) for n, m in named if not any(is_attention(c) for c in m.modules() if c is not m)]


def _alibi(config) -> bool | None:
    alibi = getattr(config, "alibi", None)
    if alibi is None:
        alibi = getattr(getattr(config, "attn_config", None), "alibi", None)  # MPT
    return alibi


def _own_attention_reason(module, config) -> str:
    alibi = _alibi(config)
    if alibi is None:
        alibi = "alibi" in _forward_source(type(module))
    what = " with ALiBi position biases" if alibi else ""
    return (f"computes attention in its own code{what}, not through transformers' attention interface, "
            "so ulysses_sp cannot route it and each rank would attend only to its own shard")


_ALIBI_THROUGH_MASK = ("takes ALiBi position biases through its attention mask (transformers 5.25's Falcon), which ulysses_sp's "
                       "attention does not apply, so its scores would lack them")


def _within(a: str, b: str) -> bool:
    """Whether module path ``a`` is ``b`` or inside it."""
    return a == b or a.startswith(b + ".")


def _forward_takes(module, name: str) -> bool:
    try:
        return name in inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False


def _named_types(model):
    return [(f"{n} {type(m).__name__}", m) for n, m in model.named_modules()]


def _own_positions(model) -> Finding | None:
    """The model that embeds the tokens (the innermost ``PreTrainedModel`` whose forward takes
    ``input_ids``) must take ``position_ids``: BART-style decoders take none and number positions
    from 0 on every rank, whatever positions the caller passes."""
    from transformers import PreTrainedModel

    embedding = [(n, m) for n, m in model.named_modules() if isinstance(m, PreTrainedModel) and _forward_takes(m, "input_ids")]
    if not embedding or _forward_takes(embedding[-1][1], "position_ids") or not any(_POSITIONAL.search(n) for n, _ in _named_types(model)):
        return None  # (a model without positions, as Mamba, has none to number)
    path, module = embedding[-1]
    return Finding(path, type(module).__name__, None,
                   "numbers token positions itself (its forward takes no position_ids), so each rank would number its shard's "
                   "tokens from 0 and learned or rotary positions would go wrong", "positions")


def find_uncovered(model) -> list[Finding]:
    """Every module of ``model`` that mixes tokens outside the attention interface, with why.
    Empty when SP covers the whole model."""
    config = getattr(model, "config", None)
    modules, reasons = dict(model.named_modules()), {}
    for path, module in modules.items():
        reason, source = None, path.rpartition(".")[0]  # source: the module whose forward mixes (a layer's parent)
        if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
            reason = f"a convolution over the sequence (kernel {module.kernel_size[0]}) at {path}"
        elif isinstance(module, nn.RNNBase):
            reason = f"a recurrent network ({type(module).__name__}) at {path}"
        elif isinstance(module, nn.ZeroPad2d):
            reason = f"a shift along the sequence ({type(module).__name__}) at {path}"
        else:  # a parameter or buffer: its module mixes
            source = path
            params = [name for name in RECURRENT_PARAMETERS if name in module._parameters]
            params += [name for name in RECURRENT_BUFFERS if name in module._buffers]
            shifts = [name for name in module._parameters if name.startswith(TOKEN_SHIFT_PARAMETERS)]
            if params:
                reason = f"{RECURRENT_PARAMETERS.get(params[0]) or RECURRENT_BUFFERS[params[0]]} ({path}.{params[0]})"
            elif shifts:
                reason = f"a token shift (RWKV's time mix: {path}.{shifts[0]})"
        if reason is not None:
            reasons.setdefault(_mixer_path(path), []).append((source, reason))
    reasons = {_owner(key, [source for source, _ in why], modules): [r for _, r in why] for key, why in reasons.items()}
    found: dict[str, Finding] = {}
    covered_layers = set()
    for path, module in attention_modules(model, innermost=True):
        if MIXER in module.__dict__:  # DeepSeek Sparse Attention's layers (config.layer_types "indexed_attention")
            covered_layers.add(_layer_of(path, module))
        if MIXER in module.__dict__ or any(_within(path, owner) for owner in reasons):
            continue  # linear attention (Gated DeltaNet, KDA), or inside a mixer: the mixer found below, run whole
        held = [owner for owner in reasons if _within(owner, path)]  # a layer holding a mixer: what else it holds
        routed, computes = _attention_in(module, path, held)
        if held and not computes:
            continue  # a layer around its mixer (OLMo-hybrid's linear-attention decoder layer): no attention of its own
        if not routed:
            found[path] = Finding(path, type(module).__name__, _layer_of(path, module), _own_attention_reason(module, config), "attention")
        elif _alibi(config):
            found[path] = Finding(path, type(module).__name__, _layer_of(path, module), _ALIBI_THROUGH_MASK, "attention")
    for owner, why in reasons.items():
        owner_module = modules[owner] if owner in modules else model
        if MIXER in owner_module.__dict__:  # under a mixer strategy
            covered_layers.add(_layer_of(owner, owner_module))
            continue
        if owner in found:
            continue
        found[owner] = Finding(owner, type(owner_module).__name__, _layer_of(owner, owner_module),
                               f"mixes tokens outside attention: {'; '.join(why)}; each rank would see only its own shard")
    numbering = _own_positions(model)
    if numbering is not None:
        found.setdefault(numbering.path, numbering)
    types = list(getattr(config, "layer_types", None) or [])
    covered_layers |= {f.layer for f in found.values()}
    for i, kind in enumerate(types):
        if kind not in ATTENTION_LAYER_TYPES | CHANNEL_LAYER_TYPES and i not in covered_layers:
            found[f"config.layer_types[{i}]"] = Finding(
                f"config.layer_types[{i}]", type(config).__name__, i,
                f"config.layer_types marks this layer {kind!r}, {_LAYER_TYPE_REASONS.get(kind, 'a token mixer other than softmax attention')}, "
                "which ulysses_sp does not split",
                "layer_type")
    return sorted(found.values(), key=lambda f: (f.layer if f.layer is not None else -1, f.path))


_OTHER_INPUTS = re.compile(r"pixel_values|^image_|^video_|^audio_|^input_features$|^input_values$|^flattened_patches$|^protein_"
                           r"|^mm_encoder_outputs$")
"""``forward`` parameters of inputs other than text: images, videos, audio features or waveforms, Pix2Struct's
patches, Evolla's proteins, or another modality's encoder outputs."""


def other_modalities(model) -> list[str]:
    """The parameters of the model's ``forward`` that take inputs besides text (``pixel_values``,
    ``image_grid_thw``, ``input_features``, ...): empty for a text model."""
    return [n for n in inspect.signature(type(model).forward).parameters if _OTHER_INPUTS.search(n)]


def check_coverage(model) -> None:
    """Raise ``ValueError`` naming every uncovered token mixer (class, layer, reason)."""
    findings = find_uncovered(model)
    if findings:
        shown = "\n  ".join(str(f) for f in findings[:12])
        more = f"\n  ... and {len(findings) - 12} more" if len(findings) > 12 else ""
        raise ValueError(
            f"{type(model).__name__} cannot run under sequence parallelism: {len(findings)} module(s) mix tokens "
            f"outside ulysses_sp's attention, and each would silently see only its rank's shard:\n  {shown}{more}\n"
            "ulysses_sp.verify_sequence_parallel(model, topo) checks a model end to end; see README's support table."
        )


def mark_called(module, kwargs) -> None:
    """Called by the "ulysses_sp" attention function with the layer that called it and its keyword
    arguments: marks the call for every attention module running around it, and refuses a layer
    that dropped the packed-document boundaries the model was given (a family whose attention does
    not forward the model's keyword arguments would let packed documents attend to each other)."""
    calls = module.__dict__.get(_CALLS)
    if calls is None:
        return
    running = calls[0]
    running[:] = [True] * len(running)
    # not in a checkpointed layer's recompute (in the backward): checked in its forward, and the flags now are the
    # model's last forward's (the SP fused head runs one forward per left-padding group, packed or not)
    missing = [name for name in calls[1] if kwargs.get(name) is None]
    if missing and torch._C._current_graph_task_id() == -1:
        raise ValueError(
            f"{type(module).__name__} (layer {_layer_of('', module)}) did not receive the {FORWARDED[missing[0]][0]} that the model was "
            f"given: its attention does not forward the model's keyword arguments, so under SP {FORWARDED[missing[0]][1]}"
        )


def _before_attention(module, args):
    module.__dict__[_CALLS][0].append(False)


def _after_attention(path):
    def hook(module, args, output):
        if not module.__dict__[_CALLS][0].pop():
            raise ValueError(
                f"{type(module).__name__} (layer {_layer_of(path, module)}, {path}) ran without calling the 'ulysses_sp' attention "
                f"function: it computes attention in its own code or under another attn_implementation, so under SP it would "
                f"attend only to its own shard"
            )
    return hook


FUSED_HEAD = "_ulysses_sp_fused_head"
"""Key in a model's ``__dict__`` of `ulysses_sp.integrations.trl.sequence_parallel_fused_head`,
which takes whole rows and calls the model again with this rank's shard (``SHARD_CALL=True``)."""
SHARD_CALL = "_usp_shard_call"


BLOCKS = "ulysses_sp_blocks"
"""The text decoder's keyword argument that carries each batch row's bidirectional blocks (global
``(start, end)``: Gemma 3's images, PaliGemma's prefixes) from the image-text split to the attention function."""
FORWARDED = {"cu_seq_lens_q": ("packed documents' boundaries (cu_seq_lens_q)", "packed documents would attend to each other; train it "
                                                                              "unpacked (--no-packing)"),
             BLOCKS: (f"bidirectional blocks ({BLOCKS})", "a block's tokens (an image's, a prefix's) would not see its later tokens")}
"""Keyword arguments the model is given that every attention call must receive: what they are, and what goes wrong without them."""


def _before_model(sp_size: int, calls: list):
    def hook(model, args, kwargs):
        if FUSED_HEAD in model.__dict__ and kwargs.get("fused_lm_head") and not kwargs.get(SHARD_CALL):
            return  # whole rows for the SP fused head, which shards them and calls the model again: checked then
        calls[0].clear()  # what a forward that raised left
        calls[1] = [name for name in FORWARDED if kwargs.get(name) is not None]  # every attention call must get them
        if sp_size > 1 and kwargs.get("position_ids") is None and len(args) < 3:  # (input_ids, attention_mask, position_ids)
            raise ValueError(
                f"{type(model).__name__} under sequence parallelism (sp_size {sp_size}) needs the global position_ids of this rank's "
                "tokens: without them the model numbers each shard's tokens from 0 (rotary and learned positions go wrong). "
                "Pass ulysses_sp.model_inputs(ulysses_sp.shard_batch(batch, topo))."
            )
    return hook


def install_guards(model, sp_size: int) -> None:
    """The first-forward checks: every attention module must call our attention function,
    and the model must get global ``position_ids``."""
    remove_guards(model)
    # whether each attention module running now (outermost first) has called our attention function: a list,
    # not a count, so that torch.compile reads no value it would have to guard on; whether the model was
    # given packed-document boundaries
    calls = [[], []]
    handles = [model.register_forward_pre_hook(_before_model(sp_size, calls), with_kwargs=True)]
    mixed = [path for path, m in model.named_modules() if MIXER in m.__dict__]
    for path, module in attention_modules(model):
        if any(_within(path, m) for m in mixed):  # linear attention under a mixer strategy, or inside one: run whole
            continue
        held = [m for m in mixed if _within(m, path)]
        if held and not _attention_in(module, path, held)[0]:
            continue  # a layer around its mixer with no routed attention of its own: nothing of ours to call
        module.__dict__[_CALLS] = calls  # one counter shared by the model's attention modules
        handles.append(module.register_forward_pre_hook(_before_attention))
        handles.append(module.register_forward_hook(_after_attention(path)))
    model.__dict__[_HOOKS] = handles


def remove_guards(model) -> None:
    for handle in model.__dict__.pop(_HOOKS, []):
        handle.remove()
    for _, module in attention_modules(model):
        module.__dict__.pop(_CALLS, None)
