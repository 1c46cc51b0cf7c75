"""The job's data: local files tokenized once with the model's tokenizer (into a memory-mapped
token file, `.tokens`), packed or padded into ``seq_len`` rows as they are drawn, and
handed out per DP group by micro-batch index (so a resumed run picks up mid-epoch where it
stopped).

Packing (the default) concatenates documents, each ended by EOS, and cuts the stream into
rows of ``seq_len`` tokens. Position ids restart at 0 at every document start and at every
row start (a document cut by a row boundary continues as a new one), so attention never
crosses a document; `ulysses_sp.shard_batch` also drops the target across each
boundary, so a document's first token is never the previous one's target. ``--no-packing``
gives each document (or each ``seq_len`` piece of a long one) its own row, right-padded.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from ..data import IGNORE_INDEX, SequenceParallelSampler
from ..tasks import PAD_ID, passkey_batch, passkey_eval_batch
from ..topology import Topology
from .config import TrainConfig
from .errors import JobError
from .tokens import default_cache, token_file

__all__ = ["Rows", "load_tokenizer", "pack", "pad_each", "pad_id", "build_rows", "TrainBatches", "eval_batches", "passkey_eval_batches"]


class Rows:
    """``seq_len`` rows cut from a token file, built on demand (the corpus stays on disk): token
    ids, labels (-100 on padding) and position ids, as ``[batch, seq_len]`` tensors."""

    def __init__(self, tokens: np.ndarray, ends: np.ndarray, seq_len: int, pad_id: int, *, packing: bool):
        self.tokens, self.seq_len, self.pad_id, self.packing = tokens, seq_len, pad_id, packing
        self.starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
        if packing:  # rows of the stream; a document starts at each document and row start
            self.n = len(tokens)
            self._len = -(-self.n // seq_len)
        else:  # one row per document, or per seq_len piece of a longer one
            lengths = ends - self.starts
            pieces = -(-lengths // seq_len)
            doc = np.repeat(np.arange(len(ends)), pieces)
            within = np.arange(len(doc)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
            self.piece_start = self.starts[doc] + within * seq_len
            self.piece_len = np.minimum(seq_len, lengths[doc] - within * seq_len)
            self._len = len(doc)

    def __len__(self) -> int:
        return self._len

    def batch(self, indices) -> dict:
        rows = [self._packed(i) if self.packing else self._padded(i) for i in indices]
        return {k: torch.stack([r[j] for r in rows]) for j, k in enumerate(("input_ids", "labels", "position_ids"))}

    def _packed(self, i: int):
        first = i * self.seq_len
        g = np.arange(first, first + self.seq_len)
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        real = min(self.seq_len, self.n - first)
        ids[:real] = self.tokens[first : first + real]
        doc_start = self.starts[np.searchsorted(self.starts, g, side="right") - 1]
        start = np.maximum(np.where(g < self.n, doc_start, self.n), first)  # the padding is a document of its own
        labels = ids.copy()
        labels[real:] = IGNORE_INDEX
        return torch.from_numpy(ids), torch.from_numpy(labels), torch.from_numpy(g - start)

    def _padded(self, i: int):
        start, length = int(self.piece_start[i]), int(self.piece_len[i])
        ids = np.full(self.seq_len, self.pad_id, dtype=np.int64)
        ids[:length] = self.tokens[start : start + length]
        labels = np.full(self.seq_len, IGNORE_INDEX, dtype=np.int64)
        labels[:length] = ids[:length]
        return torch.from_numpy(ids), torch.from_numpy(labels), torch.arange(self.seq_len)


def load_tokenizer(cfg: TrainConfig):
    """The tokenizer of ``--tokenizer`` or the ``--model`` directory (local files only); None
    for the embedded model, whose data is byte-level."""
    path = cfg.tokenizer or (cfg.model if cfg.model and os.path.isdir(cfg.model) else None)
    if path is None:
        if cfg.model is not None and cfg.data is not None:
            raise JobError(f"--model {cfg.model} is a config file, without a tokenizer for --data: pass --tokenizer DIR")
        return None
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as e:
        raise JobError(f"no tokenizer could be loaded from {path} ({str(e).splitlines()[0][:200]}); put tokenizer.json and "
                       "tokenizer_config.json there (tokenizer.save_pretrained) or pass --tokenizer DIR") from None
    if tokenizer.eos_token_id is None:
        raise JobError(f"the tokenizer in {path} has no EOS token, which packing puts between documents; set eos_token in its tokenizer_config.json")
    return tokenizer


def pack(docs: list[list[int]], seq_len: int, pad_id: int) -> Rows:
    """Documents (token ids, each ending in EOS) concatenated and cut into rows of ``seq_len``
    (the last padded)."""
    return Rows(*_flat(docs), seq_len, pad_id, packing=True)


def pad_each(docs: list[list[int]], seq_len: int, pad_id: int) -> Rows:
    """One row per document, or per ``seq_len`` piece of a longer one, right-padded."""
    return Rows(*_flat(docs), seq_len, pad_id, packing=False)


def _flat(docs):
    return np.array([t for d in docs for t in d], dtype=np.int64), np.cumsum([len(d) for d in docs]).astype(np.int64)


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS; the byte-level padding id without one."""
    if tokenizer is None:
        return PAD_ID
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_rows(path: str, tokenizer, cfg: TrainConfig, *, progress: bool) -> Rows:
    """The rows of data file ``path``, from its token file (built by this node's local rank 0)."""
    say = (lambda line: print(line, flush=True)) if progress else None
    builder = int(os.environ.get("LOCAL_RANK", "0")) == 0
    tf = token_file(path, tokenizer, cfg.token_cache or default_cache(), builder=builder, say=say)
    return Rows(tf.tokens, tf.ends, cfg.seq_len, pad_id(tokenizer), packing=cfg.packing)


