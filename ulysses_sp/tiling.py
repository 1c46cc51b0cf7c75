"""Memory for long sequences beyond attention: a tiled MLP and per-layer activation checkpointing
with the checkpointed inputs offloaded to host memory.

Tiled MLP (`tile_mlp`). A position-wise module ``[B, S, H] -> [B, S, H]`` (LlamaMLP's
gate/up/down, or anything else that treats tokens independently) runs over tiles of tokens:
`TiledMLPFunction` saves only its input, computes the output tile by tile under
``no_grad`` and, in the backward, recomputes each tile with grad enabled and backpropagates it
(parameter gradients accumulate through autograd, the input gradient is written per tile).
The intermediate activations live for one tile, O(tile x intermediate) instead of
O(S_local x intermediate); the price is a second forward of the MLP.

Tile-count rule (every rank must call the MLP module the same number of times: ZeRO-3 gathers
its parameters per module call, and a rank that calls once more waits forever):

- ``n_tiles = ceil(B * S_local / tile_tokens)``: a function of the input's *shape* only, never of
  its contents (padding, valid tokens, documents). B and S_local are equal on every rank of an
  SP group (``shard_batch`` pads the global length to a multiple of the SP size).
- Under ZeRO-3 (parameters carry DeepSpeed's ``ds_id``) with more ranks than one SP group,
  different DP groups may hold different lengths, so the count is the maximum over the world
  (one all-reduce of one integer per MLP forward); a rank with fewer tokens runs empty tiles.
- Tiles come from ``tensor_split``, which always returns exactly ``n_tiles`` pieces (possibly
  empty), so the number of module calls is exactly ``n_tiles`` in the forward and again in the
  backward.
- ``tiled_mlp=True`` uses ``max(1024, H)`` tokens per tile (H the hidden size): a tile's
  intermediate activation ``[tile, I]`` is then about the size of one MLP weight ``[H, I]``, the
  rule of Arctic Long Sequence Training (``ceil(S / H)`` shards); an int is the tile in tokens.

Each tile calls the MLP *module* (``module(tile)``), so framework hooks (ZeRO-3's parameter
gather/release, its backward re-gather) run per tile in the forward and in the backward
recompute. While tile i < n - 1 is backpropagated the parameters carry ``ds_grad_is_ready =
False``, which tells ZeRO-2 and ZeRO-3 not to reduce a partial gradient (the same protocol as
DeepSpeed's own TiledMLP); the last tile sets it back to True.

Checkpointing (`checkpoint_layers`): ``"layers"`` recomputes each decoder layer in the
backward (``torch.utils.checkpoint``, ``use_reentrant=False``); the SP attention inside re-runs its
collectives in the recompute, in the same order on every rank because every rank recomputes the
same layers in the same (reverse) order. ``"offload"`` checkpoints with the re-entrant variant,
whose only saved tensors are the layer's tensor inputs (``ctx.save_for_backward``), under
``torch.autograd.graph.saved_tensors_hooks`` from an `OffloadStore`: on CUDA pack copies the
input to a pinned host buffer (``non_blocking=True``) and unpack copies it back for the backward;
on CPU there is nothing to move and the store keeps the tensor, counting tensors and bytes in
both cases (``offload_store(model)``).

Under `compile_layers` the checkpoint wraps the compiled layer, re-entrant in both modes:
non-reentrant recomputation is keyed by the backward's graph task, and the compiled attention op
runs its own graph's backward as a task of its own, which would recompute the layer once more.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from .decoder_layers import decoder_layers
from .dropout import rank_dropout
from .eager_ops import EagerCall, compiled_tiled_mlp

__all__ = [
    "CHECKPOINT_MODES",
    "OffloadStore",
    "TiledMLP",
    "TiledMLPFunction",
    "checkpoint_layers",
    "compile_layers",
    "default_tile_tokens",
    "offload_store",
    "tile_count",
    "tile_mlp",
    "tile_norms",
    "norms",
    "untile_mlp",
    "uncheckpoint_layers",
    "validate_options",
]

CHECKPOINT_MODES = ("none", "layers", "offload")
"""The values of ``checkpoint=``.

