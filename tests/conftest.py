import itertools
import json
import os
import pickle
import queue
import threading
import time
from concurrent.futures import Future

import pytest

os.environ.setdefault("OMP_NUM_THREADS", "1")
"""One thread a process, for this one, the fork server's ranks and every subprocess a test starts: the
pools keep both cores busy, and a second OpenMP thread spins waiting for the core another rank holds."""

PRELOAD = ("torch", "ulysses_sp", "transformers", "deepspeed", "tests.cases", "transformers.trainer", "torch._inductor.compile_fx",
           "trl.trainer.dpo_trainer", "trl.trainer.grpo_trainer", "trl.trainer.sft_trainer", "tests.trl_cases", "tests.hf_trainer_cases",
           "tests.ds_cases", "tests.frozen")
"""What the pools' fork server imports once (the ranks are forked from it: 0.02 CPU s a rank, not
the 5 s of a spawned rank's imports); one missing is skipped by the server. The last freezes what
the others made (tests/frozen.py)."""


def _start_fork_server() -> None:
    """Start the fork server now, before this process imports torch and collects: its imports (7 s
    on this machine) run on the other core meanwhile, not when the first test waits for a rank.
    Once: not again in what it starts (a rank that imports this module, which inherits the mark)."""
    import multiprocessing
    from multiprocessing import forkserver

    if not os.environ.get("USP_TESTS_FORK_SERVER"):
        os.environ["USP_TESTS_FORK_SERVER"] = str(os.getpid())
        multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
        forkserver.ensure_running()


_start_fork_server()
STARTED = time.perf_counter()
"""When this module loaded: the origin of USP_POOL_STATS's timelines."""

from ulysses_sp import registry  # noqa: E402
from ulysses_sp.launch import RankFailure, RankPool  # noqa: E402

LIBRARY_BACKENDS = tuple(registry.list_backends())
"""The backends the library registers (before tests/cases.py's import registers the tests' own)."""

from .cases import CASES, WORLDS, keep_backends, library_backends_only, run_case  # noqa: E402

__all__ = ["WORLDS", "free_port", "pool_results", "started_early", "values"]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.quick(name=value, ...)`` puts only the parametrized items whose parameters equal
    those (a tuple: any of its values) in the quick slice; a bare ``quick`` puts every item. Runs before
    ``-m`` selects, and records every item's place in the slice for tests/test_quick.py."""
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        for mark in [m for m in item.own_markers if m.name == "quick" and m.kwargs]:
            if any(params.get(k) not in (v if isinstance(v, tuple) else (v,)) for k, v in mark.kwargs.items()):
                item.own_markers.remove(mark)
    config.stash[QUICK] = {item.nodeid: item.get_closest_marker("quick") is not None for item in items}
    args = config.invocation_params.args
    config.stash[WHOLE] = not (config.option.markexpr or config.option.keyword or any("::" in a or a.endswith(".py") for a in args))


def pytest_collection_finish(session):
    """Start the background work of each selected test made with ``started_early`` (after ``-m`` and
    ``-k`` have selected): a subprocess that runs on the other core while earlier tests run. And
    freeze what importing and collecting made, as the fork server does (tests/frozen.py)."""
    import gc

    gc.freeze()
    for item in session.items:
        start = getattr(getattr(item, "function", None), "start_early", None)
        if start is not None:
            item.stash[EARLY] = start(session.config._tmp_path_factory.mktemp(item.name[:30]))


EARLY = pytest.StashKey[object]()


def started_early(start):
    """Decorate a test whose subprocess ``start(tmp_dir) -> Popen`` begins when the session starts;
    the test takes it with the ``early`` fixture. For a subprocess of one core that a test would
    otherwise wait for with the other core idle (the quick slice leaves it a third of the time)."""
    def mark(test):
        test.start_early = start
        return test

    return mark


@pytest.fixture
def early(request):
    """The ``Popen`` that ``started_early`` started for this test."""
    return request.node.stash[EARLY]


QUICK = pytest.StashKey[dict]()
"""Every collected test's node id: whether it is in the quick slice."""
WHOLE = pytest.StashKey[bool]()
"""Whether the session runs the whole suite (no file, node, ``-k`` or ``-m`` chosen): then every case will be asked for."""

CASE_TIMEOUT = 600.0
"""Seconds one case may take on its pool (the slowest, compile-model/ at P=3, took 152 s in a fresh clone beside the rest of the suite); past it the pool is ended."""


