"""The side stream of pipelined backends (``ulysses_sp.streams.CommStream``).

Its CUDA branch cannot run here, so it runs against a recording stand-in for torch.cuda's
stream calls: the order of the waits is the whole of its correctness (a GPU confirms the
effect: benchmarks/gpu_check.py's stream check).
"""

from contextlib import contextmanager

import pytest
import torch

from ulysses_sp.streams import CommStream


@pytest.mark.quick
def test_cpu_is_inline():
    stream, ran = CommStream(torch.device("cpu")), []
    with stream.side():
        ran.append(1)
    stream.join(torch.zeros(1))
    assert stream.stream is None and ran == [1]


def test_cuda_orders_side_work_after_compute_and_compute_after_join(monkeypatch):
    log = []

    class FakeStream:
        def __init__(self, name, device=None):
            self.name, self.device = name, device

        def wait_stream(self, other):
            log.append(f"{self.name} waits for {other.name}")

    compute = FakeStream("compute")

    @contextmanager
    def use(stream):
        log.append(f"on {stream.name}")
        yield
        log.append(f"off {stream.name}")

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream("side", device))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: compute)
    monkeypatch.setattr(torch.cuda, "stream", use)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: log.append(f"{tuple(self.shape)} kept for {s.name}"))
    stream = CommStream(torch.device("cuda", 0))
    with stream.side():
        log.append("pack, post, wait, unpack")
    stream.join(torch.zeros(2), torch.zeros(3))
    assert log == [
        "side waits for compute",  # the inputs (or the attention output) are ready
        "on side",
        "pack, post, wait, unpack",
        "off side",
        "compute waits for side",  # before the kernel reads what arrived
        "(2,) kept for compute",  # the allocator must not reuse it while the compute stream may read it
        "(3,) kept for compute",
    ]
