"""The Ulysses adapter for Mamba2 mixers: ``Mamba2Mixer`` and the hybrids built from the same
block (Bamba, GraniteMoeHybrid, Nemotron-H, Zamba2, whose forwards are Mamba2's line for line,
and Falcon-H1, which adds its input multipliers and an optional norm).

The input projection runs on this rank's tokens; x, B, C and dt go head-sharded over the whole
sequence (one fused all-to-all; B and C by group, replicated when there are fewer groups than
ranks); the depthwise convolution runs on this rank's channels (the kernel sliced to them) and
the chunked scan on its heads, both through the module's own functions, document by document
when the batch is packed; the scan's output comes back sequence-sharded (one all-to-all) for
the gated norm, which normalises across heads, and the output projection. The gate stays where
it was computed. Sliced weights (convolution kernel, ``A_log``, ``D``, ``dt_bias``) get
gradients for this rank's heads only; the SP group's gradient sum completes them.
"""

from __future__ import annotations

import sys

import torch

from ... import comm, layout
from ...mixers.state import StateAdapter, register_state
from ...mixers.ulysses import Adapter, rank_groups, register_adapter


def _projections(module, hidden_states):
    """``in_proj`` of the input, with Falcon-H1's multipliers where the module has them."""
    if hasattr(module, "mup_vector"):
        return module.in_proj(hidden_states * module.ssm_in_multiplier) * module.mup_vector
    return module.in_proj(hidden_states)


def _gated_norm(module, y, gate):
    if getattr(module, "mamba_rms_norm", True):
        return module.norm(y, gate)
    return y * torch.nn.functional.silu(gate)  # Falcon-H1 without its norm


def _run(module, hidden_states, topo, cu_seqlens):
    code = sys.modules[type(module).__module__]  # the model's own convolution and scan
    p, rank = topo.sp_size, topo.sp_rank
    heads, groups, n, d, inner = module.num_heads, module.n_groups, module.ssm_state_size, module.head_dim, module.intermediate_size
    mine, own = heads // p, rank_groups(groups, p, rank)
    gate, x, b, c, dt = _projections(module, hidden_states).split([inner, inner, groups * n, groups * n, heads], dim=-1)
    b, c = comm.replicate_kv_for_scatter(b.unflatten(-1, (groups, n)), c.unflatten(-1, (groups, n)), p)
    bounds = layout.document_bounds(cu_seqlens, hidden_states.shape[1] * p)  # global: x, B, C hold the whole sequence
    table = layout.chunk_table(topo.layout, p, bounds[-1], bounds)
    x, b, c, dt = comm.seq_to_heads([x.unflatten(-1, (heads, d)), b, c, dt.unsqueeze(-1)], topo.sp_group, table)
    device = hidden_states.device
    x_ch = torch.arange(rank * mine * d, (rank + 1) * mine * d)
    bc_ch = torch.arange(own.start * n, own.stop * n)
    channels = torch.cat([x_ch, inner + bc_ch, inner + groups * n + bc_ch]).to(device)
    weight = module.conv1d.weight.squeeze(1)[channels]
    bias = None if module.conv1d.bias is None else module.conv1d.bias[channels]
    sl = slice(rank * mine, (rank + 1) * mine)
    a = -torch.exp(module.A_log[sl].float())
    outs = []
    for start, end in zip(bounds, bounds[1:]):  # no convolution window or state crosses a document boundary
        mixed = torch.cat([t[:, start:end].flatten(2) for t in (x, b, c)], dim=-1).transpose(1, 2)
        mixed = code.causal_conv1d_fn(mixed, weight, bias, activation=module.activation).transpose(1, 2)
        xd, bd, cd = torch.split(mixed, [mine * d, len(own) * n, len(own) * n], dim=-1)
        outs.append(code.mamba2_chunk_scan(
            xd.unflatten(-1, (mine, d)), dt[:, start:end, :, 0], a, bd.unflatten(-1, (len(own), n)), cd.unflatten(-1, (len(own), n)),
            chunk_size=module.chunk_size, D=module.D[sl], dt_bias=module.dt_bias[sl], dt_softplus=True, dt_limit=module.time_step_limit,
        ))
    (y,) = comm.heads_to_seq([torch.cat(outs, dim=1)], topo.sp_group, table)  # in the scan's float32, as the norm gets it
    return module.out_proj(_gated_norm(module, y.flatten(2), gate).to(hidden_states.dtype))


