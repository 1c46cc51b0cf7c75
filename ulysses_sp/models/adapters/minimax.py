"""MiniMax's lightning attention (``MiniMaxLightningAttention``) under the allgather mixer: its
forward returns its output and its final recurrent state (``K^T V``, decayed), which MiniMax's
decoder layer discards; the allgather strategy passes the state on as the whole run gives it.
(No Ulysses adapter yet: its block recurrence is written inline in the forward, not as a function
an adapter could call on a slice of the heads.)"""

from __future__ import annotations

from ...mixers.allgather import register_final_state

register_final_state(("MiniMaxLightningAttention",))
