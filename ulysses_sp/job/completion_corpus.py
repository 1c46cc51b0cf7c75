"""The job's data for ``--task sft``: JSON lines holding ``prompt`` and ``completion`` (strings), the
loss on the completion only (what TRL's SFT trainer does with prompt-completion data).

Each document is the prompt's tokens, then the completion's and EOS; its targets are the completion
and EOS (the prompt's labels are -100). Packing puts whole documents into rows of ``seq_len`` in file
order (position ids restart per document, the padding a document of its own); ``--no-packing`` gives
each its own row. A document longer than ``seq_len`` is refused by its line number: cutting it would
train a completion without its prompt.
"""

from __future__ import annotations

import json

import torch

from ..data import IGNORE_INDEX
from .config import JobError

__all__ = ["CompletionRows"]


class CompletionRows:
    """``seq_len`` rows of whole prompt-completion documents: ``input_ids``, ``labels`` and ``position_ids``."""

    def __init__(self, path: str, tokenizer, seq_len: int, pad_id: int, *, packing: bool, say=None):
        if tokenizer is None or tokenizer.eos_token_id is None:
            raise JobError("--task sft needs a tokenizer with an EOS token (which ends each completion): give --model DIR or --tokenizer DIR")
        self.seq_len, self.pad_id = seq_len, pad_id
        self.docs, self.rows = [], []
        row, used = [], 0
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                record = json.loads(line)
                if not isinstance(record.get("prompt"), str) or not isinstance(record.get("completion"), str):
                    raise JobError(f"{path} line {n}: --task sft reads JSON lines with 'prompt' and 'completion' strings")
                prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"]
                completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
                if len(prompt) + len(completion) > seq_len:
                    raise JobError(f"{path} line {n}: {len(prompt) + len(completion)} tokens, more than --seq-len {seq_len}; a prompt and "
                                   "its completion are never cut: raise --seq-len or shorten it")
                if not completion[:-1]:
                    raise JobError(f"{path} line {n}: the completion is empty, so the document has nothing to learn but EOS")
                self.docs.append((prompt, completion))
                size = len(prompt) + len(completion)
                if row and (not packing or used + size > seq_len):
                    self.rows.append(row)
                    row, used = [], 0
                row.append(len(self.docs) - 1)
                used += size
        if row:
            self.rows.append(row)
        if not self.docs:
            raise JobError(f"{path}: no prompt-completion lines")
        if say is not None:
            say(f"{path}: {len(self.docs)} prompt-completion documents in {len(self.rows)} rows of {seq_len} tokens")

    def __len__(self) -> int:
        return len(self.rows)

    def batch(self, indices) -> dict:
        out = {"input_ids": [], "labels": [], "position_ids": []}
        for r in indices:
            ids, labels, positions = [], [], []
            for d in self.rows[r]:
                prompt, completion = self.docs[d]
                ids += prompt + completion
                labels += [IGNORE_INDEX] * len(prompt) + completion
                positions += list(range(len(prompt) + len(completion)))
            extra = self.seq_len - len(ids)
            out["input_ids"].append(ids + [self.pad_id] * extra)
            out["labels"].append(labels + [IGNORE_INDEX] * extra)
            out["position_ids"].append(positions + list(range(extra)))  # the padding: a document of its own
        return {k: torch.tensor(v) for k, v in out.items()}