def _sent(module, p: int, itemsize: int) -> tuple[int, int]:
    """x, B and C (groups as sent), dt; the scan's output, in float32 whatever the model's dtype."""
    bc = 2 * comm.kv_heads_sent(module.n_groups, p) * module.ssm_state_size
    return (module.intermediate_size + bc + module.num_heads) * itemsize, module.intermediate_size * torch.finfo(torch.float32).bits // 8


def _run_state(module, hidden_states, fragments):
    """State passing (`ulysses_sp.mixers.state`): every head on this rank's fragments. The state of a
    head is ``[head_dim, state]``; B and C widened by ``head_dim`` zero columns, from an identity there,
    give each fragment's map ``[B | A]`` (its ``A`` the head's decay times the identity)."""
    code = sys.modules[type(module).__module__]
    heads, groups, n, d, inner = module.num_heads, module.n_groups, module.ssm_state_size, module.head_dim, module.intermediate_size
    gate, x, b, c, dt = _projections(module, hidden_states).split([inner, inner, groups * n, groups * n, heads], dim=-1)
    weight, bias = module.conv1d.weight.squeeze(1), module.conv1d.bias
    a = -torch.exp(module.A_log.float())

    def conv(xs):
        return code.causal_conv1d_fn(xs.transpose(1, 2), weight, bias, activation=module.activation).transpose(1, 2)

    def scan(xs, start, end, initial_state, widen):
        xd, bd, cd = torch.split(xs, [inner, groups * n, groups * n], dim=-1)
        bd, cd = bd.unflatten(-1, (groups, n)), cd.unflatten(-1, (groups, n))
        if widen:
            bd, cd = (torch.cat([t, t.new_zeros(*t.shape[:3], d)], dim=-1) for t in (bd, cd))
        out = code.mamba2_chunk_scan(xd.unflatten(-1, (heads, d)), dt[:, start:end], a, bd, cd, chunk_size=module.chunk_size, D=module.D,
                                     dt_bias=module.dt_bias, initial_states=initial_state, dt_softplus=True, dt_limit=module.time_step_limit,
                                     return_final_states=widen)
        return out[1] if widen else out

    y = fragments.run(torch.cat([x, b, c], dim=-1), module.conv1d.kernel_size[0] - 1, conv, scan, heads, d, n)
    return module.out_proj(_gated_norm(module, y.flatten(2), gate).to(hidden_states.dtype))


def _state_bytes(module, itemsize: int) -> int:
    """A fragment's summary: ``[head_dim, state + head_dim]`` per head, in the scan's float32 (or the inputs' wider dtype)."""
    return module.num_heads * module.head_dim * (module.ssm_state_size + module.head_dim) * max(itemsize, 4)


def _halo_bytes(module, itemsize: int) -> int:
    """The convolution inputs before a fragment: ``kernel - 1`` tokens of x, B and C."""
    return (module.conv1d.kernel_size[0] - 1) * module.conv1d.in_channels * itemsize


_CLASSES = ("Mamba2Mixer", "BambaMixer", "GraniteMoeHybridMambaLayer", "NemotronHMamba2Mixer", "Zamba2MambaMixer", "FalconH1Mixer")
register_state(_CLASSES, StateAdapter(run=_run_state, summary_bytes=_state_bytes, halo_bytes=_halo_bytes))
register_adapter(_CLASSES, Adapter(heads=lambda module: (module.num_heads, module.n_groups), run=_run, sent=_sent))
