"""The job's data for ``--task sft`` and ``--task dpo``: JSON lines holding ``prompt`` and ``completion``
(sft) or ``prompt``, ``chosen`` and ``rejected`` (dpo), as strings; the targets are the replies only
(what TRL's SFT and DPO trainers do with such data).

Each document is the prompt's tokens, then a reply's and EOS; its targets are the reply and EOS (the
prompt's labels are -100). A preference line gives two documents, chosen then rejected, always in the
same row (so in the same SP group). Packing puts whole lines into rows of ``seq_len`` in file order
(position ids restart per document, the padding a document of its own); ``--no-packing`` gives each
line its own row. A line longer than ``seq_len`` is refused by its line number: cutting it would
train a reply without its prompt, or a pair apart.
"""

from __future__ import annotations

import json

import torch

from ..data import IGNORE_INDEX
from .errors import JobError

__all__ = ["CompletionRows", "REPLIES"]

REPLIES = {"sft": ("completion",), "dpo": ("chosen", "rejected")}
"""The reply fields of a line, per task: each is one document after the line's prompt."""


class CompletionRows:
    """``seq_len`` rows of whole lines: ``input_ids``, ``labels`` and ``position_ids``, and ``documents``
    (the documents of each row before its padding: for dpo, chosen and rejected of each pair in turn)."""

    def __init__(self, path: str, tokenizer, seq_len: int, pad_id: int, *, packing: bool, task: str = "sft", say=None):
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise JobError(f"--task {task} needs a tokenizer with an EOS token (which ends each reply): give --model DIR or --tokenizer DIR")
        fields = REPLIES[task]
        self.seq_len, self.pad_id = seq_len, pad_id
        self.lines, self.rows = [], []
        row, used = [], 0
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not all(isinstance(record.get(k), str) for k in ("prompt", *fields)):
                    raise JobError(f"{path} line {n}: --task {task} reads JSON lines with {', '.join(repr(k) for k in ('prompt', *fields))} strings")
                prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
                replies = [tokenizer(record[k], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for k in fields]
                size = sum(len(prompt) + len(r) for r in replies)
                if size > seq_len:
                    raise JobError(f"{path} line {n}: {size} tokens, more than --seq-len {seq_len}; a prompt and its "
                                   f"{' and '.join(fields)} are never cut: raise --seq-len or shorten it")
                if any(len(r) == 1 for r in replies):
                    raise JobError(f"{path} line {n}: an empty {' or '.join(fields)}, so nothing to learn but EOS")
                self.lines.append([(prompt, r) for r in replies])
                if row and (not packing or used + size > seq_len):
                    self.rows.append(row)
                    row, used = [], 0
                row.append(len(self.lines) - 1)
                used += size
        if row:
            self.rows.append(row)
        if not self.lines:
            raise JobError(f"{path}: no {' / '.join(('prompt', *fields))} lines")
        if say is not None:
            say(f"{path}: {len(self.lines)} {'prompt-completion' if task == 'sft' else 'preference'} lines in {len(self.rows)} rows of {seq_len} tokens")

    def __len__(self) -> int:
        return len(self.rows)

    def documents(self, r: int) -> int:
        """Row ``r``'s documents before its padding."""
        return sum(len(self.lines[line]) for line in self.rows[r])

    def batch(self, indices) -> dict:
        out = {"input_ids": [], "labels": [], "position_ids": [], "documents": []}
        for r in indices:
            ids, labels, positions = [], [], []
            docs = [doc for line in self.rows[r] for doc in self.lines[line]]
            for prompt, reply in docs:
                ids += prompt + reply
                labels += [IGNORE_INDEX] * len(prompt) + reply
                positions += list(range(len(prompt) + len(reply)))
            extra = self.seq_len - len(ids)
            out["input_ids"].append(ids + [self.pad_id] * extra)
            out["labels"].append(labels + [IGNORE_INDEX] * extra)
            out["position_ids"].append(positions + list(range(extra)))  # the padding: a document of its own
            out["documents"].append(len(docs))
        return {k: torch.tensor(v) for k, v in out.items()}
