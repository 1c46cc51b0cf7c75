"""ulysses_sp/rl.py: sequence log-probabilities summed over the SP group, exact against one process
in fp64 (cases in tests/rl_cases.py), for packed rows under zigzag, balanced and contiguous and for
unpacked rows; a per-rank part in place of the group's sum is far off; the tiled log-probabilities hold
no full-vocabulary tensor in the forward."""

import pytest

from .conftest import values


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.quick(world=2)
def test_sequence_logprobs_equal_one_process(ranks, world):
    for r in values(ranks(world), "rl/sequences"):
        for run, got in r.items():
            assert got["sums"] < 1e-12 and got["counts"], (run, got)
            for name, (loss_error, grad_error) in got["errors"].items():
                assert loss_error < 1e-12 and grad_error < 1e-12, (run, name, got["errors"])
            assert got["per_rank_mean_moves"] > 1e-2, (run, got)  # the bug the group's sum guards against is visible
        held = r["zigzag-packed"]["first_doc_targets_per_rank"]
        assert held[0] > 0 and all(n == 0 for n in held[1:]), held  # the first document's targets are on rank 0 only


def test_token_logprobs_are_tiled(ranks):
    """512 tokens x 1000 classes in fp64, chunks of 16: beyond the logits the forward holds per-token
    numbers and one chunk's log-softmax (observed 17 KB; the plain log_softmax and gather 4.1 MB, the
    whole [512, 1000]), the backward the logits' gradient and one chunk's softmax (4.5 MB; plain 12.3 MB)."""
    (r,) = values(ranks(1), "rl/memory")
    (tiled_fwd, tiled_bwd), (plain_fwd, plain_bwd) = r["tiled"], r["plain"]
    full = 512 * 1000 * 8
    assert plain_fwd >= full and tiled_fwd < 16 * 1000 * 8 * 3 + 512 * 8 * 4, r
    assert tiled_bwd < full + 16 * 1000 * 8 * 4 + 512 * 8 * 4 < plain_bwd, r
