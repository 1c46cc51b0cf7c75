"""The Ulysses adapters for Gated DeltaNet: Qwen3-Next's (``Qwen3NextGatedDeltaNet``) and Qwen3.5's
(``Qwen3_5GatedDeltaNet``, ``Qwen3_5MoeGatedDeltaNet``), which differ only in their input projections.

The layer's input projections run on this rank's tokens for every head; q, k, v and the gates
b, a go head-sharded over the whole sequence (one fused all-to-all); the short convolution runs
on this rank's channels (the depthwise kernel sliced to its heads) and the gated delta rule on
its heads, both through the module's own functions, document by document when the batch is
packed; the output comes back sequence-sharded (one all-to-all) for the gated norm and the
output projection. Key heads split across ranks with the value heads grouped under them (P must
divide the value heads); when there are fewer key heads than ranks, each is replicated to the
ranks whose value heads use it. Sliced weights (convolution kernel, ``A_log``, ``dt_bias``) get
gradients for this rank's heads only; the SP group's gradient sum completes them, as it does
every parameter's.
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from ... import comm, layout
from ...mixers.state import StateAdapter, register_state
from ...mixers.ulysses import Adapter, rank_groups, register_adapter


def _channels(module, key_heads: range, rank: int, p: int, device) -> torch.Tensor:
    """This rank's channels of the convolution over cat(q, k, v), each head's channels contiguous."""
    vh, dk, dv = module.num_v_heads // p, module.head_k_dim, module.head_v_dim
    q = torch.arange(key_heads.start * dk, key_heads.stop * dk)
    v = torch.arange(rank * vh * dv, (rank + 1) * vh * dv)
    return torch.cat([q, module.key_dim + q, 2 * module.key_dim + v]).to(device)


def _qwen3_next_projections(module, hidden_states):
    """q, k [B, S, Hk, dk]; v, z [B, S, Hv, dv]; b, a [B, S, Hv]: one fused projection, value heads
    grouped under their key head."""
    return module.fix_query_key_value_ordering(module.in_proj_qkvz(hidden_states), module.in_proj_ba(hidden_states))


def _qwen3_5_projections(module, hidden_states):
    """The same tensors from Qwen3.5's separate projections (q, k, v concatenated by channel)."""
    q, k, v = torch.split(module.in_proj_qkv(hidden_states), [module.key_dim, module.key_dim, module.value_dim], dim=-1)
    return (q.unflatten(-1, (-1, module.head_k_dim)), k.unflatten(-1, (-1, module.head_k_dim)), v.unflatten(-1, (-1, module.head_v_dim)),
            module.in_proj_z(hidden_states).unflatten(-1, (-1, module.head_v_dim)), module.in_proj_b(hidden_states), module.in_proj_a(hidden_states))


def _run(projections, module, hidden_states, topo, cu_seqlens):
    code = sys.modules[type(module).__module__]  # the model's own convolution and recurrence
    p, rank = topo.sp_size, topo.sp_rank
    key_heads = rank_groups(module.num_k_heads, p, rank)
    kh, vh, dk, dv = len(key_heads), module.num_v_heads // p, module.head_k_dim, module.head_v_dim
    q, k, v, z, b, a = projections(module, hidden_states)
    q, k = comm.replicate_kv_for_scatter(q, k, p)
    bounds = layout.document_bounds(cu_seqlens, hidden_states.shape[1] * p)  # global: q, k, v hold the whole sequence
    table = layout.chunk_table(topo.layout, p, bounds[-1], bounds)
    # one fused all-to-all; its packing copies the (strided) projection views, so nothing is copied before
    q, k, v, b, a = comm.seq_to_heads([q, k, v, b.unsqueeze(-1), a.unsqueeze(-1)], topo.sp_group, table)
    channels = _channels(module, key_heads, rank, p, hidden_states.device)
    weight = module.conv1d.weight.squeeze(1)[channels]
    bias = None if module.conv1d.bias is None else module.conv1d.bias[channels]
    heads = slice(rank * vh, (rank + 1) * vh)
    a_log, dt_bias = module.A_log[heads], module.dt_bias[heads]
    outs = []
    for start, end in zip(bounds, bounds[1:]):  # no convolution window or state crosses a document boundary
        mixed = torch.cat([t[:, start:end].flatten(2) for t in (q, k, v)], dim=-1).transpose(1, 2)
        mixed = code.causal_conv1d_fn(mixed, weight, bias, activation=module.activation).transpose(1, 2)
        qd, kd, vd = torch.split(mixed, [kh * dk, kh * dk, vh * dv], dim=-1)
        b_doc, a_doc = b[:, start:end, :, 0], a[:, start:end, :, 0]
        g = -a_log.float().exp() * F.softplus(a_doc.float() + dt_bias)
        out, _ = code.torch_chunk_gated_delta_rule(
            qd.unflatten(-1, (kh, dk)), kd.unflatten(-1, (kh, dk)), vd.unflatten(-1, (vh, dv)), g=g, beta=b_doc.sigmoid(),
            initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=True,
        )
        outs.append(out)
    (out,) = comm.heads_to_seq([torch.cat(outs, dim=1)], topo.sp_group, table)
    out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(z.shape)
    return module.out_proj(out.flatten(2))


