"""ulysses_sp.devices on CPU: the launcher's environment, binding a GPU per rank and catching two
ranks on one GPU (torch.cuda faked), and batches moved to the rank's device."""

import types

import pytest
import torch

from ulysses_sp import devices


@pytest.fixture
def env(monkeypatch):
    for name in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "values, expected",
    [
        ({}, None),
        ({"LOCAL_WORLD_SIZE": "4"}, 4),  # torchrun
        ({"LOCAL_SIZE": "2"}, 2),  # the deepspeed launcher
        ({"LOCAL_WORLD_SIZE": "8", "LOCAL_SIZE": "2"}, 8),  # torchrun's wins
        ({"LOCAL_WORLD_SIZE": "", "LOCAL_SIZE": "3"}, 3),  # empty counts as unset
        ({"LOCAL_WORLD_SIZE": "0", "LOCAL_SIZE": "3"}, 3),
    ],
)
def test_local_world_size_reads_torchrun_then_deepspeed(env, values, expected):
    for name, value in values.items():
        env.setenv(name, value)
    assert devices.local_world_size() == expected
    assert devices.local_world_size(default=5) == (expected or 5)


def test_local_rank_defaults_to_zero_and_rejects_garbage(env):
    assert devices.local_rank() == 0
    env.setenv("LOCAL_RANK", "3")
    assert devices.local_rank() == 3
    env.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK"):
        devices.local_rank()
    env.setenv("LOCAL_SIZE", "two")
    with pytest.raises(ValueError, match="LOCAL_SIZE"):
        devices.local_world_size()


class FakeCuda:
    """torch.cuda's is_available / device_count / set_device / current_device /
    get_device_properties for a machine with ``count`` GPUs."""

    def __init__(self, monkeypatch, count: int, uuids=True):
        self.count, self.current = count, 0
        monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "set_device", self.set_device)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: self.current)
        monkeypatch.setattr(
            torch.cuda, "get_device_properties",
            lambda i: types.SimpleNamespace(name="fake", uuid=f"uuid-{i}" if uuids else None),
        )

    def set_device(self, index):
        if not 0 <= index < self.count:
            raise RuntimeError("invalid device ordinal")
        self.current = index


@pytest.mark.quick
def test_bind_device_is_cpu_without_cuda(env):
    FakeCuda(env, 0)
    env.setenv("LOCAL_RANK", "1")
    assert devices.bind_device() == torch.device("cpu")


def test_bind_device_sets_local_rank_as_current(env):
    cuda = FakeCuda(env, 4)
    env.setenv("LOCAL_RANK", "2")
    assert devices.bind_device() == torch.device("cuda", 2)
    assert cuda.current == 2


def test_bind_device_refuses_more_ranks_than_gpus(env):
    cuda = FakeCuda(env, 2)
    env.setenv("LOCAL_RANK", "2")
    env.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(RuntimeError, match=r"LOCAL_RANK 2 .* only 2 GPU\(s\) \(CUDA_VISIBLE_DEVICES=0,1\)"):
        devices.bind_device()
    assert cuda.current == 0


def _world(env, cuda, local_ranks, hosts=None, uuid_of=None):
    """Bind every simulated rank in turn (same process), then give each its identity list:
    the fake all-gather returns every rank's identity in rank order."""
    identities = []
    for rank, lr in enumerate(local_ranks):
        env.setenv("LOCAL_RANK", str(lr))
        device = devices.bind_device()
        env.setattr(devices.socket, "gethostname", lambda h=(hosts or ["node0"] * len(local_ranks))[rank]: h)
        identities.append(devices.device_identity(device))
    gathered = []

    def fake_all_gather(obj, group):
        gathered.append(obj)
        return list(identities)

    return identities, fake_all_gather, gathered


def test_one_rank_per_gpu_passes(env):
    cuda = FakeCuda(env, 2)
    identities, gather, gathered = _world(env, cuda, [0, 1])
    assert identities == [("node0", "GPU-uuid-0"), ("node0", "GPU-uuid-1")]
    devices.check_one_rank_per_device(None, torch.device("cuda", 1), all_gather=gather)
    assert gathered == [("node0", "GPU-uuid-1")]  # this rank's identity went into the gather


def test_two_ranks_on_one_gpu_raise(env):
    """LOCAL_RANK unset (e.g. a plain mpirun): every rank binds cuda:0."""
    cuda = FakeCuda(env, 2)
    _, gather, _ = _world(env, cuda, [0, 0, 1])
    with pytest.raises(RuntimeError, match=r"more than one rank per GPU: ranks \[0, 1\] on host node0 all use GPU-uuid-0"):
        devices.check_one_rank_per_device(None, torch.device("cuda", 0), all_gather=gather)


def test_same_index_on_different_hosts_is_fine_without_uuid(env):
    cuda = FakeCuda(env, 1, uuids=False)
    identities, gather, _ = _world(env, cuda, [0, 0], hosts=["node0", "node1"])
    assert identities == [("node0", "cuda:0"), ("node1", "cuda:0")]
    devices.check_one_rank_per_device(None, torch.device("cuda", 0), all_gather=gather)
    _, gather, _ = _world(env, cuda, [0, 0], hosts=["node0", "node0"])
    with pytest.raises(RuntimeError, match=r"ranks \[0, 1\] on host node0 all use cuda:0"):
        devices.check_one_rank_per_device(None, torch.device("cuda", 0), all_gather=gather)


def test_shared_devices_lists_every_clash():
    ids = [("a", "g0"), ("a", "g1"), ("a", "g0"), ("b", "g0"), ("a", "g1")]
    assert devices.shared_devices(ids) == {("a", "g0"): [0, 2], ("a", "g1"): [1, 4]}
    assert devices.shared_devices([("a", "g0"), ("b", "g0")]) == {}


def test_check_is_a_no_op_on_cpu(env):
    FakeCuda(env, 0)

    def never(obj, group):
        raise AssertionError("no collective on CPU")

    devices.check_one_rank_per_device(None, all_gather=never)
    devices.check_one_rank_per_device(None, torch.device("cpu"), all_gather=never)


def test_move_batch_moves_every_tensor():
    batch = {
        "input_ids": torch.zeros(1, 8, dtype=torch.long),
        "position_ids": torch.arange(8).unsqueeze(0),
        "shift_labels": torch.full((1, 8), -100),
        "cu_seqlens": torch.tensor([0, 3, 8], dtype=torch.int32),
        "note": "kept",
    }
    moved = devices.move_batch(batch, torch.device("meta"))
    assert set(moved) == set(batch) and moved["note"] == "kept"
    for key in ("input_ids", "position_ids", "shift_labels", "cu_seqlens"):
        assert moved[key].device.type == "meta"
        assert moved[key].dtype == batch[key].dtype and moved[key].shape == batch[key].shape
    assert devices.move_batch(batch, torch.device("cpu"))["input_ids"] is batch["input_ids"]
