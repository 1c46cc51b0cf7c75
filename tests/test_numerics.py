"""fp16 error growth with the number of ranks, and bitwise determinism of every backend."""

import pytest

from .conftest import values


@pytest.mark.parametrize("world", [2, 4])
def test_fp16_error_does_not_grow_with_ranks(ranks, world):
    """As the bf16 test in test_parity: error at P ranks <= 1.5x the error at P=1, per backend."""
    one = values(ranks(1), "numerics/fp16")[0]
    for r in values(ranks(world), "numerics/fp16"):
        for backend, errors in r.items():
            for what, err, base in zip(("out", "dq", "dk", "dv"), errors, one[backend]):
                assert err <= 1.5 * base, f"{backend} {what}: {err:.3g} at P={world} vs {base:.3g} at P=1"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_same_inputs_give_bitwise_same_results(ranks, world):
    for rank, r in enumerate(values(ranks(world), "numerics/deterministic")):
        for (config, backend), equal in r.items():
            assert all(equal), f"rank {rank}, {backend} {config}: out, dq, dk, dv bitwise equal: {equal}"
