"""Eager regions of a ``torch.compile`` graph: SP attention and the tiled MLP, each one custom op.

Under ``torch.compile`` a graph holds ``ulysses_sp::attention`` where the attention is. Its
implementation runs the eager call (validation, the once-per-signature agreement check, the
backend pick, the backend with its collectives, streams and autograd Functions) and keeps the
autograd graph that call built; ``ulysses_sp::backward`` runs that graph's backward. So
``fullgraph=True`` holds for every backend and kernel, results are the eager ones bit for bit,
and the communication is the eager one (``CommCounter`` counts it). The graph gets no shape
check, host sync or collective to trace; Inductor fuses the code around the op, not inside it,
the contract flash-attn's own ops give ``torch.compile``. ``ulysses_sp::tiled_mlp`` does the
same for ``tiling.TiledMLP``, whose backward recomputes tiles through autograd (which a graph
cannot hold); the MLP's parameters get their gradients inside it, as in eager.

The callables and the graph a forward built reach the ops as opaque objects (torch's
``register_opaque_type``), which carry Python state through a compiled graph: an
`EagerCall` made outside the graph (each ``SequenceParallelAttention`` and ``TiledMLP``
holds one, each ``Topology`` one for ``sp_attention``), and a `_Built` the forward returns
and the backward takes, freed with the outer autograd graph.
"""

from __future__ import annotations

import copy

import torch
from torch._library.opaque_object import OpaqueBase, register_opaque_type

__all__ = ["EagerCall", "compiled_attention", "compiled_tiled_mlp"]


class EagerCall(OpaqueBase):
    """A Python callable a compiled graph calls through one of the ops below, made outside the
    compiled region: the attention's ``fn(q, k, v, *, causal, softmax_scale, cu_seqlens, window,
    softcap) -> out``, the tiled MLP's ``fn(x) -> out``.

    It is a graph input, so a compiled graph holds for any of them: Inductor's and AOTAutograd's
    caches key it by ``name`` (its callable's qualified name), which they read when pickling fails.
    Pickled whole, it would take the module and its process groups with it, and the caches would
    be bypassed (each run compiling every graph anew)."""

    def __init__(self, fn) -> None:
        self.fn = fn
        owner = getattr(fn, "__self__", None)
        self.name = f"{type(owner).__qualname__}.{fn.__name__}" if owner is not None else getattr(fn, "__qualname__", repr(fn))

    def __reduce_ex__(self, protocol):
        raise TypeError(f"EagerCall({self.name}) holds a live callable and is not pickled")

    def __deepcopy__(self, memo) -> EagerCall:
        return EagerCall(copy.deepcopy(self.fn, memo))  # a copied module's call is bound to the copy


class _Built(OpaqueBase):
    """The inputs (leaves) and output of one forward's autograd graph, for its backward."""

    def __init__(self, leaves=(), out=None) -> None:
        self.leaves, self.out = leaves, out


register_opaque_type(EagerCall, typ="reference")
register_opaque_type(_Built, typ="reference")

_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.AutogradOther,
                  torch._C.DispatchKey.AutogradNestedTensor, torch._C.DispatchKey.ADInplaceOrView)


