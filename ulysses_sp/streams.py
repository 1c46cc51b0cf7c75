"""Where a pipelined backend's collectives and their copies run.

On CUDA a `CommStream` is a side stream: the packing copies, the
collective (NCCL queues it behind the stream that issues it) and the unpacking
copies of one pipeline stage run there while the attention kernel of the
previous stage runs on the compute stream; events order the two, so the host
never blocks on a transfer. Elsewhere (CPU, meta) it is inline: the work runs
in program order on the host, and overlap comes from posting the collective
asynchronously (gloo runs it on its own thread) before the computation.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

__all__ = ["CommStream"]


class CommStream:
    """``with s.side(): ...`` runs its work on the side stream after everything already
    queued on the compute stream; ``s.join(*tensors)`` makes the compute stream wait for the
    side stream before it uses ``tensors`` made there (and keeps their memory until it has)."""

    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @contextmanager
    def side(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def join(self, *tensors: torch.Tensor) -> None:
        if self.stream is None:
            return
        compute = torch.cuda.current_stream(self.stream.device)
        compute.wait_stream(self.stream)
        for t in tensors:
            t.record_stream(compute)
