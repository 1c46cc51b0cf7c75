"""Run a function on N gloo ranks (spawned CPU processes) with a deadline.

Used by the tests and the benchmarks. A rank that raises makes the others stop
at once and its traceback is reported; ranks still running at the deadline are
killed and the call raises, so a hang fails a test instead of CI.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankFailure"]


class RankFailure(AssertionError):
    pass


def _rank_main(fn, rank: int, world_size: int, tmp: str, args, collective_timeout: float, threads: int) -> None:
    torch.set_num_threads(threads)
    # what torchrun sets; DeepSpeed, for one, insists on LOCAL_RANK
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"file://{tmp}/store",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=collective_timeout),
        )
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(tmp, f"{rank}.pt"))
        if dist.is_initialized():  # fn may have shut it down itself (the trainer does)
            dist.barrier()
            dist.destroy_process_group()
    except BaseException:
        with open(os.path.join(tmp, f"{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        os._exit(1)
    # The result is saved: run the Python exit handlers (multiprocessing's releases the
    # semaphores tqdm's lock made; skipping it makes the parent warn of leaked ones), then
    # leave without the C++ teardown, where a library's leftover thread can abort
    # ("terminate called", seen once in ~10 trainer runs here). Whether the main job
    # itself exits cleanly is measured by benchmarks/clean_exit.py.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args, timeout: float = 240.0, collective_timeout: float = 60.0, threads_per_rank: int = 1) -> list:
    """``[fn(rank, world_size, *args) for each rank]``, run on ``world_size`` spawned gloo ranks.

    ``fn`` must be importable (a module-level function) and return something
    ``torch.save`` can store. Each rank gets ``threads_per_rank`` intra-op
    threads (one by default: spawned ranks easily oversubscribe the cores).
    """
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="usp-ranks-") as tmp:
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, tmp, args, collective_timeout, threads_per_rank), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                if any(p.exitcode not in (None, 0) for p in procs) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            hung = [r for r, p in enumerate(procs) if p.is_alive()]
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        errors = {}
        for r in range(world_size):
            path = os.path.join(tmp, f"{r}.err")
            if os.path.exists(path):
                errors[r] = open(path).read()
            elif procs[r].exitcode not in (0, None) and r not in hung:
                errors[r] = f"exit code {procs[r].exitcode}"
        if errors:
            raise RankFailure("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in errors.items()))
        if hung:
            raise RankFailure(f"ranks {hung} of {world_size} still running after {timeout:.0f} s (hang?)")
        return [torch.load(os.path.join(tmp, f"{r}.pt"), weights_only=False) for r in range(world_size)]
