"""Which device a launched rank uses: one GPU per rank, chosen from the launcher's environment.

torchrun sets ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE``; the ``deepspeed``
launcher sets ``LOCAL_RANK`` and ``LOCAL_SIZE``. Entry points that run under a
launcher call `bind_device` before ``init_process_group`` (NCCL takes the
current device) and `check_one_rank_per_device` right after it, so two
ranks sharing one GPU fail at start with a message instead of deadlocking or
running out of memory later. Without CUDA both are no-ops and the rank uses
the CPU.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["local_rank", "local_world_size", "bind_device", "device_identity", "shared_devices", "check_one_rank_per_device",
           "move_batch"]


def _env_int(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def local_rank() -> int:
    """This rank's index on its node: ``LOCAL_RANK`` (torchrun and deepspeed set it), else 0."""
    value = _env_int("LOCAL_RANK")
    if value is not None and value < 0:
        raise ValueError(f"LOCAL_RANK must be >= 0, got {value}")
    return value or 0


def local_world_size(default: int | None = None) -> int | None:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (torchrun), else ``LOCAL_SIZE`` (the deepspeed
    launcher), else ``default``. A value below 1 counts as unset."""
    for name in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = _env_int(name)
        if value is not None and value >= 1:
            return value
    return default


def bind_device() -> torch.device:
    """Make ``cuda:LOCAL_RANK`` this process's current device and return it (CPU without CUDA).

    Call before ``init_process_group``. Raises ``RuntimeError`` if ``LOCAL_RANK`` names a GPU
    this process cannot see (more ranks started on the node than it has visible GPUs).
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index, count = local_rank(), torch.cuda.device_count()
    if index >= count:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise RuntimeError(
            f"LOCAL_RANK {index} on {socket.gethostname()} but this process sees only {count} GPU(s)"
            + (f" (CUDA_VISIBLE_DEVICES={visible})" if visible is not None else "")
            + f": start at most {count} rank(s) per node (torchrun --nproc_per_node, deepspeed --num_gpus), one GPU each"
        )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_identity(device: torch.device) -> tuple[str, str]:
    """(host name, a key naming the physical device): the GPU's UUID when torch reports one,
    else ``cuda:INDEX`` (which, unlike the UUID, depends on ``CUDA_VISIBLE_DEVICES``)."""
    host = socket.gethostname()
    if device.type != "cuda":
        return host, f"{device.type}:{os.getpid()}"  # a CPU rank shares nothing that matters
    index = device.index if device.index is not None else torch.cuda.current_device()
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return host, f"GPU-{uuid}" if uuid else f"cuda:{index}"


def shared_devices(identities: list[tuple[str, str]]) -> dict[tuple[str, str], list[int]]:
    """From every rank's `device_identity` (in rank order): ``{identity: ranks}`` for each
    device held by more than one rank."""
    ranks: dict[tuple[str, str], list[int]] = {}
    for rank, ident in enumerate(identities):
        ranks.setdefault(tuple(ident), []).append(rank)
    return {ident: rs for ident, rs in ranks.items() if len(rs) > 1}


def _all_gather_object(obj, group) -> list:
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def check_one_rank_per_device(group=None, device: torch.device | None = None, *, all_gather=None) -> None:
    """Raise ``RuntimeError`` on every rank of ``group`` (default: the world) if two of them use
    the same GPU. Collective: call on every rank after ``init_process_group``. Does nothing on
    CPU. ``all_gather(obj, group) -> list`` replaces ``dist.all_gather_object`` (tests)."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if device.type != "cuda":
        return
    gather = all_gather or _all_gather_object
    identities = gather(device_identity(device), group)
    clashes = shared_devices(identities)
    if clashes:
        lines = "; ".join(f"ranks {rs} on host {host} all use {key}" for (host, key), rs in clashes.items())
        raise RuntimeError(
            f"more than one rank per GPU: {lines}. Each rank needs its own GPU: launch with torchrun or deepspeed "
            f"(they set LOCAL_RANK per rank), with at most as many ranks per node as GPUs (this rank's LOCAL_RANK is "
            f"{os.environ.get('LOCAL_RANK', 'unset')}, CUDA_VISIBLE_DEVICES {os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')})"
        )


def move_batch(batch: dict, device: torch.device, non_blocking: bool = True) -> dict:
    """The batch with every tensor value on ``device``, in nested dicts too (an image-text batch's
    ``multimodal``); other values as they are."""
    def move(value):
        if isinstance(value, dict):
            return {key: move(v) for key, v in value.items()}
        return value.to(device, non_blocking=non_blocking) if isinstance(value, torch.Tensor) else value

    return move(batch)
