"""MiniMax's lightning attention (``MiniMaxLightningAttention``): linear attention with a fixed decay
per head, ``S_t = exp(-slope) S_{t-1} + k_t^T v_t``, ``o_t = q_t S_t``.

Under allgather, its forward returns its output and its final recurrent state (``K^T V``, decayed),
which MiniMax's decoder layer discards; the strategy passes the state on as the whole run gives it.
Under state passing, the block recurrence of its forward runs here (the forward writes it inline,
not as a function an adapter could call on a fragment with an entry state), on the module's own
decay buffers; blocks start at each fragment's first row, which regroups the same sums. (No
Ulysses adapter, for the same reason.)"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...mixers.allgather import register_final_state
from ...mixers.state import StateAdapter, register_state


def _lightning(module, q_bhld, k_bhld, v_bhld, state):
    """The forward's block recurrence from ``state`` ``[B, H, D, V]``: the output ``[B, H, L, V]`` and the final state."""
    outs, length, block = [], q_bhld.shape[2], module.block_size
    for start in range(0, length, block):
        n = min(block, length - start)
        q, k, v = (t[:, :, start:start + n] for t in (q_bhld, k_bhld, v_bhld))
        intra = (q @ k.transpose(-1, -2) * module.diagonal_decay[:, :, :n, :n]) @ v
        outs.append((q * module.query_decay[:, :n]) @ state + intra)
        state = state * torch.exp(-module.slope_rate * n) + (k * module.key_decay[:, -n:]).transpose(-1, -2) @ v
    return torch.cat(outs, dim=2), state


def _run_state(module, hidden_states, fragments):
    """State passing (`ulysses_sp.mixers.state`): every head on this rank's fragments; the summaries
    ``[B | A]`` per head are ``[D, 2 D]`` (``A`` the decay over the fragment times the identity)."""
    batch, seq, _ = hidden_states.shape
    heads, d = module.num_attention_heads, module.head_dim
    qkv = module.act_fn(module.qkv_proj(hidden_states))

    def scan(x, start, end, initial_state, widen):
        q, k, v = (t.transpose(1, 2) for t in x.unflatten(-1, (heads, 3 * d)).split(d, dim=-1))
        if widen:
            v = torch.cat([v, torch.zeros_like(v)], dim=-1)
        state = initial_state if initial_state is not None else q.new_zeros(batch, heads, d, d)
        out, final = _lightning(module, q, k, v, state)
        return final if widen else out.transpose(1, 2)

    out = fragments.run(qkv, 0, None, scan, heads, d, d).reshape(batch, seq, heads * d)
    out = F.sigmoid(module.output_gate(hidden_states)) * module.norm(out)
    return module.out_proj(out), None  # the final state, which MiniMax's decoder layer discards


def _state_bytes(module, itemsize: int) -> int:
    """A fragment's summary: ``[D, 2 D]`` per head, in the model's dtype."""
    return module.num_attention_heads * module.head_dim * 2 * module.head_dim * itemsize


register_final_state(("MiniMaxLightningAttention",))
register_state(("MiniMaxLightningAttention",), StateAdapter(run=_run_state, summary_bytes=_state_bytes, halo_bytes=lambda module, itemsize: 0))