class TrainBatches:
    """Micro-batch ``m`` of this DP group, for ``m = step * accumulation + j``: epochs in the
    order of a seeded `SequenceParallelSampler` (reshuffled per epoch), so the same
    ``m`` gives the same rows on every run, resumed or not."""

    def __init__(self, rows: Rows, topo: Topology, micro_batch: int, seed: int):
        self.rows, self.micro = rows, micro_batch
        self.sampler = SequenceParallelSampler(range(len(rows)), topo, shuffle=True, seed=seed)
        self.per_epoch = len(self.sampler) // micro_batch
        if self.per_epoch == 0:
            raise JobError(f"the data gives {len(rows)} rows of --seq-len tokens, fewer than micro batch {micro_batch} x "
                           f"{topo.dp_size} DP groups needs for one step; add data or lower --seq-len / the micro batch")
        self._epoch, self._order = None, None

    def __call__(self, m: int) -> dict:
        return self.rows.batch(self.indices(m))

    def indices(self, m: int) -> list[int]:
        """The rows of micro-batch ``m``."""
        epoch, offset = divmod(m, self.per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(self.sampler)
        return self._order[offset * self.micro : (offset + 1) * self.micro]


def passkey_train_batches(cfg: TrainConfig, topo: Topology, micro_batch: int, accumulation: int):
    """Micro-batch ``m`` of the passkey task, whose documents grow with ``m`` (`ulysses_sp.tasks`)."""
    return lambda m: passkey_batch(cfg.seq_len, seed=cfg.seed, step=m, dp_rank=topo.dp_rank, batch_size=micro_batch,
                                   steps=cfg.steps * accumulation)


def _no_targets(batch: dict) -> dict:
    return {**batch, "labels": torch.full_like(batch["labels"], IGNORE_INDEX)}


def eval_batches(rows: Rows, topo: Topology, micro_batch: int) -> list[dict]:
    """This DP group's share of ``rows`` (every dp_size-th), in micro batches; every group gets
    the same number of batches (a group short of rows runs one without targets), so the
    collectives of ZeRO-3 and SP line up and no row counts twice."""
    mine = list(range(topo.dp_rank, len(rows), topo.dp_size))
    per_group = -(-len(rows) // topo.dp_size)
    batches = [rows.batch(mine[i : i + micro_batch]) for i in range(0, len(mine), micro_batch)]
    needed = -(-per_group // micro_batch)
    return batches + [_no_targets(rows.batch([0]))] * (needed - len(batches))


def passkey_eval_batches(cfg: TrainConfig, topo: Topology) -> list[dict]:
    """Held-out passkey prompts (never drawn in training; each key on other SP ranks than its
    answer), shared out like `eval_batches`.
    Each batch also holds ``answer_labels``: the labels with everything but the key ignored."""
    prompt = lambda i: passkey_eval_batch(cfg.seq_len, seed=cfg.seed, index=i, sp_size=topo.sp_size, layout=topo.layout)  # noqa: E731
    mine = [prompt(i) for i in range(topo.dp_rank, cfg.eval_samples, topo.dp_size)]
    per_group = -(-cfg.eval_samples // topo.dp_size)
    filler = prompt(0)
    return mine + [{**_no_targets(filler), "answer_labels": torch.full_like(filler["labels"], IGNORE_INDEX)}] * (per_group - len(mine))
