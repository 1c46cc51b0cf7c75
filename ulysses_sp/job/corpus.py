"""The job's data: local files tokenized with the model's tokenizer, packed or padded into
``seq_len`` rows, and handed out per DP group by micro-batch index (so a resumed run picks
up mid-epoch where it stopped).

Packing (the default) concatenates documents, each ended by EOS, and cuts the stream into
rows of ``seq_len`` tokens. Position ids restart at 0 at every document start and at every
row start (a document cut by a row boundary continues as a new one), so attention never
crosses a document; :func:`ulysses_sp.shard_batch` also drops the target across each
boundary, so a document's first token is never the previous one's target. ``--no-packing``
gives each document (or each ``seq_len`` piece of a long one) its own row, right-padded.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ..data import IGNORE_INDEX, SequenceParallelSampler
from ..tasks import EOS_ID, PAD_ID, passkey_batch, passkey_eval_batch
from ..topology import Topology
from .config import JobError, TrainConfig

__all__ = ["Rows", "load_tokenizer", "load_texts", "tokenize", "pack", "pad_each", "pad_id", "build_rows", "TrainBatches", "eval_batches", "passkey_eval_batches"]

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}


@dataclass
class Rows:
    """``[N, seq_len]`` tensors: token ids, labels (-100 on padding) and position ids."""

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def batch(self, indices) -> dict:
        idx = torch.as_tensor(list(indices), dtype=torch.long)
        return {"input_ids": self.input_ids[idx], "labels": self.labels[idx], "position_ids": self.position_ids[idx]}


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


def load_texts(path: str, *, say=None) -> list[str]:
    """The non-empty ``text`` records of a local JSON-lines, JSON, Parquet or text file (a text
    file is one document), through Hugging Face ``datasets``; ``say`` gets a line counting the
    records skipped for having no text."""
    import datasets

    builder = _BUILDERS.get(os.path.splitext(path)[1].lower())
    if builder is None:
        raise JobError(f"{path}: unknown data format; use .jsonl/.json or .parquet (a 'text' column) or .txt")
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()
    options = {"sample_by": "document"} if builder == "text" else {}
    try:
        ds = datasets.load_dataset(builder, data_files=path, split="train", **options)
    except Exception as e:  # datasets raises many kinds for a malformed file
        raise JobError(f"{path}: cannot read it as {builder} ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''})") from None
    if "text" not in ds.column_names:
        raise JobError(f"{path}: no 'text' column (columns: {', '.join(ds.column_names)})")
    texts = [t for t in ds["text"] if isinstance(t, str) and t]
    if not texts:
        raise JobError(f"{path}: no non-empty 'text' records")
    if len(texts) < len(ds) and say is not None:
        say(f"{path}: {len(ds) - len(texts)} of {len(ds)} records have no text (empty, null or not a string) and are skipped")
    return texts


def tokenize(texts: list[str], tokenizer, *, progress: bool = False) -> list[list[int]]:
    """Token ids per document, each ending in EOS; ``tokenizer`` None: UTF-8 bytes (the embedded model)."""
    if tokenizer is None:
        return [list(t.encode()) + [EOS_ID] for t in texts]
    from tqdm import tqdm

    eos, docs, step = tokenizer.eos_token_id, [], 256
    for start in tqdm(range(0, len(texts), step), desc="tokenize", unit="batch", disable=not progress):
        for ids in tokenizer(texts[start : start + step], add_special_tokens=True)["input_ids"]:
            docs.append(ids if ids and ids[-1] == eos else ids + [eos])
    return docs


def pack(docs: list[list[int]], seq_len: int, pad_id: int) -> Rows:
    """Documents concatenated and cut into rows of ``seq_len`` (the last padded)."""
    flat = torch.tensor([t for d in docs for t in d], dtype=torch.long)
    n = len(flat)
    rows = -(-n // seq_len)
    starts = torch.zeros(rows * seq_len, dtype=torch.bool)
    offsets = torch.tensor([0] + [len(d) for d in docs[:-1]], dtype=torch.long).cumsum(0)
    starts[offsets] = True
    starts[::seq_len] = True  # a row starts a new document
    starts[n:n + 1] = True  # the padding is a document of its own
    index = torch.arange(rows * seq_len)
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(0).values
    ids = torch.full((rows * seq_len,), pad_id, dtype=torch.long)
    ids[:n] = flat
    labels = ids.clone()
    labels[n:] = IGNORE_INDEX
    shape = (rows, seq_len)
    return Rows(ids.view(shape), labels.view(shape), (index - last_start).view(shape))


def pad_each(docs: list[list[int]], seq_len: int, pad_id: int) -> Rows:
    """One row per document, or per ``seq_len`` piece of a longer one, right-padded."""
    pieces = [d[i : i + seq_len] for d in docs for i in range(0, len(d), seq_len)]
    ids = torch.full((len(pieces), seq_len), pad_id, dtype=torch.long)
    labels = torch.full_like(ids, IGNORE_INDEX)
    for row, piece in enumerate(pieces):
        ids[row, : len(piece)] = labels[row, : len(piece)] = torch.tensor(piece)
    return Rows(ids, labels, torch.arange(seq_len).expand(len(pieces), seq_len).clone())


def pad_id(tokenizer) -> int:
    """The tokenizer's pad id, else its EOS; the byte-level padding id without one."""
    if tokenizer is None:
        return PAD_ID
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_rows(path: str, tokenizer, cfg: TrainConfig, *, progress: bool) -> Rows:
    docs = tokenize(load_texts(path, say=(lambda line: print(line, flush=True)) if progress else None), tokenizer, progress=progress)
    return (pack if cfg.packing else pad_each)(docs, cfg.seq_len, pad_id(tokenizer))


class TrainBatches:
    """Micro-batch ``m`` of this DP group, for ``m = step * accumulation + j``: epochs in the
    order of a seeded :class:`SequenceParallelSampler` (reshuffled per epoch), so the same
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
        epoch, offset = divmod(m, self.per_epoch)
        if epoch != self._epoch:
            self.sampler.set_epoch(epoch)
            self._epoch, self._order = epoch, list(self.sampler)
        return self.rows.batch(self._order[offset * self.micro : (offset + 1) * self.micro])


def passkey_train_batches(cfg: TrainConfig, topo: Topology, micro_batch: int):
    return lambda m: passkey_batch(cfg.seq_len, seed=cfg.seed, step=m, dp_rank=topo.dp_rank, batch_size=micro_batch)


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
    """Held-out passkey prompts (never drawn in training), shared out like :func:`eval_batches`.
    Each batch also holds ``answer_labels``: the labels with everything but the key ignored."""
    mine = [passkey_eval_batch(cfg.seq_len, seed=cfg.seed, index=i) for i in range(topo.dp_rank, cfg.eval_samples, topo.dp_size)]
    per_group = -(-cfg.eval_samples // topo.dp_size)
    filler = passkey_eval_batch(cfg.seq_len, seed=cfg.seed, index=0)
    return mine + [{**_no_targets(filler), "answer_labels": torch.full_like(filler["labels"], IGNORE_INDEX)}] * (per_group - len(mine))