No checkpoints, each decoder layer recomputed in the backward, or that with its checkpointed input
in host memory (on CUDA)."""
MIN_DEFAULT_TILE = 1024
_TILED = "_ulysses_sp_tiled_mlp"
_CKPT = "_ulysses_sp_checkpoint"
_COMPILED = "_ulysses_sp_compiled"
_STORE = "_ulysses_sp_offload_store"
_FORWARD = "_ulysses_sp_forward"  # the checkpointed forward a layer was given here
_KEEP = "_ulysses_sp_keep_forwards"


def validate_options(tiled_mlp: bool | int | None, checkpoint_mode: str) -> int | None:
    """Check the ``tiled_mlp`` and ``checkpoint`` options of ``apply_sequence_parallel``.

    Args:
        tiled_mlp: False or None (off), True (the default tile) or a tile size in tokens.
        checkpoint_mode: one of ``CHECKPOINT_MODES``.

    Returns:
        The tile in tokens: None for off, 0 for the default rule.

    Raises:
        ValueError: any other value of either.
    """
    if checkpoint_mode not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint_mode!r}")
    if tiled_mlp is None or tiled_mlp is False:
        return None
    if tiled_mlp is True:
        return 0
    if isinstance(tiled_mlp, int) and not isinstance(tiled_mlp, bool) and tiled_mlp >= 1:
        return int(tiled_mlp)
    raise ValueError(f"tiled_mlp must be False, True (the default tile) or a tile size in tokens >= 1, got {tiled_mlp!r}")


def default_tile_tokens(hidden: int) -> int:
    """The default tile of the tiled MLP and norms.

    Args:
        hidden: the hidden size.

    Returns:
        Tokens per tile: the hidden size, at least 1024.
    """
    return max(MIN_DEFAULT_TILE, int(hidden))


def tile_count(tokens: int, tile_tokens: int) -> int:
    """The number of module calls per pass over ``tokens`` tokens.

    Args:
        tokens: the tokens of the pass.
        tile_tokens: tokens per tile.

    Returns:
        ``ceil(tokens / tile_tokens)``, at least 1.
    """
    return max(1, math.ceil(tokens / tile_tokens))


def _agree(n: int, device, group) -> int:
    t = torch.tensor([n], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


class TiledMLPFunction(torch.autograd.Function):
    """``module`` over ``n_tiles`` tiles of the flattened ``B * S`` tokens of ``x``; see the module docstring."""

    @staticmethod
    def forward(ctx, x, module, n_tiles, params):
        ctx.module, ctx.n_tiles, ctx.params = module, n_tiles, params
        ctx.save_for_backward(x)
        flat = x.reshape(1, -1, x.shape[-1])
        out = None
        with torch.no_grad():
            start = 0
            for tile in torch.tensor_split(flat, n_tiles, dim=1):
                y = module(tile)
                if out is None:
                    out = y.new_empty(flat.shape[:2] + y.shape[2:])
                out[:, start:start + tile.shape[1]] = y
                start += tile.shape[1]
        return out.view(x.shape[:-1] + out.shape[-1:])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        module, n, params = ctx.module, ctx.n_tiles, ctx.params
        flat = x.detach().reshape(1, -1, x.shape[-1])
        grad_flat = grad_out.reshape(1, flat.shape[1], -1)
        grad_x = torch.zeros_like(flat) if ctx.needs_input_grad[0] else None
        start = 0
        try:
            for i, tile in enumerate(torch.tensor_split(flat, n, dim=1)):
                ready = i == n - 1
                for p in params:
                    p.ds_grad_is_ready = ready
                size = tile.shape[1]
                tile = tile.detach().requires_grad_(grad_x is not None)
                with torch.enable_grad():
                    y = module(tile)
                if y.requires_grad:
                    torch.autograd.backward(y, grad_flat[:, start:start + size])
                if grad_x is not None and tile.grad is not None:
                    grad_x[:, start:start + size] = tile.grad
                start += size
        finally:
            for p in params:
                p.ds_grad_is_ready = True
        return (grad_x.view(x.shape) if grad_x is not None else None), None, None, None


class TiledMLP:
    """A module run over tiles of tokens, standing in for it in its owner's ``__dict__``.

    ``layer.mlp(x)`` runs the tiles, while ``layer._modules["mlp"]`` (parameters, state_dict,
    hooks) stays the original module.

    Args:
        module (torch.nn.Module): the MLP (or norm) to tile.
        tile_tokens: tokens per tile (0: `default_tile_tokens`).
        world_group (ProcessGroup | None): the group over which the tile counts agree under ZeRO-3.
        agree: make every rank run the same number of tiles (ZeRO-3 gathers parameters per call).
    """

    def __init__(self, module, tile_tokens: int, world_group, agree: bool):
        self.module, self.tile_tokens, self.world_group, self.agree = module, tile_tokens, world_group, agree
        self.counts: collections.deque[int] = collections.deque(maxlen=64)  # the tile counts of the last forwards (equal on every rank)
        self._eager = EagerCall(self._tiles)  # what a compiled graph calls (ulysses_sp.eager_ops)

    def __call__(self, x, *args, **kwargs):
        if args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
            return self.module(x, *args, **kwargs)
        if torch.compiler.is_compiling():  # one op of the graph: a graph cannot hold the backward's recomputation
            return compiled_tiled_mlp(self._eager, x, [p for p in self.module.parameters() if p.requires_grad])
        return self._tiles(x)

    def _tiles(self, x):
        tile = self.tile_tokens or default_tile_tokens(x.shape[-1])
        n = tile_count(x.shape[:-1].numel(), tile)
        params = [p for p in self.module.parameters() if p.requires_grad]
        if self.agree and any(hasattr(p, "ds_id") for p in params) and dist.is_initialized() and dist.get_world_size(self.world_group) > 1:
            n = _agree(n, x.device, self.world_group)
        self.counts.append(n)
        if torch.is_grad_enabled() and params and not x.requires_grad:
            x = x.detach().requires_grad_()  # else autograd would skip the Function and the parameters' gradients
        if not torch.is_grad_enabled() or not (x.requires_grad or params):
            with torch.no_grad():
                return TiledMLPFunction.forward(_NoCtx(), x, self.module, n, [])
        return TiledMLPFunction.apply(x, self.module, n, params)


class _NoCtx:
    def save_for_backward(self, *tensors):
        pass


def tile_mlp(model, tile_tokens: int, sp_size: int = 1) -> list:
    """Run every decoder layer's ``mlp`` over tiles of tokens.

    Args:
        model (torch.nn.Module): the model.
        tile_tokens: tokens per tile (0: `default_tile_tokens`).
        sp_size: the SP group size; when the world is larger, ZeRO-3 parameters make the ranks'
            tile counts agree.

    Returns:
        The `TiledMLP` stand-ins.

    Raises:
        ValueError: the model has no decoder layer with an ``mlp`` module.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    agree = dist.is_initialized() and dist.get_world_size() > sp_size
    out = []
    for layer in decoder_layers(model):
        mlp = layer._modules.get("mlp")
        if mlp is None:
            continue
        layer.__dict__.pop("mlp", None)
        tiled = TiledMLP(mlp, tile_tokens, world, agree)
        layer.__dict__["mlp"] = tiled
        out.append(tiled)
    if not out:
        raise ValueError(f"tiled_mlp: {type(model).__name__} has no decoder layer with an `mlp` module")
    model.__dict__[_TILED] = out
    return out


