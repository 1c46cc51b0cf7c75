"""The all-gather fallback for any token mixer: gather the mixer's sequence-shaped inputs in
global token order, run the mixer's own forward on the whole sequence (document by document
when the batch is packed, so no state or convolution window crosses a document boundary), and
keep this rank's rows. Exact by construction for any mixer that maps a sequence to a sequence;
costs P times the mixer's compute and activation memory, and per gathered input
(P-1) x its local bytes in the forward (all-gather) and again in the backward (reduce-scatter).
"""

from __future__ import annotations

import torch

from ulysses_sp import layout
from ulysses_sp.data import gather_sequence, shard_sequence
from ulysses_sp.mixers.common import PACKING_KWARGS
from ulysses_sp.spec import MixerEstimate

FINAL_STATE: set[str] = set()
"""Mixer classes whose forward returns its output and its final state (a recurrence's), which its
callers discard in training: `register_final_state`, called by ``ulysses_sp.integrations``."""


def register_final_state(names) -> None:
    """Let the mixer classes named ``names`` return ``(output, final state)`` under allgather."""
    FINAL_STATE.update(names)


class AllGatherMixer:
    name = "allgather"

    def __init__(self, topo):
        self.topo = topo

    def check(self, module) -> str | None:
        return None  # any mixer that maps a sequence to a sequence

    def estimate(self, module, batch: int, seq_local: int, hidden: int, itemsize: int) -> MixerEstimate:
        """The whole sequence's compute on every rank; the all-gather of the ``[batch, seq_local,
        hidden]`` input and the reduce-scatter of its gradient: (P-1) x its bytes each."""
        moved = (self.topo.sp_size - 1) * batch * seq_local * hidden * itemsize
        return MixerEstimate(1.0, moved, moved)

    def _sequence_shaped(self, t, batch: int, seq_local: int, what: str) -> bool:
        if not isinstance(t, torch.Tensor) or t.dim() < 2:
            return False
        if t.shape[0] == batch and t.shape[1] == seq_local:
            return True
        if seq_local in t.shape[2:]:
            raise ValueError(f"the allgather mixer cannot gather {what} of shape {tuple(t.shape)}: only [batch, sequence, ...] "
                             f"inputs (sequence {seq_local} on this rank) are split along the sequence")
        return False

    def _map(self, value, fn, batch: int, seq_local: int, what: str):
        if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
            return type(value)(self._map(v, fn, batch, seq_local, f"{what}[{i}]") for i, v in enumerate(value))
        return fn(value) if self._sequence_shaped(value, batch, seq_local, what) else value

    def __call__(self, module, forward, args: tuple, kwargs: dict, batch: int, seq_local: int, cu_seqlens: torch.Tensor | None):
        """``forward(*args, **kwargs)`` as one process would run it on the whole sequence, this
        rank's rows of its output. ``cu_seqlens`` (global, packed input) splits the run by document."""
        kwargs = {k: v for k, v in kwargs.items() if k not in PACKING_KWARGS}  # each document runs alone here
        gathered = []

        def gather(t):
            gathered.append(t)
            return gather_sequence(t, self.topo, dim=1, cu_seqlens=cu_seqlens)

        args = tuple(self._map(a, gather, batch, seq_local, f"argument {i}") for i, a in enumerate(args))
        kwargs = {k: self._map(v, gather, batch, seq_local, k) for k, v in kwargs.items()}
        if not gathered:
            raise ValueError(f"the allgather mixer found no [batch {batch}, sequence {seq_local}, ...] input to gather")
        if cu_seqlens is None:
            out = forward(*args, **kwargs)
            _check_output(out, module)
        else:
            full = seq_local * self.topo.sp_size
            bounds = layout.document_bounds(cu_seqlens, full)
            outs = []
            for a, b in zip(bounds, bounds[1:]):
                def cut(t, a=a, b=b):
                    return t[:, a:b]
                outs.append(forward(*(self._map(x, cut, batch, full, "argument") for x in args),
                                    **{k: self._map(v, cut, batch, full, k) for k, v in kwargs.items()}))
                _check_output(outs[-1], module)
            out = _concat(outs)
        return _local_rows(out, self.topo, batch, seq_local * self.topo.sp_size, cu_seqlens)


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _concat(outs: list):
    cat = torch.cat([_first(o) for o in outs], dim=1)
    return (cat,) + tuple(outs[-1][1:]) if isinstance(outs[0], (tuple, list)) else cat  # the last document's final state


def _check_output(out, module) -> None:
    """A tensor, or a tuple of one and Nones; or, for a class registered with `register_final_state`,
    a tuple of one tensor and its final state (passed on as the whole run gives it, of the row or of its
    last document)."""
    rest = out[1:] if isinstance(out, (tuple, list)) else ()
    if not isinstance(_first(out), torch.Tensor) or (any(r is not None for r in rest) and type(module).__name__ not in FINAL_STATE):
        raise ValueError(f"the allgather mixer handles a mixer returning a tensor (or a tuple of one tensor and Nones, or and its final "
                         f"state for a class registered with register_final_state), got {type(out).__name__} from {type(module).__name__}")


def _local_rows(out, topo, batch: int, seq_full: int, cu_seqlens):
    hidden = _first(out)
    if hidden.shape[:2] != (batch, seq_full):
        raise ValueError(f"the mixer returned shape {tuple(hidden.shape)}, not [batch {batch}, sequence {seq_full}, ...]")
    local = shard_sequence(hidden, topo, dim=1, cu_seqlens=cu_seqlens)
    return (local,) + tuple(out[1:]) if isinstance(out, (tuple, list)) else local
