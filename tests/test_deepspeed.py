"""DeepSpeed: the gradient the engine holds after backward equals the one-process
gradient of the same global batch, per ZeRO stage (0-3, reduce-scatter on and off);
the drop-in DistributedAttention.

Tolerance: relative 1e-5 in fp32 (observed about 4e-7). A gradient off by a
factor 2 (the scale DeepSpeed's own HF recipe gets on ZeRO 0/1/2 at SP=2) is a
relative error of 1 and fails by five orders of magnitude.
"""

import pytest

pytest.importorskip("deepspeed", reason="the deepspeed extra is not installed")

from .conftest import values  # noqa: E402
from .ds_cases import STAGES  # noqa: E402

TOL = 1e-5


@pytest.mark.parametrize("world", [2, 4])  # SP=2, and SP=2 x DP=2
@pytest.mark.parametrize("stage,reduce_scatter", STAGES)
@pytest.mark.quick(world=2)
def test_engine_gradient_equals_one_process(ranks, world, stage, reduce_scatter):
    for r in values(ranks(world), "deepspeed/gradients"):
        got = r[f"{stage}-{reduce_scatter}"]
        dp, sp = world // 2, 2
        assert got["scale"] == (dp * sp if (stage, reduce_scatter) == (3, True) else dp)
        assert got["rel_err"] < TOL, got
        assert abs(got["ratio"] - 1) < TOL, got  # gradient norms, engine over one process: no factor left


@pytest.mark.parametrize("world", [2, 4])
def test_drop_in_distributed_attention(ranks, world):
    for r in values(ranks(world), "deepspeed/distributed_attention"):
        assert r["vs_reference"] < 1e-12 and r["vs_deepspeed"] < 1e-12 and r["grad_scale"] > 1e-3, r


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CUDA accelerator builds no such op")
def test_deepspeed_on_cpu_builds_no_shared_memory_op():
    """DeepSpeed's CPU accelerator would JIT-build its shared-memory all-reduce (g++, 30-140 s per
    install path) at every first init_distributed, behind a lock file that a rank killed mid-build
    leaves for every later start to wait on forever (a CI run hung so). Only its inference
    all-reduce uses the op; use_cpu_accelerator_if_needed turns the build off."""
    from deepspeed.comm.torch import build_shm_op

    from ulysses_sp.integrations.deepspeed import use_cpu_accelerator_if_needed

    use_cpu_accelerator_if_needed()
    assert build_shm_op() is None
