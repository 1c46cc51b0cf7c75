"""A rank that dies, or stalls, in the middle of a forward or backward: every other rank
raises ``CollectiveError`` within the group's timeout instead of hanging.

Each repetition forks a fresh group of ranks from a fork server that has imported torch
and ulysses_sp (forking skips the seconds of imports a spawn costs; forking from the
pytest process itself, whose other threads may hold a lock at the fork, could leave a
child stuck); the victim exits abruptly, as a killed or crashed process does, right
after one of its collectives.
"""

import datetime
import json
import multiprocessing
import os
import time

import pytest
import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp import comm

TIMEOUT = 30.0
"""Seconds every collective of the group may take; survivors must fail well within it."""
VICTIM = 1
KILLS = [(backend, phase) for phase in ("forward", "backward") for backend in ("ulysses", "allgather", "ring", "hybrid")]
KILLS += KILLS[:2]  # ten repetitions
STALL_TIMEOUT = 3.0
"""A stalled rank is only noticed by the timeout: a short one keeps the test short."""


def _die_at_next_collective() -> None:
    comm._record = lambda *args: os._exit(17)


def _stall_at_next_collective() -> None:
    def stall(*args):
        time.sleep(4 * STALL_TIMEOUT)
        os._exit(17)

    comm._record = stall


def _rank(rank: int, world: int, tmp: str, backend: str, phase: str, stall: bool) -> None:
    result = {}
    try:
        torch.set_num_threads(1)
        seconds = STALL_TIMEOUT if stall else TIMEOUT
        timeout = datetime.timedelta(seconds=seconds)
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world, timeout=timeout)
        topo = usp.init_sequence_parallel(world, ulysses_degree=2 if world == 4 else None, timeout=seconds)
        trap = _stall_at_next_collective if stall else _die_at_next_collective
        gen = torch.Generator().manual_seed(rank)
        q, k, v = (torch.randn(1, 16, h, 8, generator=gen).requires_grad_() for h in (12, 4, 4))
        attn = usp.SequenceParallelAttention(topo, backend=backend)
        attn(q, k, v).sum().backward()  # a healthy step first (and the shape handshake)
        if rank == VICTIM and phase == "forward":
            trap()
        start = time.monotonic()
        try:
            out = attn(q, k, v)
            if rank == VICTIM:
                trap()
            out.sum().backward()
            result = {"error": "NO ERROR"}
        except Exception as e:
            result = {"error": f"{type(e).__name__}: {e}", "seconds": time.monotonic() - start}
    except BaseException as e:  # noqa: BLE001 - reported to the test
        result = {"error": f"setup failed: {type(e).__name__}: {e}"}
    finally:
        with open(os.path.join(tmp, f"{rank}.json"), "w") as f:
            json.dump(result, f)
        os._exit(0)


def _kill_one(world: int, backend: str, phase: str, tmp: str, stall: bool = False) -> dict:
    ctx = multiprocessing.get_context("forkserver")  # the pools' server, started by tests/conftest.py
    procs = [ctx.Process(target=_rank, args=(r, world, tmp, backend, phase, stall)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + TIMEOUT + 30
    for p in procs[:VICTIM] + procs[VICTIM + 1:] + ([] if stall else [procs[VICTIM]]):  # a stalled victim is not waited for
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive() and not (stall and r == VICTIM)]
    for p in procs:
        p.kill()
        p.join()
    survivors = {}
    for r in range(world):
        if r != VICTIM:
            path = os.path.join(tmp, f"{r}.json")
            survivors[r] = json.load(open(path)) if os.path.exists(path) else None
    return {"hung": hung, "victim_exit": procs[VICTIM].exitcode, "survivors": survivors}


@pytest.mark.parametrize("world", [2, 4])
def test_a_dead_rank_fails_the_others_within_the_timeout(tmp_path, world):
    hangs = 0
    for n, (backend, phase) in enumerate(KILLS):
        tmp = tmp_path / f"{world}-{n}"
        tmp.mkdir()
        got = _kill_one(world, backend, phase, str(tmp))
        hangs += bool(got["hung"])
        where = f"{backend} {phase}, repetition {n}"
        assert got["victim_exit"] == 17, f"{where}: the victim did not die at its collective ({got})"
        for rank, result in got["survivors"].items():
            assert result is not None, f"{where}: rank {rank} wrote nothing ({got})"
            assert result["error"].startswith("CollectiveError: ulysses-sp: "), f"{where}: rank {rank}: {result['error']}"
            assert "Another rank of the group probably died" in result["error"]
            assert result["seconds"] < TIMEOUT, f"{where}: rank {rank} took {result['seconds']:.1f} s"
    assert hangs == 0


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.quick(world=2)
def test_a_stalled_rank_fails_the_others_at_the_timeout(tmp_path, world):
    got = _kill_one(world, "ring", "backward", str(tmp_path), stall=True)
    assert not got["hung"], got
    for rank, result in got["survivors"].items():
        assert result["error"].startswith("CollectiveError: ulysses-sp: "), f"rank {rank}: {result['error']}"
        # the event is the timeout: never before it (load only delays it), and not hung (the deadline above)
        assert result["seconds"] >= STALL_TIMEOUT * 0.9, f"rank {rank}: failed after {result['seconds']:.1f} s, before the timeout"
