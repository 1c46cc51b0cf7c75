"""The embedded default training task: passkey retrieval over byte-level tokens.

A five-digit pass key is hidden at a random depth of a long run of repetitive
filler text; the sequence ends with the question and the answer. Predicting
the filler is quickly learnt (the loss falls within minutes); predicting the
answer needs attention back across the whole sequence, i.e. across ranks.
Nothing is downloaded: every sample is generated from (seed, step, DP group).
"""

from __future__ import annotations

import torch

__all__ = ["VOCAB_SIZE", "PAD_ID", "EOS_ID", "passkey_sample", "passkey_batch", "passkey_eval_batch"]

VOCAB_SIZE = 257
"""256 byte values and a padding id."""
PAD_ID = 256
EOS_ID = PAD_ID
"""Byte-level documents (``--data`` for the embedded model) end with this id, as models whose
pad token is their EOS do."""

_FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_QUESTION = b" What is the pass key? The pass key is "


def passkey_sample(seq_len: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """One sequence of exactly ``seq_len`` byte tokens, and where its answer starts."""
    key = "".join(str(int(d)) for d in torch.randint(0, 10, (5,), generator=generator)).encode()
    needle = b" The pass key is " + key + b". Remember it. " + key + b" is the pass key. "
    tail = _QUESTION + key
    room = seq_len - len(needle) - len(tail)
    if room < len(_FILLER):
        raise ValueError(f"seq_len {seq_len} is too short for the passkey task (need at least {seq_len - room + len(_FILLER)})")
    filler = (_FILLER * (room // len(_FILLER) + 1))[:room]
    depth = int(torch.randint(0, room + 1, (1,), generator=generator))
    text = filler[:depth] + needle + filler[depth:] + tail
    return torch.tensor(list(text), dtype=torch.long), seq_len - len(key)


def passkey_batch(seq_len: int, *, seed: int, step: int, dp_rank: int, batch_size: int = 1) -> dict:
    """A causal-LM batch (``input_ids``, ``labels``) for one step of one DP group:
    the same on every rank of an SP group, different across DP groups and steps."""
    generator = torch.Generator().manual_seed(hash((seed, step, dp_rank)) & 0x7FFF_FFFF_FFFF_FFFF)
    ids = torch.stack([passkey_sample(seq_len, generator)[0] for _ in range(batch_size)])
    return {"input_ids": ids, "labels": ids.clone()}


def passkey_eval_batch(seq_len: int, *, seed: int, index: int) -> dict:
    """Held-out prompt ``index`` (drawn from negative step numbers, which training never uses):
    ``input_ids``, ``labels``, and ``answer_labels`` (the labels with all but the key ignored).
    The model retrieves the key exactly when its argmax at every key position is the key's
    digit, which is exactly when greedy decoding after the question generates the key."""
    generator = torch.Generator().manual_seed(hash((seed, -1 - index, 0)) & 0x7FFF_FFFF_FFFF_FFFF)
    ids, answer = passkey_sample(seq_len, generator)
    answer_labels = torch.full_like(ids, -100)
    answer_labels[answer:] = ids[answer:]
    return {"input_ids": ids[None], "labels": ids[None].clone(), "answer_labels": answer_labels[None]}
