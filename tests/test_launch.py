"""The spawn harness (``launch.run_ranks``) that the tests, sp-bench and benchmarks use, and the tests' pool of ranks (``launch.RankPool``)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bar_rank(rank, world):
    import tqdm

    for _ in tqdm.tqdm(range(2), disable=rank != 0):  # tqdm's lock is a multiprocessing semaphore
        pass
    return rank


def test_ranks_leave_nothing_for_the_resource_tracker():
    """Ranks leave with os._exit once their result is saved; the semaphores they made must
    be released first, or the parent warns of leaked ones at shutdown (sp-bench did)."""
    code = "from ulysses_sp.launch import run_ranks; from tests.test_launch import bar_rank; print(run_ranks(bar_rank, 2))"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0, 1]"
    assert "leaked" not in done.stderr, done.stderr


# --------------------------------------------------------------------------- the pool of ranks


def _state(rank, world):
    """What a call sees of the state a call before it may have changed."""
    import random

    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    import ulysses_sp as usp

    t = torch.ones(1)
    dist.all_reduce(t)  # the default group works
    return {"env": os.environ.get("USP_PLANTED"), "torch rng": torch.rand(1).item(), "random": random.random(), "cwd": os.getcwd(),
            "dtype": str(torch.get_default_dtype()), "threads": torch.get_num_threads(), "grad": torch.is_grad_enabled(),
            "backends": usp.list_backends(), "groups": len(c10d._world.pg_names), "sum": t.item()}


def _plant(rank, world):
    """Leave behind everything the pool resets; returns the state as this call left it."""
    import random

    import torch
    import torch.distributed as dist

    import ulysses_sp as usp
    from ulysses_sp.registry import get_backend

    os.environ["USP_PLANTED"] = "1"
    torch.manual_seed(1234)
    random.seed(5)
    os.chdir("/")
    torch.set_default_dtype(torch.float64)
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    ring = type(get_backend("ring"))()
    ring.name = "planted"
    usp.register_backend(ring)
    dist.new_group(list(range(world)))
    return _state(rank, world)


def _replace(rank, world):
    """Replace a module attribute of ulysses_sp and leave it so: the pool cannot put that back."""
    from ulysses_sp import comm

    comm._record = lambda *args: None
    return _state(rank, world)


def _destroy(rank, world):
    import torch.distributed as dist

    dist.destroy_process_group()


def _fail(rank, world):
    """Rank 0 raises while the others wait for it in a collective."""
    import torch
    import torch.distributed as dist

    if rank == 0:
        raise ValueError("planted failure")
    dist.all_reduce(torch.ones(1))


def _stall(rank, world):
    import time

    time.sleep(60 if rank == 1 else 0)


class _Cycle:
    """An object in a reference cycle of its own: only the garbage collector frees it."""

    def __init__(self):
        self.me = self


_KEPT_ALIVE = []


def _leave(rank, world, path):
    """Drop a cycle whose collection touches ``path``.RANK; keep another alive (its id returned)."""
    import pathlib
    import weakref

    weakref.finalize(_Cycle(), pathlib.Path(f"{path}.{rank}").touch)
    _KEPT_ALIVE.append(_Cycle())
    return id(_KEPT_ALIVE[-1])


def _collectable(rank, world, ids):
    """Whether this rank's collections still walk the object ``_leave`` kept alive."""
    import gc

    return any(id(o) == ids[rank] for o in gc.get_objects())


def test_the_pool_collects_what_a_call_drops_and_freezes_what_it_keeps(pool, tmp_path):
    """A call's cyclic garbage is collected before its result comes back; what it left alive is
    frozen, out of later collections' sight (a Trainer run's collections walked every earlier case's).
    On the 1-rank pool, the one idle soonest: every pool's ranks run the same loop."""
    ids = pool(1).run(_leave, str(tmp_path / "collected"))
    assert (tmp_path / "collected.0").exists(), "the dropped cycle was not collected"
    assert pool(1).run(_collectable, ids) == [False]


def test_the_pool_resets_what_a_call_leaves_and_starts_anew_when_it_cannot():
    """A planted leak (environment, random streams, working directory, dtype, threads, grad mode, a
    registered backend, a process group) is not seen by the next call; a replaced module attribute,
    a destroyed default group, a failing rank and a stalled one are each handled as documented."""
    from ulysses_sp.launch import RankFailure, RankPool

    from .conftest import PRELOAD

    pool = RankPool(2, preload=PRELOAD)
    try:
        clean = pool.run(_state)
        leaked = pool.run(_plant)
        assert all(a != b for a, b in zip(leaked, clean)), "the plant must change what _state sees"
        assert pool.run(_state) == clean
        assert (pool.spawns, pool.restarts) == (1, [])

        assert pool.run(_destroy) == [None, None]
        assert pool.run(_state) == clean and pool.spawns == 1, "a new default group on the same ranks"

        pool.run(_replace)
        assert len(pool.restarts) == 1 and "ulysses_sp.comm._record" in pool.restarts[0], pool.restarts
        assert pool.run(_state) == clean and pool.spawns == 2

        with pytest.raises(RankFailure, match="planted failure") as failed:
            pool.run(_fail)
        assert "--- rank 1, still running ---" in str(failed.value) and "in _fail" in str(failed.value), str(failed.value)
        assert "raised on ranks [0]" in pool.restarts[-1]
        assert pool.run(_state) == clean and pool.spawns == 3

        with pytest.raises(RankFailure, match=r"ranks \[1\] of 2 still running after 3 s") as stalled:
            pool.run(_stall, timeout=3)
        assert "in _stall" in str(stalled.value), str(stalled.value)
        assert pool.run(_state) == clean and pool.spawns == 4
    finally:
        pool.close()
