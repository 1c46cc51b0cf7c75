"""The delta rules' chunked scans (Gated DeltaNet's, Kimi Delta Attention's) as the step memory
model runs them on the meta device: their memory without their loop over chunks.

transformers' torch fallbacks (``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention``)
loop in Python over 64-token chunks: 8,192 iterations a layer at 512k tokens, which kept
``plan --max-seq-len`` from answering for Qwen3.5 in minutes (and, for Kimi Linear, held per-chunk
intermediates the kernels do not). On GPUs flash-linear-attention's kernels run instead; they hold
the output, the inputs saved for the backward and the float32 chunk states ``[B, H, S / 64, K, V]``
while they run, forward and again backward. The stand-in allocates exactly that.
"""

from __future__ import annotations

import contextlib
import sys

import torch

__all__ = ["meta_scans"]


def _chunk_states(k_bshd: torch.Tensor, v_bshd: torch.Tensor, chunk: int) -> None:
    batch, seq, heads, dv = v_bshd.shape
    torch.empty(batch, heads, -(-seq // chunk), k_bshd.shape[-1], dv, dtype=torch.float32, device=v_bshd.device)


class _DeltaRule(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, initial_state, chunk, final):
        ctx.save_for_backward(q, k, v, g, beta)
        ctx.chunk, ctx.initial = chunk, None if initial_state is None else (initial_state.shape, initial_state.dtype, initial_state.device)
        batch, _, heads, dv = v.shape
        out = torch.empty_like(v), (torch.empty(batch, heads, k.shape[-1], dv, dtype=torch.float32, device=v.device) if final else None)
        _chunk_states(k, v, chunk)  # beside the outputs
        return out

    @staticmethod
    def backward(ctx, d_out, d_final):
        q, k, v, g, beta = ctx.saved_tensors
        grads = (*(torch.empty_like(t) for t in (q, k, v, g, beta)),
                 None if ctx.initial is None else torch.empty(ctx.initial[0], dtype=ctx.initial[1], device=ctx.initial[2]))
        _chunk_states(k, v, ctx.chunk)  # recomputed, beside the gradients
        return (*grads, None, None)


def _gated_delta_rule(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                      **kwargs):
    return _DeltaRule.apply(query, key, value, g, beta, initial_state, chunk_size, output_final_state)


_SCANS = ("torch_chunk_gated_delta_rule", "chunk_kimi_delta_attention")
"""The scans replaced: the same arguments (Kimi's decay per channel, ``g`` ``[B, S, H, K]``)."""


@contextlib.contextmanager
def meta_scans():
    """The loaded transformers modeling modules' delta-rule scans (`_SCANS`) replaced by the stand-in
    while open (what the mixer strategies' adapters call)."""
    patched = [(m, name, getattr(m, name)) for key, m in list(sys.modules.items()) if key.startswith("transformers.models.")
               for name in _SCANS if hasattr(m, name)]
    for m, name, _ in patched:
        setattr(m, name, _gated_delta_rule)
    try:
        yield
    finally:
        for m, name, fn in patched:
            setattr(m, name, fn)
