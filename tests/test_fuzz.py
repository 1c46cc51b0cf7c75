"""Property-based parity: Hypothesis draws backend, layout, batch, tokens, heads (GQA), head dim,
causal, scale, trainable inputs and packed documents, on 1-4 ranks, against fp64 one-process attention.

Budget: ``USP_FUZZ_EXAMPLES`` per world (default 100, about 18 s over the four worlds on
2 cores). Soak locally with e.g.
``USP_FUZZ_EXAMPLES=2000 python -m pytest tests/test_fuzz.py -q`` (a file chosen: only the cases its tests ask for run).
Configs a backend's ``check()`` refuses are counted as skipped.
"""

import pytest

from .conftest import WORLDS, values

TOL = 1e-10


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.quick(world=2)
def test_random_configs_match_reference(ranks, world):
    results = values(ranks(world), "fuzz/parity")
    assert len({r["digest"] for r in results}) == 1, "ranks drew different examples"
    for rank, r in enumerate(results):
        assert not r["failures"], f"rank {rank}: {r['failures'][:3]}"
        assert r["run"] > 0, f"rank {rank}: every example skipped ({r['skipped']})"
        for what, err in r["max"].items():
            assert err < TOL, f"rank {rank}, {what}: {err:.3g} for {r['worst'][what]}"
