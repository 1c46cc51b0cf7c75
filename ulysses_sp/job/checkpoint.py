"""Crash-safe checkpoints for the job.

A DeepSpeed checkpoint is written under a temporary tag (``.partial-stepN``), with each rank's
RNG state beside it; after a barrier rank 0 flushes every file to disk, writes a manifest (the
step, every file with its size, and the run's resume state) last, renames the directory to a
tag never used before (``stepN``, or ``stepN.1`` ... when a crashed run left one), and replaces
``latest`` through a temporary file. A kill at any point leaves either the previous checkpoint
named by ``latest`` or the new one complete: never a torn one under a real tag.

``--resume latest`` takes the complete checkpoint with the highest step whose files all have
their manifest's sizes (a size check: cheap for GB files), saying which ones it skipped and why.
Rotation (``--keep-last``) deletes only complete checkpoints of this run, never the one just
written or the one ``latest`` names, and reports what it could not delete.

Every function that touches the file system runs on rank 0 only, except `save_rng`; the
job broadcasts rank 0's decisions (``run.Job``), so all ranks agree.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys

import torch

__all__ = ["MANIFEST", "write_atomically", "partial_tag", "finish", "find_resumable", "inspect", "rotate", "existing", "save_rng", "load_rng", "resume_mismatches"]

MANIFEST = "ulysses_sp_manifest.json"
LATEST = "latest"


def partial_tag(step: int) -> str:
    """Where DeepSpeed writes step ``step`` before it is complete (hidden: never a resume candidate)."""
    return f".partial-step{step}"


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: str, text: str) -> None:
    """``path`` holds the old text or the new, whatever happens: a temporary file, flushed, then renamed."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync(os.path.dirname(os.path.abspath(path)))


def _files(root: str) -> dict[str, int]:
    """Every file under ``root`` (relative path -> size), the manifest excepted."""
    out = {}
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if rel != MANIFEST:
                out[rel] = os.path.getsize(path)
    return out