class Ranks:
    """One world size's ``RankPool``, driven by a thread of its own.

    Tests call ``run(fn, *args)``, ``call(fn, *args)`` (run once per arguments and kept) and
    ``case(name)`` (tests/cases.py's cases, each run once and kept); while no test waits, the
    thread runs the cases and calls the session will ask for (``prefetch``, ``prefetch_call``), so
    the pools of every world size and the tests in this process share the cores: a pool of 4 ranks
    on 2 cores spends most of its time waiting for a collective's ranks to be scheduled.
    """

    def __init__(self, world: int):
        self.pool, self.queue, self.seq = RankPool(world, preload=PRELOAD), queue.PriorityQueue(), itertools.count()
        self.calls, self.asked, self.lock = {}, set(), threading.Lock()
        """The futures of ``call``'s and ``case``'s calls by function and arguments, and the keys a test asked for."""
        self.seconds, self.cpu, self.timeline = {}, {}, []
        """Wall seconds, and the ranks' CPU seconds, of the calls that returned (a case by its name,
        summed by function name otherwise); each call's name, start and end (seconds into the session)."""
        self.thread = threading.Thread(target=self._serve, name=f"usp-pool-{world}", daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while True:
            _, _, job = self.queue.get()
            if job is None:
                return
            fn, args, timeout, reply = job
            if reply.running() or reply.done():  # a prefetched call a test asked for sooner, queued again
                continue
            reply.set_running_or_notify_cancel()
            start = time.perf_counter()
            try:
                got = self.pool.run(fn, *args, timeout=timeout)
            except Exception as e:  # noqa: BLE001 - handed to the test that waits for it
                got = e
            name = args[0] if fn is run_case else fn.__qualname__  # a function called again adds to its figures
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
            self.timeline.append((name, start - STARTED, time.perf_counter() - STARTED))
            if not isinstance(got, BaseException):
                self.cpu[name] = self.cpu.get(name, 0.0) + self.pool.cpu
            reply.set_result(got)

    def _submit(self, priority: int, fn, args, timeout: float, reply: Future | None = None) -> Future:
        reply = reply or Future()
        self.queue.put((priority, next(self.seq), (fn, args, timeout, reply)))
        return reply

    def run(self, fn, *args, timeout: float = 240.0) -> list:
        """``run_ranks(fn, world, *args)`` on the pool, before any prefetched call still queued."""
        return value_of(self._submit(0, fn, args, timeout))

    def future(self, fn, *args, timeout: float = 240.0) -> Future:
        """The future of the one call of ``fn(*args)`` (its value, or the exception it raised); one
        prefetched but still queued is queued again, ahead of the prefetched cases."""
        key = (fn.__module__, fn.__qualname__, pickle.dumps(args))
        with self.lock:  # a pool's thread prefetches too (``after``)
            got = self.calls.get(key)
            if got is None or not (got.running() or got.done()):
                self.calls[key] = self._submit(0, fn, args, timeout, got)
            self.asked.add(key)
            return self.calls[key]

    def call(self, fn, *args, timeout: float = 240.0) -> list:
        """``run`` made once per function and arguments: every test that asks shares the value."""
        return value_of(self.future(fn, *args, timeout=timeout))

    def case(self, name: str):
        """Each rank's value of case ``name``, or the ``RankFailure`` it raised (kept, not retried)."""
        return self.future(run_case, name, timeout=CASE_TIMEOUT).result()

    def _prefetch(self, priority: int, fn, args, timeout: float) -> None:
        key = (fn.__module__, fn.__qualname__, pickle.dumps(args))
        with self.lock:
            if key not in self.calls:
                self.calls[key] = self._submit(priority, fn, args, timeout)

    def prefetch(self, names) -> None:
        """Queue cases ahead of the test asking for them."""
        for name in names:
            self._prefetch(1, run_case, (name,), CASE_TIMEOUT)

    def after(self, other: "Ranks", name: str) -> None:
        """Queue case ``name`` once ``other`` (prefetched it and) ran it: a compile case then finds every
        graph in Inductor's cache, the shard shapes being the same (3 ranks lowering compile-model/'s
        graphs beside the 2-rank pool's took 37.5 CPU s in a fresh clone, 8.7 once they were cached)."""
        other.calls[(run_case.__module__, run_case.__qualname__, pickle.dumps((name,)))].add_done_callback(lambda _: self.prefetch([name]))

    def prefetch_call(self, fn, args, timeout: float) -> None:
        """Queue ``call(fn, *args)`` after the prefetched cases."""
        self._prefetch(2, fn, args, timeout)

    def close(self) -> None:
        self.queue.put((-1, -1, None))
        self.thread.join()
        self.pool.close()

    def summary(self) -> list[str]:
        p = self.pool
        lines = [f"{p.world_size} ranks: {p.calls} calls in {sum(self.seconds.values()):.0f} s, {p.spawns} spawn(s), "
                 f"{sum(self.cpu.values()):.0f} CPU s in the calls, {p.lifetime_cpu:.0f} in the ranks' lives (every rank)"]
        lines += [f"  ended early: {why}" for why in p.restarts]
        lines += [f"  prefetched, never asked for: {module}.{name}" for module, name, _ in set(self.calls) - self.asked if name != "run_case"]
        costliest = sorted(self.cpu.items(), key=lambda kv: -kv[1])[:8]
        return lines + [f"  {cpu:6.1f} CPU s {self.seconds[name]:6.1f} s  {name}" for name, cpu in costliest]


def value_of(future: Future):
    """The value of a ``Ranks.future``; raises the exception its call raised."""
    got = future.result()
    if isinstance(got, BaseException):
        raise got
    return got


def pool_results(pool, calls) -> list:
    """The value of each ``(world, fn, args, timeout)`` call of a module's ``pool_calls``, every pool asked at once."""
    futures = [pool(world).future(fn, *args, timeout=timeout) for world, fn, args, timeout in calls]
    return [value_of(future) for future in futures]


@pytest.fixture(scope="session")
def pool(request):
    """``pool(world)``: the session's ``Ranks`` of ``world`` gloo ranks, started on first use and kept
    for every test after (``pool(world).run(fn, *args)`` is ``run_ranks(fn, world, *args)``). When the
    session runs the whole suite, every world's cases start in the background at once; a compile
    case on a larger world is queued once its smallest world has run it, so that it finds the graphs
    that world compiled in Inductor's cache (their shards have the same shapes) rather than compiling
    them beside it.

    After the cases, each test module's ``pool_calls(items)`` (its selected tests) queues the
    ``(world, fn, args, timeout)`` calls they will ``call``: a pool that finishes its cases goes on
    with the training runs of modules whose turn has not come (the run's last minutes were
    otherwise one pool's calls, one after the other, as the tests asked, with the cores half idle)."""
    made = {}

    def get(world: int) -> Ranks:
        if world not in made:
            made[world] = Ranks(world)
        return made[world]

    calls, items, whole = [], request.session.items, request.config.stash.get(WHOLE, False)
    for module in sorted({item.module for item in items if getattr(item, "module", None)}, key=lambda m: m.__name__):
        calls += getattr(module, "pool_calls", lambda _: ())([item for item in items if getattr(item, "module", None) is module])
    for world in sorted({world for world, *_ in calls} | set(WORLDS if whole else ())):
        if whole:  # the cases first: a pool starts on what is queued when it is made
            names = [name for name, (_, worlds) in CASES.items() if world in worlds]
            compiled_first = {name: min(CASES[name][1]) for name in names if name.startswith("compile") and world != min(CASES[name][1])}
            get(world).prefetch([name for name in names if name not in compiled_first])
            for name, smallest in compiled_first.items():
                get(world).after(get(smallest), name)
        for _, fn, args, timeout in (call for call in calls if call[0] == world):
            get(world).prefetch_call(fn, args, timeout)
    yield get
    for ranks in made.values():
        ranks.close()
    if os.environ.get("USP_POOL_STATS"):  # every call's wall and CPU seconds, for finding where the time goes
        with open(os.environ["USP_POOL_STATS"], "w") as f:
            json.dump({w: {"seconds": r.seconds, "cpu": r.cpu, "timeline": r.timeline} for w, r in made.items()}, f, indent=1)
    request.config.stash[POOLS] = [line for world in sorted(made) for line in made[world].summary()]


POOLS = pytest.StashKey[list]()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With USP_POOL_STATS set, each test's CPU seconds in this process and the children it waited
    for (launchers, subprocesses), into ``config.stash[TESTS]``."""
    if not os.environ.get("USP_POOL_STATS"):
        yield
        return
    import resource

    def cpu():
        return sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)))

    start, began = cpu(), time.perf_counter() - STARTED
    yield
    item.config.stash.setdefault(TESTS, {})[item.nodeid] = (cpu() - start, began, time.perf_counter() - STARTED)


TESTS = pytest.StashKey[dict]()


def pytest_terminal_summary(terminalreporter, config):
    """Each pool's calls, spawns, restarts and slowest calls: where the multi-rank time went."""
    if config.stash.get(POOLS, None):
        terminalreporter.write_sep("=", "pools of ranks")
        for line in config.stash[POOLS]:
            terminalreporter.write_line(line)
    if config.stash.get(TESTS, None):
        with open(os.environ["USP_POOL_STATS"] + ".tests.json", "w") as f:
            json.dump(config.stash[TESTS], f, indent=1)


@pytest.fixture(scope="module")
def pooled_spawns(pool):
    """``ulysses_sp.launch.run_ranks`` served by the session's pools while the module's tests run
    (what sp-bench spawns for its ranks): the same call without the spawn and its imports. A call
    asking for more than one thread a rank, or made under ``MALLOC_MMAP_THRESHOLD_`` (sp-bench's
    memory pass, which needs fresh processes: libc reads it at start, and the peak resident set
    of a pool rank is that of every case before), is spawned as before. The tests' own backends are
    hidden from the call, as a spawned rank would not have them."""
    from ulysses_sp import launch

    spawn = launch.run_ranks

    def run_ranks(fn, world_size, *args, timeout=240.0, collective_timeout=60.0, threads_per_rank=1):
        if threads_per_rank != 1 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
            return spawn(fn, world_size, *args, timeout=timeout, collective_timeout=collective_timeout, threads_per_rank=threads_per_rank)
        return pool(world_size).run(library_backends_only, LIBRARY_BACKENDS, fn, *args, timeout=min(timeout, CASE_TIMEOUT))

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(launch, "run_ranks", run_ranks)
        yield


@pytest.fixture(scope="session")
def ranks(pool):
    """``ranks(world)``: the results of tests/cases.py's cases on ``world`` ranks (see ``values``)."""
    return pool


def values(results: Ranks, name: str) -> list:
    """The value every rank returned for case ``name``; fails with the ranks' tracebacks otherwise."""
    got = results.case(name)
    if isinstance(got, RankFailure):
        pytest.fail(f"case {name} raised:\n{got}")
    return got


def _script_main(argv: list, env: dict, cwd: str, log: str, backends: tuple) -> None:
    """``python argv...`` in a process forked from the pools' fork server: the environment, working
    directory and arguments as given, stdout and stderr appended to ``log``, the tests' own backends
    gone from the registry (a fresh interpreter would not have them)."""
    import runpy
    import sys

    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    for std in (1, 2):
        os.dup2(fd, std)
    keep_backends(backends)
    sys.argv = list(argv)
    runpy.run_path(argv[0], run_name="__main__")


def warm_python(argv: list, *, env: dict, cwd: str, log: str):
    """A started ``multiprocessing`` process that runs ``python *argv`` (a script) as a launcher's
    rank would, without the seconds of a new interpreter's imports: torch, transformers, deepspeed
    and the project come imported from the fork server (started as this module loads). ``exitcode``
    is the script's exit status (negative: the signal that killed it); its output is in ``log``."""
    import multiprocessing

    proc = multiprocessing.get_context("forkserver").Process(target=_script_main, args=(list(argv), dict(env), cwd, log, LIBRARY_BACKENDS))
    proc.start()
    return proc


def free_port() -> int:
    """A port nothing listens on now, for a launcher to bind; never one given before in this session.
    Below the kernel's ephemeral range (``ip_local_port_range``): a port the OS hands out (bind to 0)
    is free only until released, and the pools' gloo connections take their local ports from that
    range by the thousand; one took the deepspeed launcher's port in the gap (EADDRINUSE, once in
    about thirty runs)."""
    import random
    import socket
    from pathlib import Path

    ranges = Path("/proc/sys/net/ipv4/ip_local_port_range")
    ephemeral = int(ranges.read_text().split()[0]) if ranges.exists() else 32768  # Linux's default elsewhere
    while True:
        port = random.randrange(10_000, ephemeral)
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


_GIVEN: set[int] = set()
"""The ports ``free_port`` gave (two launchers of one test bind theirs at once)."""