def norms(model) -> list[tuple[torch.nn.Module, str]]:
    """The normalisations a token passes through outside attention.

    The decoder layers' own (``input_layernorm``, ``post_attention_layernorm``, sandwich norms)
    and the final one beside the layers: modules named ``*Norm`` with at most a per-channel
    weight and bias.

    Args:
        model (torch.nn.Module): the model.

    Returns:
        (owner module, attribute name) of each.
    """
    layers = decoder_layers(model)
    owners = list(layers) + [m for m in model.modules() if any(isinstance(c, torch.nn.ModuleList) and any(x in layers for x in c)
                                                              for c in m.children())]
    found = []
    for owner in owners:
        for name, child in owner._modules.items():
            kind = type(child).__name__
            if child is None or not kind.endswith("Norm") or any(x in kind for x in ("Batch", "Group", "Instance")):
                continue
            if all(p.dim() == 1 for p in child.parameters(recurse=False)) and not list(child.children()):
                found.append((owner, name))
    return found


def tile_norms(model, tile_tokens: int, sp_size: int = 1) -> list:
    """Run every norm `norms` finds over tiles of tokens, as `tile_mlp` runs the MLP.

    The norm's float32 intermediates then live for one tile, and only its input is saved for the
    backward.

    Args:
        model (torch.nn.Module): the model.
        tile_tokens: tokens per tile (0: `default_tile_tokens`).
        sp_size: the SP group size (as for `tile_mlp`).

    Returns:
        The `TiledMLP` stand-ins.
    """
    world = dist.group.WORLD if dist.is_initialized() else None
    agree = dist.is_initialized() and dist.get_world_size() > sp_size
    out = []
    for owner, name in norms(model):
        owner.__dict__[name] = TiledMLP(owner._modules[name], tile_tokens, world, agree)
        out.append(owner.__dict__[name])
    return out


