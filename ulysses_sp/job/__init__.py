"""The main job (``train.py``): options, DeepSpeed config, data, the training loop, export.

``main`` checks the flags and the launch before it imports the training loop (transformers,
DeepSpeed: seconds per rank), so ``train.py --help`` and a bad flag answer at once."""

import os
import sys

from .config import TrainConfig, check_launch, memory_options, parse_args
from .errors import JobError
from .ds_config import precision_config, resolve_dtype

__all__ = ["Job", "JobError", "TrainConfig", "main", "memory_options", "parse_args", "precision_config", "resolve_dtype", "train"]


def main(argv=None) -> None:
    cfg = parse_args(argv)
    try:
        check_launch(cfg, int(os.environ.get("WORLD_SIZE", "1")))
        from .run import train

        train(cfg)
    except JobError as e:
        print(f"train.py: error: {e}", file=sys.stderr, flush=True)
        sys.exit(2)


def __getattr__(name: str):
    if name in ("Job", "train"):
        from . import run

        return getattr(run, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
