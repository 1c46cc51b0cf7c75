"""Run a function on N gloo ranks (spawned CPU processes) with a deadline.

Used by the tests and the benchmarks. A rank that raises makes the others stop
at once and its traceback is reported; ranks still running at the deadline are
killed and the call raises, so a hang fails a test instead of CI.

``run_ranks`` spawns a fresh group per call; ``RankPool`` keeps one alive across
calls (the test suite's ranks), resetting between them what a call may leave
behind, and starting anew after a call that failed or left state it cannot reset.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import gc
import os
import pickle
import random
import shutil
import signal
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["run_ranks", "RankFailure", "RankPool", "kept_groups"]


class RankFailure(AssertionError):
    pass


def _rank_setup(rank: int, world_size: int, threads: int) -> None:
    torch.set_num_threads(threads)
    # what torchrun sets; DeepSpeed, for one, insists on LOCAL_RANK
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size))


def _init_group(tmp: str, store: str, rank: int, world_size: int, collective_timeout: float) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tmp}/{store}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=collective_timeout))


def _rank_main(fn, rank: int, world_size: int, tmp: str, args, collective_timeout: float, threads: int) -> None:
    _rank_setup(rank, world_size, threads)
    try:
        _init_group(tmp, "store", rank, world_size, collective_timeout)
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


# --------------------------------------------------------------------------- a pool of ranks

_KEPT: set = set()
"""Names of the process groups a pool call asked to keep (``kept_groups``); pool workers only."""


def _group_names() -> set:
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_names.values()) if dist.is_initialized() else set()


@contextlib.contextmanager
def kept_groups():
    """Process groups created inside outlive the pool call that made them (a cache of topologies
    shared by later calls); every other group a call creates is destroyed after it."""
    before = _group_names()
    try:
        yield
    finally:
        _KEPT.update(_group_names() - before)


def _namespaces() -> list:
    """The modules whose attributes a call must not leave replaced: torch.distributed and ours."""
    return [m for name, m in list(sys.modules.items())
            if m is not None and (name == "torch.distributed" or name == "ulysses_sp" or name.startswith("ulysses_sp."))]


def _fingerprint(modules: list) -> dict:
    """What a call may change and the worker cannot put back: each module attribute's identity."""
    return {(m.__name__, k): id(v) for m in modules for k, v in list(vars(m).items()) if not k.startswith("__")}


class _Baseline:
    """A worker's state after start-up, put back after every call: environment, random streams (seeded 0),
    torch's global flags, the registries of backends and kernels, the working directory."""

    def __init__(self):
        import numpy as np

        self.environ = dict(os.environ)
        self.cwd = os.getcwd()
        torch.manual_seed(0)  # the same streams on every rank (a fresh process's torch seed is random here)
        random.seed(0)
        np.random.seed(0)
        self.torch_rng, self.py_rng, self.np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
        self.flags = self._flags()
        self._modules = None
        self.imported()

    def imported(self) -> None:
        """Take what importing a module may register (a test module's own backends) as part of the
        baseline: called before each call, once its function's module is imported."""
        from . import kernels, registry

        if len(sys.modules) != self._modules:  # walking sys.modules (thousands) takes a rank longer than the rest of the restore
            self._modules = len(sys.modules)
            self.backends, self.made, self.kernels = dict(registry._BACKENDS), dict(registry._MADE), dict(kernels._KERNELS)
            self.namespaces = _namespaces()
            self.modules = _fingerprint(self.namespaces)

    @staticmethod
    def _flags() -> tuple:
        return (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads(), torch.are_deterministic_algorithms_enabled(),
                torch.is_anomaly_enabled())

    def restore(self) -> list:
        """Put the state back; returns what could not be (module attributes replaced)."""
        import numpy as np

        from . import kernels, registry

        os.environ.clear()
        os.environ.update(self.environ)
        os.chdir(self.cwd)
        torch.set_rng_state(self.torch_rng)
        random.setstate(self.py_rng)
        np.random.set_state(self.np_rng)
        dtype, grad, threads, deterministic, anomaly = self.flags
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
        torch.autograd.set_detect_anomaly(anomaly)
        for live, saved in ((registry._BACKENDS, self.backends), (registry._MADE, self.made), (kernels._KERNELS, self.kernels)):
            live.clear()
            live.update(saved)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()  # compiled graphs and their guards
        now = _fingerprint(self.namespaces)
        return sorted(f"{m}.{k}" for (m, k), v in self.modules.items() if now.get((m, k), v) != v)


