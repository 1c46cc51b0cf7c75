"""Bitwise determinism of every backend (fp16 error growth is tested beside bf16 in test_parity)."""

import pytest

from .conftest import values


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.quick(world=2)
def test_same_inputs_give_bitwise_same_results(ranks, world):
    for rank, r in enumerate(values(ranks(world), "numerics/deterministic")):
        for (config, backend), equal in r.items():
            assert all(equal), f"rank {rank}, {backend} {config}: out, dq, dk, dv bitwise equal: {equal}"
