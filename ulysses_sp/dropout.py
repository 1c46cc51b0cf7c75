"""Dropout masks drawn per SP rank.

Every rank of an SP group starts from the same seed (the model must be initialised alike), so
without care a dropout at local position i draws the same mask on every rank, and a sequence's
mask repeats every S/P tokens, which one process never does. While a switched model trains,
`RankDropout` (a ``TorchFunctionMode``) runs each dropout call with a stream of its own
rank: it draws one seed from the default CPU generator (the same number on every rank, which
keeps that stream in step across the group), seeds the generator of the input's device with the
seed mixed with the SP rank, runs the dropout and puts the generator's state back. Every other
random draw (layer drop, MoE routing noise, any per-sequence choice) stays on the shared stream,
so the group keeps agreeing on it, as Megatron keeps tensor-parallel regions' dropout apart from
the rest. A recomputation (activation checkpointing) restores the CPU and device states and so
draws the same masks again, under the mode: ``ulysses_sp.tiling`` wraps what its checkpointing
recomputes, and each layer's ``_gradient_checkpointing_func`` (transformers') is wrapped alike at
the layer's call.

Nothing changes while no dropout is active (evaluation, or every probability 0): the mode is not
entered, bit for bit the model's own run.
"""

from __future__ import annotations

import contextlib
import re

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from .decoder_layers import decoder_layers

__all__ = ["RankDropout", "install_rank_dropout", "remove_rank_dropout", "rank_dropout"]

_DROPOUTS = {fn: (1, 2) for fn in (F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout)}
"""Dropout functions: the positions of their ``p`` and ``training`` arguments."""
_DROPOUT_FIELDS = re.compile(r"dropout|pdrop", re.IGNORECASE)
_STATE = "_ulysses_sp_rank_dropout"
_WRAPPED = "_ulysses_sp_checkpoint"
_MIX = 0x9E3779B97F4A7C15


def _argument(args, kwargs, index: int, names: tuple, default):
    if len(args) > index:
        return args[index]
    return next((kwargs[n] for n in names if n in kwargs), default)


class RankDropout(TorchFunctionMode):
    """Dropout calls on a stream of SP rank ``rank``'s own (see the module's docstring)."""

    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = _DROPOUTS.get(func)
        if where is None:
            return func(*args, **kwargs)
        p = _argument(args, kwargs, where[0], ("p",), 0.5)
        training = _argument(args, kwargs, where[1], ("training", "train"), True)
        if not training or not p:
            return func(*args, **kwargs)
        return self._per_rank(func, args, kwargs)

    @torch.compiler.disable(reason="reseeds the device generator around one dropout call")
    def _per_rank(self, func, args, kwargs):
        x = args[0] if args else kwargs["input"]
        seed = int(torch.randint(0, 2 ** 62, (), dtype=torch.int64))  # the shared CPU stream: the same on every rank
        generator = torch.default_generator if x.device.type == "cpu" else torch.cuda.default_generators[x.device.index or 0]
        state = generator.get_state()
        generator.manual_seed((seed + _MIX * (self.rank + 1)) % 2 ** 63)
        try:
            return func(*args, **kwargs)
        finally:
            generator.set_state(state)


def _has_dropout(model) -> bool:
    """Whether anything in ``model`` would drop units now: an ``nn.Dropout`` (LoRA's too) or a
    config float named like dropout above 0 (models that call the functional form)."""
    if any(isinstance(m, nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return True
    config = getattr(model, "config", None)
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    return any(_DROPOUT_FIELDS.search(k) and isinstance(v, float) and v > 0 for k, v in fields.items())


def rank_dropout(module) -> contextlib.AbstractContextManager:
    """The mode for a call of ``module`` (a switched model, or one of its layers being recomputed)
    while the model trains with some dropout and no mode is entered yet; else a context that does nothing."""
    state = module.__dict__.get(_STATE)
    if state is None or not state["shared"]["active"] or any(isinstance(m, RankDropout) for m in _get_current_function_mode_stack()):
        return contextlib.nullcontext()
    return RankDropout(state["shared"]["rank"])


def _recomputing_under_the_mode(module, checkpoint):
    """transformers' ``_gradient_checkpointing_func`` for ``module``: what it recomputes (the layer's
    forward, called without the module's hooks) runs under the mode as the forward did."""
    def run(function, *args, **kwargs):
        def with_mode(*a, **k):
            with rank_dropout(module):
                return function(*a, **k)

        return checkpoint(with_mode, *args, **kwargs)

    run.__dict__[_WRAPPED] = checkpoint
    return run


def _enter(model, args):
    state = model.__dict__[_STATE]
    state["shared"]["active"] = model.training and _has_dropout(model)  # once per call: the layers' recomputations follow it
    mode = rank_dropout(model)
    mode.__enter__()
    state["entered"].append(mode)


def _exit(model, args, output):
    model.__dict__[_STATE]["entered"].pop().__exit__(None, None, None)


def _wrap_checkpointing(layer, args):
    checkpoint = layer.__dict__.get("_gradient_checkpointing_func")  # set whenever gradient_checkpointing_enable() runs
    if checkpoint is not None and _WRAPPED not in getattr(checkpoint, "__dict__", {}):
        layer._gradient_checkpointing_func = _recomputing_under_the_mode(layer, checkpoint)


def _layers(model) -> list:
    """The modules a checkpointing may call again: `ulysses_sp.decoder_layers` and every
    layer transformers' gradient checkpointing wraps (GPT-2's blocks too)."""
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # pragma: no cover
        GradientCheckpointingLayer = ()
    layers = decoder_layers(model)
    return layers + [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer) and m not in layers]


def install_rank_dropout(model, topo) -> None:
    """Draw dropout per SP rank in ``model`` (nothing at SP size 1)."""
    remove_rank_dropout(model)
    if topo.sp_size == 1:
        return
    shared = {"rank": topo.sp_rank, "active": False, "modules": [model, *_layers(model)]}
    model.__dict__[_STATE] = {"shared": shared, "entered": [], "handles": [
        model.register_forward_pre_hook(_enter), model.register_forward_hook(_exit, always_call=True)]}
    for layer in shared["modules"][1:]:
        layer.__dict__[_STATE] = {"shared": shared, "handles": [layer.register_forward_pre_hook(_wrap_checkpointing)]}


def remove_rank_dropout(model) -> None:
    state = model.__dict__.get(_STATE)
    for module in state["shared"]["modules"] if state else ():
        for handle in module.__dict__.pop(_STATE)["handles"]:
            handle.remove()
        checkpoint = module.__dict__.get("_gradient_checkpointing_func")
        if _WRAPPED in getattr(checkpoint, "__dict__", {}):
            module._gradient_checkpointing_func = checkpoint.__dict__[_WRAPPED]
