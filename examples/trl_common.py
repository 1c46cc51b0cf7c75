"""What the TRL examples share: a tiny Llama and its word-level tokenizer written once (no download),
and generated texts in its 40 words ``w0 .. w39``, each mostly followed by the word three on."""

from __future__ import annotations

import os
import random
import tempfile

import torch.distributed as dist


def tiny_model_dir() -> str:
    """A tiny Llama and its tokenizer in a folder every rank reads (rank 0 writes it)."""
    from ulysses_sp.testing.tiny_checkpoint import write_tiny_llama

    path = os.path.join(tempfile.gettempdir(), "ulysses-sp-trl-example-model")
    if not dist.is_initialized() or dist.get_rank() == 0:
        if not os.path.exists(os.path.join(path, "config.json")):
            write_tiny_llama(path)
    if dist.is_initialized():
        dist.barrier()
    return path


def words(rng: random.Random, n: int) -> str:
    start = rng.randrange(40)
    return " ".join(f"w{(start + 3 * i + (rng.random() < 0.1)) % 40}" for i in range(n))