def untile_mlp(model) -> None:
    """Undo `tile_mlp` and `tile_norms`.

    Args:
        model (torch.nn.Module): the model.
    """
    for m in model.modules():
        for name in [k for k, v in m.__dict__.items() if isinstance(v, TiledMLP)]:
            del m.__dict__[name]
    model.__dict__.pop(_TILED, None)


def tiled_mlps(model) -> list:
    """The tiled stand-ins (each with ``.counts``, the tile counts of the last 64 forwards); [] when off."""
    return list(model.__dict__.get(_TILED, ()))


class OffloadStore:
    """Saved-tensor hooks that keep checkpoints in host memory.

    ``saved_tensors_hooks`` pack/unpack that move saved tensors to pinned host memory on CUDA
    (asynchronous copies, back to the device in the backward) and keep them as they are elsewhere.
    Counts what it handled: ``packed``/``packed_bytes``, ``unpacked``, ``offloaded_bytes``
    (the bytes that actually went to the host)."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.packed = self.packed_bytes = self.unpacked = self.offloaded_bytes = 0

    def pack(self, t: torch.Tensor):
        self.packed += 1
        nbytes = t.numel() * t.element_size()
        self.packed_bytes += nbytes
        if t.device.type != "cuda" or isinstance(t, torch.nn.Parameter):
            return (None, t)
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        host.copy_(t, non_blocking=True)  # ordered on the current stream: t's block is reused only after it
        self.offloaded_bytes += nbytes
        return (t.device, host)

    def unpack(self, packed):
        self.unpacked += 1
        device, t = packed
        return t if device is None else t.to(device, non_blocking=True)

    def stats(self) -> dict:
        return {"packed": self.packed, "packed_bytes": self.packed_bytes, "unpacked": self.unpacked, "offloaded_bytes": self.offloaded_bytes}


def _own_forward(layer):
    """The layer's forward without checkpointing: compiled after `compile_layers`."""
    return layer.__dict__.get(_COMPILED) or functools.partial(type(layer).forward, layer)


def _checkpointed_forward(layer, mode: str, store: OffloadStore | None):
    @functools.wraps(type(layer).forward)
    def forward(*args, **kwargs):
        own = _own_forward(layer)

        def original(*a, **k):  # what the checkpoint recomputes too: dropout per SP rank there as in the forward
            with rank_dropout(layer):
                return own(*a, **k)
        if not (layer.training and torch.is_grad_enabled()):
            return original(*args, **kwargs)
        if not args:
            args = (kwargs.pop("hidden_states"),)
        if mode == "layers" and _COMPILED not in layer.__dict__:
            return checkpoint(functools.partial(original, **kwargs), *args, use_reentrant=False)
        # re-entrant: offload, and a compiled layer (module docstring)
        hidden, rest = args[0], args[1:]
        if isinstance(hidden, torch.Tensor) and not hidden.requires_grad:
            hidden = hidden.detach().requires_grad_()  # re-entrant checkpointing gives no parameter gradients otherwise
        with torch.autograd.graph.saved_tensors_hooks(store.pack, store.unpack) if store else contextlib.nullcontext():
            return checkpoint(lambda h, *a: original(h, *a, **kwargs), hidden, *rest, use_reentrant=True)

    return forward