def _drop_groups(before: set) -> None:
    """Destroy the groups a call created, except those it kept (a gloo group's thread lives on while
    anything refers to the group: the collection after the call frees those in reference cycles)."""
    from torch.distributed import distributed_c10d as c10d

    now = _group_names()
    if dist.is_initialized():
        by_name = {name: pg for pg, name in list(c10d._world.pg_names.items())}
        for name in now - before - _KEPT:
            if by_name[name] is not c10d.GroupMember.WORLD:
                dist.destroy_process_group(by_name[name])
    else:
        _KEPT.clear()


def _pool_main(rank: int, world_size: int, tmp: str, conn, collective_timeout: float, threads: int) -> None:
    _rank_setup(rank, world_size, threads)
    stack = open(os.path.join(tmp, f"stack{rank}"), "w")  # noqa: SIM115 - kept open: faulthandler writes to its descriptor
    if hasattr(signal, "SIGUSR1"):  # the pool asks a rank that is still running for its stack when it ends the pool
        faulthandler.register(signal.SIGUSR1, file=stack)
    try:
        _init_group(tmp, "store0", rank, world_size, collective_timeout)
        import ulysses_sp  # noqa: F401  (what every call uses, imported before the baseline is taken)

        baseline = _Baseline()
        gc.freeze()  # what start-up made (imports, the group) stays: later collections need not walk it
        conn.send(("ready", None))
        while True:
            task = conn.recv_bytes()
            if not task:
                break
            fn, args, generation = pickle.loads(task)
            baseline.imported()
            if not dist.is_initialized():  # the previous call destroyed it (the main job does), on every rank
                _init_group(tmp, f"store{generation}", rank, world_size, collective_timeout)
            before, cpu = _group_names(), time.process_time()
            try:
                result = pickle.dumps(fn(rank, world_size, *args))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
                continue  # the parent ends the pool: other ranks may be stuck in a collective
            _drop_groups(before)
            leaked = baseline.restore()
            gc.collect()  # the call's garbage (a cycle may hold a dropped group, whose gloo thread wakes every 10 ms)
            gc.freeze()  # what it left alive (imports, caches) stays out of later collections' sight: a Trainer collects at each run
            conn.send(("ok", (result, not dist.is_initialized(), leaked, time.process_time() - cpu)))
    except (EOFError, KeyboardInterrupt):
        pass
    except BaseException:
        with contextlib.suppress(Exception):
            conn.send(("error", traceback.format_exc()))
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _process_cpu(pid: int) -> float:
    """User and system CPU seconds of a live process and of its children it waited for (0 off Linux)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(v) for v in fields[11:15]) / os.sysconf("SC_CLK_TCK")


class RankPool:
    """``world_size`` gloo ranks started once and kept: ``run(fn, *args)`` is ``run_ranks(fn,
    world_size, *args)`` without the spawn, its imports and the process group's start. The ranks
    are forked from Python's fork server (never from the caller, whose other threads may hold a
    lock at the fork), so they start with the environment the server started with.

    Between calls each rank destroys the process groups the call created (but those made under
    ``kept_groups()``), re-creates the default group if the call destroyed it on every rank, and
    restores its environment variables, random streams (torch, random, numpy), torch's global
    flags, the backend and kernel registries, the working directory and torch.compile's caches,
    collects the call's garbage and freezes (``gc.freeze``) what it left alive.
    A call that raises on any rank, runs past its deadline, kills a rank, destroys the default
    group on some ranks only, or replaces an attribute of torch.distributed or ulysses_sp that
    it does not put back ends the pool (``restarts`` says why; the ranks still running add their Python
    stacks to the ``RankFailure``); the next call starts it anew.
    """

    def __init__(self, world_size: int, *, collective_timeout: float = 60.0, threads_per_rank: int = 1,
                 preload: tuple[str, ...] = ("torch", "ulysses_sp")):
        """``preload``: what the fork server imports once (a spawned rank imports it itself: seconds
        each). Python keeps one fork server per process and reads the list when it starts it; a
        module it cannot import is skipped."""
        self.world_size, self.collective_timeout, self.threads, self.preload = world_size, collective_timeout, threads_per_rank, preload
        self.procs, self.conns, self.tmp = [], [], None
        self.spawns, self.calls, self.restarts, self.cpu, self.lifetime_cpu = 0, 0, [], 0.0, 0.0
        """How often the ranks were spawned, how many calls ran, why each pool was ended early, the
        CPU seconds the ranks spent in the last call that returned (user and system, every rank), and
        those of the ended ranks' whole lives, idle time and waited-for children (a compiler) included."""
        self._generation = 0

    def _start(self, timeout: float) -> None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(list(self.preload))
        self.tmp = tempfile.mkdtemp(prefix="usp-pool-")
        self._generation = 0
        for r in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_pool_main, args=(r, self.world_size, self.tmp, child, self.collective_timeout, self.threads), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self.spawns += 1
        replies = self._collect(timeout, "starting")
        if any(kind != "ready" for kind, _ in replies):
            raise self._fail(replies, "starting")

    def _collect(self, timeout: float, what: str) -> list:
        """One reply per rank; on an error, a dead rank or the deadline the pool is ended and this raises."""
        replies, deadline = [None] * self.world_size, time.monotonic() + timeout
        waiting = dict(enumerate(self.conns))
        while waiting:
            left = deadline - time.monotonic()
            ready = wait(list(waiting.values()) + [p.sentinel for p in self.procs], timeout=max(left, 0))
            for r, conn in list(waiting.items()):
                if conn in ready:
                    try:
                        replies[r] = conn.recv()
                    except EOFError:
                        replies[r] = ("error", f"exit code {self.procs[r].exitcode}")
                    del waiting[r]
            dead = [r for r in waiting if not self.procs[r].is_alive() and not self.conns[r].poll()]
            for r in dead:
                replies[r] = ("error", f"exit code {self.procs[r].exitcode}")
                del waiting[r]
            if any(reply and reply[0] == "error" for reply in replies) and waiting:
                # the others may wait in a collective for the rank that failed: a moment for theirs, then stop
                deadline = min(deadline, time.monotonic() + 2.0)
            if waiting and time.monotonic() >= deadline:
                if not any(reply and reply[0] == "error" for reply in replies):
                    stacks = self._stacks(sorted(waiting))
                    self.close(f"{what}: ranks {sorted(waiting)} still running after {timeout:.0f} s")
                    raise RankFailure(f"ranks {sorted(waiting)} of {self.world_size} still running after {timeout:.0f} s (hang?)\n{stacks}")
                break
        return replies

    def _fail(self, replies: list, what: str) -> RankFailure:
        errors = {r: reply[1] for r, reply in enumerate(replies) if reply and reply[0] == "error"}
        stacks = self._stacks([r for r, reply in enumerate(replies) if reply is None])
        self.close(f"{what}: raised on ranks {sorted(errors)}")
        return RankFailure("\n".join([f"--- rank {r} ---\n{tb}" for r, tb in errors.items()] + ([stacks] if stacks else [])))

    def _stacks(self, ranks: list) -> str:
        """Where each of ``ranks``, still running, is: its Python stack (faulthandler's), for the report."""
        if not ranks or not hasattr(signal, "SIGUSR1"):
            return ""
        paths = {r: os.path.join(self.tmp, f"stack{r}") for r in ranks}  # each rank made its file as it started
        for r in ranks:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and not all(os.path.getsize(p) for p in paths.values()):
            time.sleep(0.05)
        return "\n".join(f"--- rank {r}, still running ---\n{Path(p).read_text().strip()}" for r, p in paths.items())

    def run(self, fn, *args, timeout: float = 240.0) -> list:
        """``[fn(rank, world_size, *args) for each rank]`` on the pool's ranks (spawned on first use)."""
        if not self.procs:
            self._start(timeout)
        task = pickle.dumps((fn, args, self._generation))
        for conn in self.conns:
            conn.send_bytes(task)
        self.calls += 1
        name = getattr(fn, "__qualname__", repr(fn))
        replies = self._collect(timeout, name)
        if any(reply is None or reply[0] != "ok" for reply in replies):
            raise self._fail(replies, name)
        results, destroyed, leaked, cpu = zip(*(reply[1] for reply in replies))
        self.cpu = sum(cpu)
        if all(destroyed):
            self._generation += 1
        elif any(destroyed):
            self.close(f"{name}: destroyed the default process group on ranks {[r for r, d in enumerate(destroyed) if d]} only")
        if any(leaked):
            self.close(f"{name}: left replaced {sorted(set().union(*leaked))}")
        return [pickle.loads(r) for r in results]

    def close(self, why: str | None = None) -> None:
        """End the ranks (the next ``run`` spawns new ones); ``why`` is recorded in ``restarts``."""
        if why:
            self.restarts.append(why)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.send_bytes(b"")
        self.lifetime_cpu += sum(_process_cpu(p.pid) for p in self.procs)
        deadline = time.monotonic() + 5.0
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
        if self.tmp:
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp = None
