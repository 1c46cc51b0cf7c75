"""Hybrid models' token mixers under SP: each module the coverage check finds mixing tokens
outside attention (a convolution over the sequence, a state-space or linear-attention
recurrence) gets a `ulysses_sp.mixers` strategy around its own forward, so the model's
code and kernels still do the math. A model forward pre-hook records what each call needs:
the local batch and sequence sizes and, for packed input, the global document boundaries
(taken from the model's ``cu_seq_lens_q``, so a decoder layer that does not forward its
keyword arguments to the mixer cannot make documents run together).
"""

from __future__ import annotations

import types

import torch
from torch import nn

from .. import mixers as _mixers
from ..mixers.compressed import PACKED_REFUSAL, CompressedAttention, is_compressed_attention
from ..mixers.indexed import IndexedAttention, is_indexed_attention
from . import adapters  # noqa: F401 - the families register their classes with the mixer strategies
from .coverage import MIXER, check_coverage, find_uncovered

__all__ = ["check_supported", "install_mixers", "remove_mixers", "mixer_layers", "packing_refused", "whole_strategy"]

_WHOLE = ((is_indexed_attention, IndexedAttention), (is_compressed_attention, CompressedAttention))
"""Attention modules with a strategy of their own, whatever ``mixer``: DeepSeek Sparse Attention's, DeepSeek-V4's."""

_CONTEXT_HOOK = "_ulysses_sp_mixer_context_hook"


@torch.compiler.disable(reason="a mixer strategy's collectives and host reads run eagerly, between compiled graphs")
def _sp_forward(self, *args, **kwargs):
    strategy, context = self.__dict__[MIXER]
    if context.get("batch") is None:
        raise RuntimeError(f"{type(self).__name__} ran under sequence parallelism outside the model's forward")
    return strategy(self, type(self).forward.__get__(self), args, kwargs, context["batch"], context["seq_local"], context["cu_seqlens"])


def _record_context(context: dict, modules: list):
    def hook(model, args, kwargs):
        for module in modules:  # transformers' Hub kernels (on by default from from_pretrained when `kernels` is installed)
            # re-kernelize on every train()/eval() switch, dropping or replacing each kernel-decorated module's forward
            if getattr(module.__dict__.get("forward"), "__func__", None) is not _sp_forward:
                module.__dict__["forward"] = types.MethodType(_sp_forward, module)
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is None:
            ids = kwargs.get("inputs_embeds")
        cu = kwargs.get("cu_seq_lens_q")  # read once per forward, not by every layer (a host sync on GPUs)
        context.update(batch=ids.shape[0], seq_local=ids.shape[1], cu_seqlens=None if cu is None else tuple(cu.tolist()))
    return hook


def install_mixers(model, topo, mixer: str = "auto") -> dict[str, str]:
    """Put a mixer strategy around every uncovered mixer module of ``model`` (``mixer``: ``auto``,
    a name in `ulysses_sp.mixers.MIXERS`, or ``none`` for no mixer: such models are then
    refused); returns ``{module path: strategy}``. Convolutions and recurrent networks that are
    themselves the decoder layer's child (their input is not ``[batch, sequence, ...]``) are left
    to the coverage check."""
    remove_mixers(model)
    if mixer == "none":
        return {}
    _mixers.get_mixer(mixer, topo)  # an unknown name fails here, whatever the model
    modules = dict(model.named_modules())
    context: dict = {"batch": None}
    found = [(f.path, modules.get(f.path)) for f in find_uncovered(model) if f.kind == "mixer"]
    found = [(path, m) for path, m in found if m is not None and m is not model and not isinstance(m, (nn.Conv1d, nn.RNNBase))]
    strategies = {path: _mixers.get_mixer(mixer, topo, m) for path, m in found}  # a named strategy that cannot run one raises here
    whole = {path: whole_strategy(m, topo) for path, m in modules.items()}
    strategies.update({path: strategy for path, strategy in whole.items() if strategy is not None})
    found += [(path, modules[path]) for path, strategy in whole.items() if strategy is not None]
    for path, module in found:
        module.__dict__[MIXER] = (strategies[path], context)
        module.__dict__["forward"] = types.MethodType(_sp_forward, module)  # deepcopy rebinds it to the copy
    chosen = {path: strategy.name for path, strategy in strategies.items()}
    if chosen:
        model.__dict__[_CONTEXT_HOOK] = model.register_forward_pre_hook(_record_context(context, [m for _, m in found]), with_kwargs=True)
    return chosen


def check_supported(model, topo, mixer: str = "auto") -> None:
    """The coverage check as `ulysses_sp.apply_sequence_parallel` will see the model (its
    mixers under ``mixer``; an image-text model's text decoder alone, which is all it switches),
    without switching anything: a ``ValueError`` naming each uncovered module."""
    from .image_text import decoder_to_switch

    decoder = decoder_to_switch(model)
    model = model if decoder is None else decoder
    install_mixers(model, topo, mixer)
    try:
        check_coverage(model)
    finally:
        remove_mixers(model)


def whole_strategy(module, topo):
    """The strategy of an attention module that has one of its own (`IndexedAttention`, `CompressedAttention`), or None."""
    return next((strategy(topo) for test, strategy in _WHOLE if test(module)), None)


def packing_refused(model) -> str | None:
    """Why ``model``'s packed rows are refused under SP (DeepSeek-V4's compressed attention), or None."""
    return next((f"{type(m).__name__}: {PACKED_REFUSAL}" for m in model.modules() if is_compressed_attention(m)), None)


def mixer_layers(model) -> dict[str, str]:
    """``{module path: strategy}`` of the mixers running under SP."""
    return {path: m.__dict__[MIXER][0].name for path, m in model.named_modules() if MIXER in m.__dict__}


def remove_mixers(model) -> None:
    handle = model.__dict__.pop(_CONTEXT_HOOK, None)
    if handle is not None:
        handle.remove()
    for _, module in model.named_modules():
        if module.__dict__.pop(MIXER, None) is not None:
            module.__dict__.pop("forward", None)
