"""A data file tokenized once into a memory-mapped token file, which every rank (and every
resumed run) reads instead of holding the corpus as Python lists.

The file lives in ``--token-cache`` (default ``$XDG_CACHE_HOME/ulysses_sp/tokens``) under a key
made of the data file's path, size and modification time, the tokenizer and this format's
version: a changed file or tokenizer makes a new one, a resumed run finds the old one. Each
node's local rank 0 builds it (streaming the records through Hugging Face ``datasets``, a
batch of documents at a time) into a private folder, writes ``meta.json`` last and renames the
folder into place, so a reader sees a complete token file or none; the other local ranks wait
for it without any collective (tokenizing may outlast ``--dist-timeout``). A data error
(no ``text`` column, no records) is kept in ``meta.json`` too, so every rank raises it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import time
from array import array
from dataclasses import dataclass

import numpy as np

from ..tasks import EOS_ID
from .errors import JobError

__all__ = ["TokenFile", "default_cache", "token_file"]

FORMAT = 1
_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
_BATCH = 1024
"""Records tokenized at a time: the most text held in memory at once."""


@dataclass(frozen=True)
class TokenFile:
    """Every document's tokens, each ending in EOS, back to back (``tokens``, memory-mapped) and
    where each ends (``ends``, in memory: 8 bytes per document)."""

    tokens: np.ndarray
    ends: np.ndarray
    skipped: int
    """Records without text (empty, null or not a string)."""
    records: int
    path: str


def default_cache() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "ulysses_sp", "tokens")


def _tokenizer_id(tokenizer) -> str:
    if tokenizer is None:
        return "utf-8 bytes"
    backend = getattr(tokenizer, "backend_tokenizer", None)
    body = backend.to_str() if backend is not None else json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{type(tokenizer).__name__}|{tokenizer.eos_token_id}|{body}".encode()).hexdigest()


def _key(path: str, tokenizer) -> str:
    import datasets

    stat = os.stat(path)
    what = [FORMAT, os.path.abspath(path), stat.st_size, stat.st_mtime_ns, _tokenizer_id(tokenizer), datasets.__version__]
    return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:24]


def token_file(path: str, tokenizer, cache: str, *, builder: bool, say=None) -> TokenFile:
    """The token file of data file ``path``: built here when ``builder`` (a node's local rank 0)
    finds none, else waited for. ``say`` gets progress lines (rank 0's)."""
    folder = os.path.join(cache, _key(path, tokenizer))
    meta_path = os.path.join(folder, "meta.json")
    if not os.path.exists(meta_path):
        if builder:
            _build(path, tokenizer, folder, say)
        else:
            _wait_for(meta_path)
    elif say is not None:
        say(f"{path}: tokens from {folder}")
    with open(meta_path) as f:
        meta = json.load(f)
    if meta["error"]:
        raise JobError(meta["error"])
    if meta["skipped"] and say is not None:
        say(f"{path}: {meta['skipped']} of {meta['records']} records have no text (empty, null or not a string) and are skipped")
    tokens = np.memmap(os.path.join(folder, "tokens.bin"), dtype=meta["dtype"], mode="r") if meta["tokens"] else np.zeros(0, meta["dtype"])
    ends = np.load(os.path.join(folder, "ends.npy"))
    if len(tokens) != meta["tokens"] or len(ends) != meta["documents"]:
        raise JobError(f"the token file {folder} does not match its meta.json (a damaged cache); delete that folder to rebuild it")
    return TokenFile(tokens, ends, meta["skipped"], meta["records"], folder)


def _wait_for(meta_path: str) -> None:
    while not os.path.exists(meta_path):  # the launcher stops this rank if the builder dies
        time.sleep(0.2)


def _records(path: str):
    """The ``text`` column of ``path`` in batches, through ``datasets`` (Arrow, memory-mapped)."""
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
    return len(ds), (batch["text"] for batch in ds.select_columns(["text"]).iter(batch_size=_BATCH))


def _encode(texts: list[str], tokenizer) -> list[np.ndarray]:
    if tokenizer is None:
        return [np.append(np.frombuffer(t.encode(), dtype=np.uint8).astype(np.int64), EOS_ID) for t in texts]
    eos = tokenizer.eos_token_id
    out = []
    for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
        out.append(np.asarray(ids if ids and ids[-1] == eos else ids + [eos], dtype=np.int64))
    return out


def _remove_dead(prefix: str) -> None:
    """Folders a builder on this host left when it was killed (its pid gone)."""
    parent, base = os.path.split(prefix)
    for name in os.listdir(parent):
        pid = name[len(base):]
        if name.startswith(base) and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(os.path.join(parent, name), ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        pass
    return True


def _build(path: str, tokenizer, folder: str, say) -> None:
    from tqdm import tqdm

    os.makedirs(os.path.dirname(folder), exist_ok=True)
    prefix = f"{folder}.tmp-{socket.gethostname()}-"
    _remove_dead(prefix)
    work = f"{prefix}{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    dtype = np.uint16 if tokenizer is None or len(tokenizer) <= 1 << 16 else np.uint32
    meta = {"format": FORMAT, "data": os.path.abspath(path), "dtype": np.dtype(dtype).name, "documents": 0, "tokens": 0,
            "records": 0, "skipped": 0, "error": None}
    ends = array("q")
    try:
        records, batches = _records(path)
        meta["records"] = records
        with open(os.path.join(work, "tokens.bin"), "wb") as out, \
                tqdm(total=records, desc="tokenize", unit="doc", disable=say is None) as bar:
            for texts in batches:
                kept = [t for t in texts if isinstance(t, str) and t]
                meta["skipped"] += len(texts) - len(kept)
                for ids in _encode(kept, tokenizer):
                    out.write(ids.astype(dtype).tobytes())
                    meta["tokens"] += len(ids)
                    ends.append(meta["tokens"])
                bar.update(len(texts))
            out.flush()
            os.fsync(out.fileno())
        meta["documents"] = len(ends)
        if not ends:
            raise JobError(f"{path}: no non-empty 'text' records")
    except JobError as e:
        meta["error"] = str(e)
    np.save(os.path.join(work, "ends.npy"), np.frombuffer(ends, dtype=np.int64) if ends else np.zeros(0, np.int64))
    with open(os.path.join(work, "meta.json"), "w") as f:
        json.dump(meta, f)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.rename(work, folder)
    except OSError:  # another node's builder put the same file there first
        shutil.rmtree(work, ignore_errors=True)
    if say is not None and not meta["error"]:
        say(f"{path}: {meta['documents']} documents, {meta['tokens']} tokens, tokenized into {folder}")
