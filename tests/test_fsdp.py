"""FSDP2 with SP (ulysses_sp/integrations/fsdp.py): parameters after training equal one process
trained on the same global batch. Cases in tests/fsdp_cases.py; fp32, tolerance 1e-6 (observed:
at most 6.0e-8 after SGD, 5.2e-8 after AdamW)."""

import pytest
import torch

from .conftest import values

pytest.importorskip("transformers")


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.quick(world=2)
def test_fsdp2_training_equals_one_process(ranks, world):
    """SP = 2 (world 2), SP = 3 (world 3) and DP = 2 x SP = 2 (world 4): one SGD step (each SP group's token mean,
    DP averaged: divide factor = DP size) and three AdamW steps with accumulation 2 (the global
    batch's token mean: divide factor 1), with and without the tiled loss and tiled MLP."""
    for rank, result in enumerate(values(ranks(world), "fsdp/")):
        assert set(result) == {f"{s}-{v}" for s in ("sgd_step", "adamw_steps") for v in ("plain", "tiled")}
        for name, difference in result.items():
            assert difference < 1e-6, f"rank {rank}, {name}: parameters {difference:.2e} from one process"


def test_wrong_gradients_are_caught(ranks):
    """The comparisons can fail: averaging over all 4 ranks (FSDP2's own default) halves the SP sum
    (SGD); weighting the micro-batches equally, not by their targets, changes AdamW's steps."""
    for result in values(ranks(4), "fsdp-wrong/"):
        assert result["sgd"] > 1e-3 and result["adamw"] > 1e-5, result


def test_other_placements_and_a_hybrid_model_are_exact(ranks):
    """The contiguous and balanced layouts, and Qwen3.5 (Gated DeltaNet layers under their mixer
    strategy beside attention), one SGD step each."""
    for result in values(ranks(2), "fsdp-placements/"):
        assert set(result) == {"contiguous", "balanced", "qwen3_5"}
        assert max(result.values()) < 1e-6, result


def test_fully_shard_options_pass_through(ranks):
    """bf16 parameters (fp32 reductions) within bf16's tolerance; no reshard and CPU offload exact."""
    for result in values(ranks(2), "fsdp-options/"):
        assert result["bf16"] < 3e-2 and result["no-reshard"] < 1e-5 and result["offload"] < 1e-5, result


def test_bad_input_is_refused_before_any_collective():
    from ulysses_sp.integrations.fsdp import apply_fsdp2
    from ulysses_sp.topology import Topology

    from .hf_cases import tiny_model

    topo = Topology.for_planning(2)
    with pytest.raises(ValueError, match="gradient_divide_factor must be > 0"):
        apply_fsdp2(tiny_model("llama"), topo, gradient_divide_factor=0)
    with pytest.raises(ValueError, match="no decoder layers found in Linear"):
        apply_fsdp2(torch.nn.Linear(2, 2), topo)