def save_rng(directory: str, step: int, rank: int) -> None:
    """This rank's RNG states (torch, CUDA, Python, NumPy) beside its checkpoint files, as tensors,
    numbers and tuples only: `load_rng` reads them with ``weights_only=True``, which runs no code."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    try:
        import numpy

        kind, keys, pos, has_gauss, cached = numpy.random.get_state(legacy=True)
        state["numpy"] = (kind, torch.from_numpy(keys.astype("int64")), int(pos), int(has_gauss), float(cached))
    except ImportError:
        pass
    path = os.path.join(directory, partial_tag(step), f"rng_state_rank{rank}.pt")
    torch.save(state, path)
    _fsync(path)


def load_rng(directory: str, tag: str, rank: int) -> bool:
    """Restore this rank's RNG states if the checkpoint has them; whether it had. The file is read
    with ``weights_only=True``: one holding anything but tensors and plain values is refused."""
    import pickle

    path = os.path.join(directory, tag, f"rng_state_rank{rank}.pt")
    if not os.path.exists(path):
        return False
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        raise ValueError(f"{path} holds objects that torch.load(weights_only=True) refuses to unpickle (not written by this "
                         f"version of ulysses_sp): {str(e).splitlines()[0]}") from None
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        kind, keys, pos, has_gauss, cached = state["numpy"]
        numpy.random.set_state((kind, keys.numpy().astype(numpy.uint32), pos, has_gauss, cached))
    return True


def finish(directory: str, step: int, state: dict) -> str:
    """Rank 0, after every rank wrote step ``step`` under `partial_tag`: flush, manifest,
    rename to a new tag, point ``latest`` at it. Returns the tag."""
    root = os.path.join(directory, partial_tag(step))
    for folder, _, names in os.walk(root):
        for name in names:
            _fsync(os.path.join(folder, name))
        _fsync(folder)
    write_atomically(os.path.join(root, MANIFEST), json.dumps({"step": step, "files": _files(root), **state}, indent=1))
    tag, n = f"step{step}", 0
    while os.path.exists(os.path.join(directory, tag)):  # a crashed run's leftover, or a re-run: never overwrite
        n += 1
        tag = f"step{step}.{n}"
    os.replace(root, os.path.join(directory, tag))
    _fsync(directory)
    write_atomically(os.path.join(directory, LATEST), tag)
    return tag


def inspect(directory: str, tag: str) -> tuple[dict | None, str | None]:
    """(manifest, None) for a complete and intact checkpoint, else (None, why not)."""
    path = os.path.join(directory, tag)
    if not os.path.isdir(path):
        return None, "no such directory"
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        return None, "no manifest: torn by a crash while saving, or written by another tool"
    except (OSError, ValueError) as e:
        return None, f"unreadable manifest ({e})"
    for rel, size in manifest.get("files", {}).items():
        file = os.path.join(path, rel)
        if not os.path.exists(file):
            return None, f"{rel} is missing"
        if os.path.getsize(file) != size:
            return None, f"{rel} has {os.path.getsize(file)} bytes, the manifest says {size}"
    extra = sorted(set(_files(path)) - set(manifest.get("files", {})))
    if extra:  # added after the save: the engine's loader (which unpickles) must not meet a file nobody vouched for
        return None, f"{extra[0]} is not in the manifest" + (f" (and {len(extra) - 1} more files)" if len(extra) > 1 else "")
    return manifest, None


def _latest(directory: str) -> str | None:
    try:
        with open(os.path.join(directory, LATEST)) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _candidates(directory: str) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("step") and os.path.isdir(os.path.join(directory, name)))


def _order(tag: str) -> tuple[int, int]:
    """(step, re-run number) from ``stepN`` / ``stepN.K``."""
    step, _, n = tag[4:].partition(".")
    return (int(step), int(n or 0)) if step.isdigit() and (n == "" or n.isdigit()) else (-1, -1)


def find_resumable(directory: str) -> tuple[str | None, dict | None, list[str]]:
    """(tag, manifest) of the newest complete and intact checkpoint in ``directory`` (None, None
    when there is none), and a line for every newer or ``latest``-named one skipped, with why."""
    if not os.path.isdir(directory):
        return None, None, []
    named, skipped = _latest(directory), []
    for tag in sorted(_candidates(directory), key=_order, reverse=True):
        manifest, why = inspect(directory, tag)
        if manifest is not None:
            if named and named != tag and _order(named) > _order(tag):
                _, named_why = inspect(directory, named)
                skipped.append(f"{named} (named by latest): {named_why}")
            return tag, manifest, skipped
        skipped.append(f"{tag}: {why}")
    return None, None, skipped


def rotate(directory: str, keep_last: int, run: str, protect: set[str]) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints of run ``run``, never one in
    ``protect`` nor the one ``latest`` names; returns a line per checkpoint it could not delete."""
    protect = protect | {_latest(directory)}
    mine = [tag for tag in _candidates(directory) if (inspect(directory, tag)[0] or {}).get("run") == run]
    failures = []
    for tag in sorted(mine, key=_order, reverse=True)[keep_last:]:
        if tag in protect:
            continue
        errors = []
        if sys.version_info >= (3, 12):
            shutil.rmtree(os.path.join(directory, tag), onexc=lambda fn, path, exc: errors.append(f"{path}: {exc}"))
        else:
            shutil.rmtree(os.path.join(directory, tag), onerror=lambda fn, path, info: errors.append(f"{path}: {info[1]}"))
        if errors:
            failures.append(f"could not delete checkpoint {tag}: {errors[0]}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""))
    return failures


def existing(directory: str) -> list[str]:
    """The checkpoints (complete or not) and ``latest`` a directory holds."""
    if not os.path.isdir(directory):
        return []
    return _candidates(directory) + ([LATEST] if os.path.exists(os.path.join(directory, LATEST)) else [])


def resume_mismatches(saved: dict, now: dict, may_grow=("steps",)) -> list[str]:
    """``name: checkpoint X, now Y`` for every resume setting that changed (those in ``may_grow``
    may increase)."""
    return [f"{name}: checkpoint {saved.get(name)!r}, now {value!r}" for name, value in now.items()
            if saved.get(name) != value and not (name in may_grow and isinstance(value, int) and value > (saved.get(name) or 0))]
