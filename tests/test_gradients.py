"""Gradient edge cases (issue #8): every backend against one-process fp64 attention on 1-4 ranks.

Ranks whose loss gives their output a zero, partial or expanded upstream gradient;
one module called twice in a step; ``torch.autograd.grad`` (all inputs, or q only);
q, k, v as non-contiguous views of one fused projection. A rank's loss must depend
on ``out`` (``0 * out.sum()`` is enough), or it never joins the backward collectives.
Frozen inputs, transposed leaves and a zero batch are covered by test_parity and test_errors.
"""

import pytest

from .conftest import WORLDS, values
from .reliability_cases import GRAD_CASES

TOL = 1e-10
"""fp64, relative to max(1, |reference|), as in test_parity."""


@pytest.mark.parametrize("world,name", [pytest.param(w, n, id=f"P{w}-{n}") for w in WORLDS for n in GRAD_CASES])
@pytest.mark.quick(world=2)
def test_gradient_edge_case_matches_reference(ranks, world, name):
    for rank, errors in enumerate(values(ranks(world), name)):
        for what, err in errors.items():
            assert isinstance(err, float) and err < TOL, f"rank {rank}, {what}: {err}"