def hf_checkpointing(model) -> bool:
    """Whether transformers' own gradient checkpointing is on (some layer's ``gradient_checkpointing``)."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def checkpoint_layers(model, mode: str) -> OffloadStore | None:
    """Checkpoint every decoder layer: recompute it in the backward.

    Args:
        model (torch.nn.Module): the model.
        mode: one of ``CHECKPOINT_MODES``; ``"offload"`` keeps the checkpoints in host memory.

    Returns:
        The `OffloadStore` under ``"offload"``, else None.

    Raises:
        ValueError: transformers' own gradient checkpointing is on, or the model has no decoder
            layers.
    """
    if mode == "none":
        return None
    if hf_checkpointing(model):
        raise ValueError("checkpoint='layers'/'offload' replaces transformers' gradient checkpointing; call model.gradient_checkpointing_disable() first")
    store = OffloadStore() if mode == "offload" else None
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"checkpoint={mode!r}: {type(model).__name__} has no decoder layers to checkpoint")
    for layer in layers:
        _set_forward(layer, _checkpointed_forward(layer, mode, store))
        layer.__dict__[_CKPT] = mode
    model.__dict__[_STORE] = store
    _keep_forwards(model)
    return store


def _set_forward(layer, forward) -> None:
    if forward is None:
        layer.__dict__.pop("forward", None)
        layer.__dict__.pop(_FORWARD, None)
    else:
        layer.__dict__["forward"] = layer.__dict__[_FORWARD] = forward


def _keep_forwards(model) -> None:
    """Give each layer its forward of `_set_forward` back at every model forward: transformers' Hub
    kernels re-kernelize at each ``train()``/``eval()``, which drops or replaces the instance forward
    of a kernel-decorated class (no decoder layer is one in transformers 5.25; the mixers are)."""
    if _KEEP in model.__dict__:
        return

    def hook(module, args):
        for layer in decoder_layers(module):
            forward = layer.__dict__.get(_FORWARD)
            if forward is not None and layer.__dict__.get("forward") is not forward:
                layer.__dict__["forward"] = forward

    model.__dict__[_KEEP] = model.register_forward_pre_hook(hook)


def uncheckpoint_layers(model) -> None:
    """Undo `checkpoint_layers`.

    Args:
        model (torch.nn.Module): the model.
    """
    for layer in decoder_layers(model):
        if layer.__dict__.pop(_CKPT, None) is not None:
            _set_forward(layer, None)
            if _COMPILED in layer.__dict__:
                layer.__dict__["forward"] = layer.__dict__[_COMPILED]
    model.__dict__.pop(_STORE, None)
    if _KEEP in model.__dict__:
        model.__dict__.pop(_KEEP).remove()


def _call_forward(layer, *args, **kwargs):
    return type(layer).forward(layer, *args, **kwargs)


def compile_layers(model, **compile_options) -> None:
    """``torch.compile`` each decoder layer's own forward.

    The checkpointing of `checkpoint_layers` stays outside the compiled code, which
    torch.compile cannot trace (re-entrant checkpointing, the offload hooks), and the SP attention
    and the tiled MLP are one op each in the graph (``ulysses_sp.eager_ops``).

    Args:
        model (torch.nn.Module): a model switched by ``apply_sequence_parallel``.
        **compile_options (Any): passed to ``torch.compile``, e.g. ``fullgraph=True``.

    Raises:
        ValueError: the model has no decoder layers.
    """
    layers = decoder_layers(model)
    if not layers:
        raise ValueError(f"compile_layers: {type(model).__name__} has no decoder layers to compile")
    compiled = torch.compile(_call_forward, **compile_options)  # one function: the layer is an input, not a constant per layer
    for layer in layers:
        layer.__dict__[_COMPILED] = functools.partial(compiled, layer)
        if _CKPT not in layer.__dict__:
            layer.__dict__["forward"] = layer.__dict__[_COMPILED]


def offload_store(model) -> OffloadStore | None:
    """The offload store of a model.

    Args:
        model (torch.nn.Module): the model.

    Returns:
        Its `OffloadStore` under ``checkpoint="offload"``, else None.
    """
    return model.__dict__.get(_STORE)
