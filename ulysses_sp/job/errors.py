"""The job's one error type, below every module of the job that raises it."""

__all__ = ["JobError"]


class JobError(ValueError):
    """A mistake in the job's input (flags, files, DeepSpeed config); ``main`` prints it as one line."""
