"""The embedded default training task: pass-key retrieval over byte-level tokens, learnt within
the default run, whose held-out answers need attention across SP ranks.

A document is repetitive filler text with a five-symbol pass key hidden at a random depth
(``" key: "`` + key), ending with the question ``" key?"``, one byte found nowhere else (0xFF)
and the key again. Symbol k of the key is one of ten bytes of its own (``0x80 + 10 k + d``),
bytes the ASCII filler never holds: the answer's k-th symbol is found by what it is (the one
class-k byte before it), not by where it is, which one attention head can learn. Only the
answer's symbols are targets: the filler, trained on too, outweighs them in the gradient and
delays retrieval past the default run (measured: docs/benchmarks.md).

Training rows pack documents (position ids restart at each), their lengths drawn log-uniformly
between `MIN_DOC` tokens and a cap that stays at `MIN_DOC` for the first 20% of the
steps (short documents, where attention finds the key at once, so retrieval is learnt early),
then grows to the whole row by 50% (so it carries over to any distance). Held-out prompts are one
document per row whose key lies on SP ranks other than those holding the answer, under the run's
layout: answering them means attention reaching another rank. Nothing is downloaded: every sample
is generated from (seed, step, DP group) or (seed, prompt index).
"""

from __future__ import annotations

import math

import torch

from .layout import owners

__all__ = ["VOCAB_SIZE", "PAD_ID", "EOS_ID", "KEY_LENGTH", "MIN_DOC", "passkey_sample", "passkey_batch", "passkey_eval_batch",
           "doc_length_cap", "key_positions", "cross_shard_depths"]

VOCAB_SIZE = 257
"""256 byte values and a padding id."""
PAD_ID = 256
EOS_ID = PAD_ID
"""Byte-level documents (``--data`` for the embedded model) end with this id, as models whose
pad token is their EOS do."""

KEY_LENGTH = 5
_SYMBOL0 = 0x80
"""Symbol k of the key, digit d: byte ``_SYMBOL0 + 10 k + d``."""
_FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_NEEDLE = b" key: "
_QUESTION = b" key?\xff"
MIN_DOC = 32
"""The shortest training document (the key, the question and a few filler bytes)."""
_HOLD, _GROWN = 0.2, 0.5
"""Documents are at most MIN_DOC tokens until this share of the steps, as long as the row from that one."""


def _key(generator: torch.Generator) -> bytes:
    return bytes(_SYMBOL0 + 10 * k + int(d) for k, d in enumerate(torch.randint(0, 10, (KEY_LENGTH,), generator=generator)))


def _overhead() -> int:
    return len(_NEEDLE) + KEY_LENGTH + len(_QUESTION) + KEY_LENGTH


