"""The Ulysses adapter for Kimi Delta Attention (``KimiLinearDeltaAttention``, Kimi Linear's
linear-attention layers): Gated DeltaNet's structure with a decay per channel, not per head.

The layer's per-token parts run on this rank's tokens for every head: the q, k and v projections,
the forget gate (its low-rank projection, ``dt_bias``, ``A_log`` and softplus: the module's own
``forget_gate``, so its float32 decay ``g`` comes out as one process computes it) and the input
gate's projection. q, k, v and the gate go head-sharded over the whole sequence (one fused
all-to-all), ``g`` in float32 beside them (a second one: a fused all-to-all carries one dtype);
the short convolution runs on this rank's channels (the depthwise kernel sliced to its heads) and
the chunked delta rule on its heads, both through the module's own functions, document by
document when the batch is packed; the output comes back sequence-sharded (one all-to-all) for
the output gate, the gated norm and the output projection. Heads share nothing (no key-head
groups), so P must divide them; the sliced convolution kernel gets gradients for this rank's
channels only, and the SP group's gradient sum completes it, as it does every parameter's.
"""

from __future__ import annotations

import sys

import torch

from ... import comm, layout
from ...mixers.state import StateAdapter, register_state
from ...mixers.ulysses import Adapter, register_adapter


def _run(module, hidden_states, topo, cu_seqlens):
    code = sys.modules[type(module).__module__]  # the model's own convolution and delta rule
    p, rank = topo.sp_size, topo.sp_rank
    heads, d = module.num_heads, module.head_dim
    mine = heads // p
    q, k, v = (proj(hidden_states).unflatten(-1, (heads, d)) for proj in (module.q_proj, module.k_proj, module.v_proj))
    g = module.forget_gate(hidden_states)  # [B, s, H, d] float32, per token
    b = module.b_proj(hidden_states).unsqueeze(-1)  # the input gate before its sigmoid (elementwise: taken after the move)
    bounds = layout.document_bounds(cu_seqlens, hidden_states.shape[1] * p)  # global: q, k, v hold the whole sequence
    table = layout.chunk_table(topo.layout, p, bounds[-1], bounds)
    q, k, v, b = comm.seq_to_heads([q, k, v, b], topo.sp_group, table)
    (g,) = comm.seq_to_heads([g], topo.sp_group, table)
    ch = torch.arange(rank * mine * d, (rank + 1) * mine * d)
    channels = torch.cat([ch, module.qkv_dim + ch, 2 * module.qkv_dim + ch]).to(hidden_states.device)
    weight = module.conv1d.weight.squeeze(1)[channels]
    bias = None if module.conv1d.bias is None else module.conv1d.bias[channels]
    outs = []
    for start, end in zip(bounds, bounds[1:]):  # no convolution window or state crosses a document boundary
        mixed = torch.cat([t[:, start:end].flatten(2) for t in (q, k, v)], dim=-1).transpose(1, 2)
        mixed = code.causal_conv1d_fn(mixed, weight, bias, activation=module.activation).transpose(1, 2)
        qd, kd, vd = (t.unflatten(-1, (mine, d)) for t in torch.split(mixed, [mine * d] * 3, dim=-1))
        out, _ = code.chunk_kimi_delta_attention(qd, kd, vd, g=g[:, start:end], beta=b[:, start:end, :, 0].sigmoid(),
                                                 initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True)
        outs.append(out)
    (out,) = comm.heads_to_seq([torch.cat(outs, dim=1)], topo.sp_group, table)
    gate = module.g_b_proj(module.g_a_proj(hidden_states)).unflatten(-1, (heads, d))
    return module.o_proj(module.o_norm(out, gate).flatten(2))


def _sent(module, p: int, itemsize: int) -> tuple[int, int]:
    """q, k, v and the input gate, and the float32 decay; the output."""
    qkv = module.qkv_dim
    return (3 * qkv + module.num_heads) * itemsize + qkv * torch.finfo(torch.float32).bits // 8, qkv * itemsize


def _run_state(module, hidden_states, fragments):
    """State passing (`ulysses_sp.mixers.state`): every head on this rank's fragments, the decay
    per channel folded into each fragment's map; the summaries ``[B | A]`` per head are ``[d, 2d]``."""
    code = sys.modules[type(module).__module__]
    heads, d = module.num_heads, module.head_dim
    q, k, v = (proj(hidden_states) for proj in (module.q_proj, module.k_proj, module.v_proj))
    g = module.forget_gate(hidden_states)  # [B, s, H, d] float32
    b = module.b_proj(hidden_states)
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias

    def conv(x):
        return code.causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=module.activation).transpose(1, 2)

    def scan(x, start, end, initial_state, widen):
        qd, kd, vd = (t.unflatten(-1, (heads, d)) for t in torch.split(x, [heads * d] * 3, dim=-1))
        if widen:
            vd = torch.cat([vd, torch.zeros_like(vd)], dim=-1)
        out, final = code.chunk_kimi_delta_attention(qd, kd, vd, g=g[:, start:end], beta=b[:, start:end].sigmoid(), initial_state=initial_state,
                                                     output_final_state=widen, use_qk_l2norm_in_kernel=True)
        return final if widen else out

    out = fragments.run(torch.cat([q, k, v], dim=-1), module.conv1d.kernel_size[0] - 1, conv, scan, heads, d, d)
    gate = module.g_b_proj(module.g_a_proj(hidden_states)).unflatten(-1, (heads, d))
    return module.o_proj(module.o_norm(out, gate).flatten(2))


def _state_bytes(module, itemsize: int) -> int:
    """A fragment's summary: ``[d, 2d]`` per head, in the scan's float32 (or the inputs' wider dtype)."""
    return module.num_heads * module.head_dim * 2 * module.head_dim * max(itemsize, 4)


def _halo_bytes(module, itemsize: int) -> int:
    """The convolution inputs before a fragment: ``kernel - 1`` tokens of q, k and v."""
    return (module.conv1d.kernel_size[0] - 1) * 3 * module.qkv_dim * itemsize


register_adapter(("KimiLinearDeltaAttention",), Adapter(heads=lambda module: (module.num_heads, module.num_heads), run=_run, sent=_sent))
register_state(("KimiLinearDeltaAttention",), StateAdapter(run=_run_state, summary_bytes=_state_bytes, halo_bytes=_halo_bytes))
