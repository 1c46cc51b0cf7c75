"""The shard-cut control for the default task (test-only, never a backend): the same trained
model evaluated on one process with attention cut at the boundaries of the SP ranks' shards,
each token seeing only the earlier tokens its own rank holds under the run's layout. A model
that retrieves the key through SP answers the held-out prompts (whose key lies on another
rank) right; under the cut it can only guess (10% per symbol). ``benchmarks/retrieval.py`` runs it
on the default run's exported model.
"""

from __future__ import annotations

import torch

from ..layout import owners
from ..tasks import passkey_eval_batch

__all__ = ["shard_cut_mask", "retrieval"]


def shard_cut_mask(seq_len: int, sp_size: int, layout: str) -> torch.Tensor:
    """``[seq_len, seq_len]`` bool: query i may attend to key j when j <= i and one rank holds both."""
    owner = owners(layout, seq_len, sp_size, (0, seq_len))
    return torch.ones(seq_len, seq_len, dtype=torch.bool).tril() & (owner[:, None] == owner[None, :])


@torch.no_grad()
def retrieval(model, seq_len: int, *, seed: int, prompts: int, sp_size: int, layout: str, cut: bool) -> dict:
    """Held-out prompts retrieved (every key symbol the argmax) and symbols right, on one process
    with attention whole (``cut`` False: what SP computes) or cut at the shards."""
    mask = shard_cut_mask(seq_len, sp_size, layout)[None, None] if cut else None
    retrieved = right = symbols = 0
    for index in range(prompts):
        batch = passkey_eval_batch(seq_len, seed=seed, index=index, sp_size=sp_size, layout=layout)
        logits = model(input_ids=batch["input_ids"], attention_mask=mask).logits[0, :-1]
        targets = batch["answer_labels"][0, 1:]
        answer = targets != -100
        hits = logits[answer].argmax(-1) == targets[answer]
        retrieved += int(hits.all())
        right += int(hits.sum())
        symbols += int(answer.sum())
    return {"retrieved": retrieved / prompts, "symbols_right": right / symbols, "prompts": prompts}
