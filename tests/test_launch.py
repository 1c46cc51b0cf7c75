"""The spawn harness (``launch.run_ranks``) that the tests, sp-bench and benchmarks use."""

import os
import subprocess
import sys

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