def _recording():
    """A custom op's implementation runs below autograd; an eager region must record its graph."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def _grad_mask(*tensors) -> int:
    return sum(1 << i for i, t in enumerate(tensors) if t.requires_grad) if torch.is_grad_enabled() else 0


def _run(fn, inputs, grad_mask: int):
    """``fn(*leaves)``, contiguous (the fake's strides are what the compiled graph reads), with
    the graph it built when any input needs a gradient (``grad_mask``)."""
    if not grad_mask:
        with torch.no_grad():
            return fn(*inputs).contiguous(), _Built()
    with _recording(), torch.enable_grad():
        # copies: Inductor reuses a buffer once its graph reads it no more, and the graph kept here may
        # save its inputs (the ring saves q, k, v); its output is a tuple element, which Inductor does not reuse
        leaves = tuple(t.detach().clone().requires_grad_(bool(grad_mask >> i & 1)) for i, t in enumerate(inputs))
        out = fn(*leaves).contiguous()
    return out.detach(), _Built(leaves, out)


@torch.library.custom_op("ulysses_sp::backward", mutates_args=())
def _backward_op(dout: torch.Tensor, built: _Built, sizes: list[int], dims: list[int], grad_mask: int) -> list[torch.Tensor]:
    """Run a `_Built` graph's backward from ``dout``; the gradients of the inputs in
    ``grad_mask`` (anything else the graph reaches, such as the tiled MLP's parameters,
    accumulates its ``.grad`` as in eager)."""
    if built.out is None:
        raise RuntimeError("ulysses_sp: backward twice through a compiled eager region (retain_graph) is not supported")
    leaves, out = built.leaves, built.out
    built.leaves, built.out = (), None
    with _recording():
        torch.autograd.backward(out, dout)
    return [leaf.grad.contiguous() for i, leaf in enumerate(leaves) if grad_mask >> i & 1]


@_backward_op.register_fake
def _(dout, built, sizes, dims, grad_mask):
    bounds = [sum(dims[:i]) for i in range(len(dims) + 1)]
    return [dout.new_empty(sizes[a:b]) for i, (a, b) in enumerate(zip(bounds, bounds[1:])) if grad_mask >> i & 1]


def _autograd(op, n_inputs: int, n_args: int):
    """Register the backward of ``op``, whose first ``n_inputs`` of ``n_args`` arguments are the
    differentiable tensors and whose last argument is their grad mask."""

    def setup_context(ctx, inputs, output):
        ctx.built, ctx.grad_mask = output[1], inputs[-1]
        ctx.shapes = [n for t in inputs[:n_inputs] for n in t.shape], [t.dim() for t in inputs[:n_inputs]]  # the inputs' shapes, flat

    def backward(ctx, dout, _):
        grads = iter(_backward_op(dout, ctx.built, *ctx.shapes, ctx.grad_mask))
        return (*(next(grads) if ctx.grad_mask >> i & 1 else None for i in range(n_inputs)),) + (None,) * (n_args - n_inputs)

    op.register_autograd(backward, setup_context=setup_context)


# --------------------------------------------------------------------------- attention

@torch.library.custom_op("ulysses_sp::attention", mutates_args=())
def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor, cu_seqlens: torch.Tensor | None, call: EagerCall,
               causal: bool, softmax_scale: float | None, cu_seqlens_list: list[int] | None, window: int | None,
               softcap: float | None, backend: str | None, kernel: str | None, grad_mask: int) -> tuple[torch.Tensor, _Built]:
    options = dict(causal=causal, softmax_scale=softmax_scale, cu_seqlens=cu_seqlens if cu_seqlens is not None else cu_seqlens_list,
                   window=window, softcap=softcap)
    if backend is not None:  # the functional form's
        options.update(backend=backend, kernel=kernel)
    return _run(lambda q, k, v, s: call.fn(q, k, v, sinks=s if s.numel() else None, **options), (q, k, v, sinks), grad_mask)


@_attention.register_fake
def _(q, k, v, sinks, cu_seqlens, call, causal, softmax_scale, cu_seqlens_list, window, softcap, backend, kernel, grad_mask):
    return q.new_empty(*q.shape[:3], v.shape[3]), _Built()


_autograd(_attention, 4, 14)


def compiled_attention(call: EagerCall, q, k, v, *, causal: bool = True, softmax_scale=None, cu_seqlens=None, window=None,
                       softcap=None, backend: str | None = None, kernel: str | None = None, sinks=None) -> torch.Tensor:
    """``call.fn(q, k, v, ...)`` as one op of the graph being compiled; ``backend`` and ``kernel``
    are passed on when given (``Topology.eager_attention``, the functional form's). ``cu_seqlens``
    as a tensor is read inside the op; as a list it becomes part of the graph. No ``sinks`` travel
    as an empty tensor (the op's inputs are tensors)."""
    as_tensor = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else None
    as_list = None if cu_seqlens is None or as_tensor is not None else [int(x) for x in cu_seqlens]
    sinks = q.new_empty(0) if sinks is None else sinks
    out, _ = _attention(q, k, v, sinks, as_tensor, call, bool(causal), softmax_scale, as_list, window, softcap, backend, kernel,
                        _grad_mask(q, k, v, sinks))
    return out


# --------------------------------------------------------------------------- tiled MLP

@torch.library.custom_op("ulysses_sp::tiled_mlp", mutates_args=())
def _tiled_mlp(x: torch.Tensor, call: EagerCall, grad_mask: int) -> tuple[torch.Tensor, _Built]:
    out, built = _run(call.fn, (x,), grad_mask)
    if out.shape != x.shape:
        raise ValueError(f"a tiled MLP under torch.compile must keep its input's shape, got {tuple(x.shape)} -> {tuple(out.shape)}")
    return out, built


@_tiled_mlp.register_fake
def _(x, call, grad_mask):
    return torch.empty_like(x, memory_format=torch.contiguous_format), _Built()


_autograd(_tiled_mlp, 1, 3)


def compiled_tiled_mlp(call: EagerCall, x: torch.Tensor, params: list) -> torch.Tensor:
    """``call.fn(x)`` as one op of the graph being compiled. ``params`` (the MLP's trainable
    parameters) are no inputs of it: they get their gradients inside its backward, which autograd
    runs only when ``x`` needs a gradient, so ``x`` is made to need one when they do."""
    if torch.is_grad_enabled() and params and not x.requires_grad:
        x = x.detach().requires_grad_()
    out, _ = _tiled_mlp(x, call, _grad_mask(x))
    return out
