import pytest

from ulysses_sp.launch import run_ranks

from .cases import WORLDS, run_cases

__all__ = ["WORLDS", "free_port", "values"]


@pytest.fixture(scope="session")
def ranks():
    """``ranks(world)``: every case of tests/cases.py run once on ``world`` gloo ranks;
    a list (one per rank) of ``{case name: {"ok", "value" | "error"}}``."""
    done = {}

    def get(world: int):
        if world not in done:
            done[world] = run_ranks(run_cases, world, timeout=600)
        return done[world]

    return get


def values(results, name: str) -> list:
    """The value every rank returned for case ``name``; fails with the rank's traceback otherwise."""
    out = []
    for rank, per_rank in enumerate(results):
        r = per_rank[name]
        if not r["ok"]:
            pytest.fail(f"case {name} raised on rank {rank}:\n{r['error']}")
        out.append(r["value"])
    return out


def free_port() -> int:
    """A port nothing listens on now (the OS picks it): launchers in tests never share a fixed one."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
