"""The main job (``train.py``): options, DeepSpeed config, data, the training loop, export."""

from .config import JobError, TrainConfig, memory_options, parse_args
from .ds_config import precision_config, resolve_dtype
from .run import Job, main, train

__all__ = ["Job", "JobError", "TrainConfig", "main", "memory_options", "parse_args", "precision_config", "resolve_dtype", "train"]