def _sent(module, p: int, itemsize: int) -> tuple[int, int]:
    """q and k (key heads as sent), v, the gates b and a; the output."""
    keys = 2 * comm.kv_heads_sent(module.num_k_heads, p) * module.head_k_dim
    return (keys + module.value_dim + 2 * module.num_v_heads) * itemsize, module.value_dim * itemsize


def _run_state(projections, module, hidden_states, fragments):
    """State passing (`ulysses_sp.mixers.state`): every head on this rank's fragments; the summaries
    ``[B | A]`` per value head are ``[dk, dv + dk]``."""
    code = sys.modules[type(module).__module__]
    kh, vh, dk, dv = module.num_k_heads, module.num_v_heads, module.head_k_dim, module.head_v_dim
    q, k, v, z, b, a = projections(module, hidden_states)
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias

    def conv(x):
        return code.causal_conv1d_fn(x.transpose(1, 2), weight, bias, activation=module.activation).transpose(1, 2)

    def scan(x, start, end, initial_state, widen):
        qd, kd, vd = torch.split(x, [kh * dk, kh * dk, vh * dv], dim=-1)
        vd = vd.unflatten(-1, (vh, dv))
        if widen:
            vd = torch.cat([vd, vd.new_zeros(*vd.shape[:3], dk)], dim=-1)
        g = -module.A_log.float().exp() * F.softplus(a[:, start:end].float() + module.dt_bias)
        out, final = code.torch_chunk_gated_delta_rule(
            qd.unflatten(-1, (kh, dk)), kd.unflatten(-1, (kh, dk)), vd, g=g, beta=b[:, start:end].sigmoid(),
            initial_state=initial_state, output_final_state=widen, use_qk_l2norm_in_kernel=True,
        )
        return final if widen else out

    mixed = torch.cat([t.flatten(2) for t in (q, k, v)], dim=-1)
    out = fragments.run(mixed, module.conv1d.kernel_size[0] - 1, conv, scan, vh, dk, dv)
    out = module.norm(out.reshape(-1, dv), z.reshape(-1, dv)).reshape(z.shape)
    return module.out_proj(out.flatten(2))


def _state_bytes(module, itemsize: int) -> int:
    """A fragment's summary: ``[dk, dv + dk]`` per value head, in the scan's float32 (or the inputs' wider dtype)."""
    return module.num_v_heads * module.head_k_dim * (module.head_v_dim + module.head_k_dim) * max(itemsize, 4)


def _halo_bytes(module, itemsize: int) -> int:
    """The convolution inputs before a fragment: ``kernel - 1`` tokens of q, k and v."""
    return (module.conv1d.kernel_size[0] - 1) * (2 * module.key_dim + module.value_dim) * itemsize


for _names, _projections in ((("Qwen3NextGatedDeltaNet",), _qwen3_next_projections),
                             (("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet"), _qwen3_5_projections)):
    register_adapter(_names, Adapter(heads=lambda module: (module.num_v_heads, module.num_k_heads), run=functools.partial(_run, _projections),
                                     sent=_sent))
    register_state(_names, StateAdapter(run=functools.partial(_run_state, _projections), summary_bytes=_state_bytes, halo_bytes=_halo_bytes))