def passkey_sample(length: int, generator: torch.Generator, depth: int | None = None) -> tuple[torch.Tensor, int]:
    """One document of exactly ``length`` byte tokens and where its answer starts (its last
    KEY_LENGTH tokens). ``depth``: how many filler bytes precede the key (default: drawn)."""
    room = length - _overhead()
    if room < 1:
        raise ValueError(f"seq_len {length} is too short for the passkey task (need at least {_overhead() + 1})")
    start = int(torch.randint(0, len(_FILLER), (1,), generator=generator))
    filler = (_FILLER * (room // len(_FILLER) + 2))[start : start + room]
    key = _key(generator)
    depth = int(torch.randint(0, room + 1, (1,), generator=generator)) if depth is None else depth
    text = filler[:depth] + _NEEDLE + key + filler[depth:] + _QUESTION + key
    return torch.tensor(list(text), dtype=torch.long), length - KEY_LENGTH


def key_positions(depth: int) -> range:
    """Where the key's symbols lie in a document whose key follows ``depth`` filler bytes."""
    return range(depth + len(_NEEDLE), depth + len(_NEEDLE) + KEY_LENGTH)


def _answer_labels(ids: torch.Tensor, answer: int) -> torch.Tensor:
    labels = torch.full_like(ids, -100)
    labels[answer : answer + KEY_LENGTH] = ids[answer : answer + KEY_LENGTH]
    return labels


def doc_length_cap(seq_len: int, step: int, steps: int) -> int:
    """The longest training document at ``step`` of ``steps``: MIN_DOC, then growing
    geometrically to ``seq_len``."""
    grown = min(1.0, max(0.0, (step / max(1, steps) - _HOLD) / (_GROWN - _HOLD)))
    return max(MIN_DOC, min(seq_len, int(MIN_DOC * (seq_len / MIN_DOC) ** grown)))


def _packed_row(seq_len: int, cap: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, labels, positions, left = [], [], [], seq_len
    while left:
        n = int(math.exp(torch.empty(()).uniform_(math.log(MIN_DOC), math.log(cap) + 1e-9, generator=generator).item()))
        n = left if left - n < MIN_DOC else n  # the last document takes the rest
        doc, answer = passkey_sample(n, generator)
        ids.append(doc)
        labels.append(_answer_labels(doc, answer))
        positions.append(torch.arange(n))
        left -= n
    return torch.cat(ids), torch.cat(labels), torch.cat(positions)


def passkey_batch(seq_len: int, *, seed: int, step: int, dp_rank: int, batch_size: int = 1, steps: int | None = None) -> dict:
    """The training batch (``input_ids``, ``labels`` on the answers only, ``position_ids``
    restarting per document) of ``step`` of ``steps`` for one DP group: the same on every rank of
    an SP group, different across DP groups and steps. ``steps`` None: whole-row documents."""
    generator = torch.Generator().manual_seed(hash((seed, step, dp_rank)) & 0x7FFF_FFFF_FFFF_FFFF)
    cap = seq_len if steps is None else doc_length_cap(seq_len, step, steps)
    rows = [_packed_row(seq_len, cap, generator) for _ in range(batch_size)]
    return {key: torch.stack([r[i] for r in rows]) for i, key in enumerate(("input_ids", "labels", "position_ids"))}


def cross_shard_depths(seq_len: int, sp_size: int, layout: str) -> list[int]:
    """Key depths of a one-document row whose key symbols all lie on SP ranks holding none of
    the answer's tokens (every depth when ``sp_size`` is 1)."""
    depths = torch.arange(seq_len - _overhead() + 1)
    if sp_size == 1:
        return depths.tolist()
    owner = owners(layout, seq_len, sp_size, (0, seq_len))
    near_answer = torch.isin(owner, owner[seq_len - KEY_LENGTH :])
    shared = near_answer.unfold(0, KEY_LENGTH, 1).any(1)  # [i]: a rank of the answer holds one of tokens i .. i + KEY_LENGTH - 1
    return depths[~shared[depths + key_positions(0).start]].tolist()


def passkey_eval_batch(seq_len: int, *, seed: int, index: int, sp_size: int = 1, layout: str = "zigzag") -> dict:
    """Held-out prompt ``index`` (drawn from negative step numbers, which training never uses),
    one document whose key lies on other SP ranks than its answer: ``input_ids``, ``labels`` and
    ``answer_labels`` (both the key's targets only). The model retrieves the key exactly when its
    argmax at every key position is the key's symbol, which is exactly when greedy decoding after
    the question generates the key."""
    generator = torch.Generator().manual_seed(hash((seed, -1 - index, 0)) & 0x7FFF_FFFF_FFFF_FFFF)
    depths = cross_shard_depths(seq_len, sp_size, layout)
    depth = depths[int(torch.randint(0, len(depths), (1,), generator=generator))]
    ids, answer = passkey_sample(seq_len, generator, depth=depth)
    labels = _answer_labels(ids, answer)
    return {"input_ids": ids[None], "labels": labels[None].clone(), "answer_labels": labels[None]}
