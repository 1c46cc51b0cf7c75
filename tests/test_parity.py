"""Every backend against one-process fp64 attention: out, dq, dk, dv on 1-4 ranks.

Tolerance: 1e-10 absolute in float64 (observed errors are ~1e-14). A wrong
causal mask moves outputs by ~1e-1 and a 1e-6 relative error in the softmax
scale by ~1e-7 (tests/test_kernels.py shows both), so both fail this bound by
orders of magnitude; ``test_a_wrong_layout_is_caught`` shows the distributed
harness catching a layout mix-up.
"""

import pytest

from ulysses_sp.layout import LAYOUTS

from .cases import BACKENDS, PARITY, PARITY_WORLDS
from .conftest import WORLDS, values
from .reliability_cases import PACKED_DOC_BACKENDS

TOL = {"torch.float64": 1e-10, "torch.float32": 1e-6, "torch.bfloat16": 2e-2}
RMS_TOL = {"torch.float64": 1e-12, "torch.float32": 1e-6, "torch.bfloat16": 1e-2}
"""Relative RMS error over the whole tensor (worst observed over every case and P: fp64 1.3e-14, fp32 5.4e-7, bf16 7.4e-3)."""
"""Per dtype, relative to the largest reference value (or absolute below 1):
fp32 and bf16 are bounded by their rounding (observed about 2e-7 and 8e-3),
fp64 is the mask/scale/layout check."""

QUICK = {f"{b}/{lay}-causal-gqa" for b in BACKENDS for lay in LAYOUTS} | {"halo/zigzag-window5", "ulysses-g2/zigzag-causal-gqa", "auto/zigzag-causal-gqa",
                                                                    "ring/zigzag-causal-sinks", "ring/zigzag-blocks-window13-packed"}
"""At P=2 in the quick slice: every backend under every layout."""
PARAMS = [
    pytest.param(world, name, id=f"P{world}-{name}", marks=[pytest.mark.quick] if world == 2 and name in QUICK else [])
    for world in WORLDS
    for name in PARITY
    if "mislabelled" not in name and world in PARITY_WORLDS[name]
]


@pytest.mark.parametrize("world,name", PARAMS)
def test_matches_one_process_reference(ranks, world, name):
    cfg = PARITY[name]
    dtype = str(cfg.dtype)
    tol = TOL[dtype]
    for rank, r in enumerate(values(ranks(world), f"parity/{name}")):
        assert r["out_dtype"] == dtype
        assert r["out"] < tol * max(1, r["out_scale"]), f"rank {rank}: out error {r['out']:.3g}"
        # and relative to the whole tensor: an absolute bound alone would pass rows of zeros where outputs are small
        assert r["out_rms"] < RMS_TOL[dtype], f"rank {rank}: out relative RMS error {r['out_rms']:.3g}"
        for grad in ("dq", "dk", "dv"):
            if grad[1] in cfg.grads:
                assert r[grad] is not None and r[grad] < tol * max(1, r[f"{grad}_scale"]), f"rank {rank}: {grad} error {r[grad]}"
                assert r[f"{grad}_rms"] < RMS_TOL[dtype], f"rank {rank}: {grad} relative RMS error {r[f'{grad}_rms']:.3g}"
                assert r[f"{grad}_dtype"] == dtype
            else:  # a frozen input gets no gradient at all (not zeros, not a crash)
                assert r[f"{grad}_is_none"], f"rank {rank}: {grad} should be None for a frozen input"
        if cfg.sinks:
            assert r["dsinks"] < tol * max(1, r["dsinks_scale"]) and r["dsinks_rms"] < RMS_TOL[dtype], f"rank {rank}: sinks' gradient {r}"
        if cfg.backend != "auto":
            assert r["chosen"] == [cfg.backend]
        if cfg.kernel == "flash_attn":
            assert r["flash_attn_calls"] > 0, "the flash_attn kernel (CPU fake) was not called"


@pytest.mark.parametrize("world", [2, 4])
def test_a_sink_per_ring_block_is_caught(ranks, world):
    """The sink enters each row's softmax once: folded in at every hop as well, the ring's output is off."""
    for r in values(ranks(world), "parity-planted/sink-per-ring-block"):
        assert r["out_rms"] > 1e-2 and r["dsinks_rms"] > 1e-2, r


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("name", ["ring/zigzag-blocks", "ring/zigzag-blocks-window13-packed"])
def test_a_block_lost_across_ring_steps_is_caught(ranks, world, name):
    """Each rank's blocks applied to its own keys only (the bidirectional block computed from the
    local shard): the ring's output and gradients are off on some rank."""
    got = values(ranks(world), f"parity-planted/blocks-lost-{name}")
    assert max(r["out_rms"] for r in got) > 1e-2 and max(r["dk_rms"] for r in got) > 1e-2, got


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
def test_a_wrong_layout_is_caught(ranks, world):
    """Zigzag shards run as if they were contiguous: the harness must see it."""
    for r in values(ranks(world), "parity/ulysses/mislabelled-layout"):
        assert r["out"] > 1e-2


@pytest.mark.parametrize("world", WORLDS)
def test_auto_picks_the_cheapest_feasible_backend(ranks, world):
    """The cheapest estimate wins; and, so that a policy picking by the same estimates in the wrong
    order cannot pass, the pick is pinned for the built-in CPU profiles at this shape (12 q heads,
    4 KV heads, 48 tokens; the test's allgather_stride* registrations are candidates too)."""
    pinned = {1: "allgather_stride1", 2: "ring", 3: "ring", 4: "ulysses"}
    for r in values(ranks(world), "parity/auto/zigzag-causal-gqa"):
        feasible = {n: t for n, t in r["considered"].items() if isinstance(t, float)}
        assert r["chosen"] == [min(feasible, key=feasible.get)]
        assert r["chosen"] == [pinned[world]], r["considered"]
        for name, why in r["considered"].items():
            assert isinstance(why, float) or why.startswith(f"{name}: ")


@pytest.mark.parametrize("world", [w for w in WORLDS if w > 1])
def test_all_backends_give_the_same_answer(ranks, world):
    """Each backend on the same shards against the fp64 reference (not against each other: a
    defect they shared would pass that)."""
    for r in values(ranks(world), "agree/all-backends"):
        assert set(r) == set(BACKENDS)
        assert max(r.values()) < 1e-10, r


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("world", [2, 4])
def test_low_precision_error_does_not_grow_with_ranks(ranks, world, dtype):
    """Blocks computed and merged in fp32: relative RMS error at P ranks <= 1.3x the error at P=1,
    per backend. Observed 1.13-1.21 over five seeds (a max-element error swings 0.7-2.6x with the
    seed); rounding the merged output to the input dtype after every merge gives 1.35 at P=4."""
    one = values(ranks(1), f"numerics/{dtype}")[0]
    for r in values(ranks(world), f"numerics/{dtype}"):
        for backend, errors in r.items():
            for what, err, base in zip(("out", "dq", "dk", "dv"), errors, one[backend]):
                assert err <= 1.3 * base, f"{backend} {what}: {err:.3g} at P={world} vs {base:.3g} at P=1"


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("world", [1, 2, 4])
def test_low_precision_error_is_that_of_the_dtype(ranks, world, dtype):
    """The same errors against the fp64 reference in absolute terms, so that a defect present at
    every P (P=1 included) cannot hide behind the ratio above: relative RMS at most 0.55 of the
    dtype's machine epsilon (observed 0.24-0.48 for bf16 and fp16 at P=1, 2 and 4)."""
    import torch

    bound = 0.55 * torch.finfo(torch.bfloat16 if dtype == "bf16" else torch.float16).eps
    for r in values(ranks(world), f"numerics/{dtype}"):
        for backend, errors in r.items():
            for what, err in zip(("out", "dq", "dk", "dv"), errors):
                assert err <= bound, f"{backend} {what}: relative RMS {err:.3g} at P={world}, bound {bound:.3g}"


@pytest.mark.parametrize("world", [1, 2, pytest.param(4, marks=pytest.mark.quick)])
def test_autocast_inputs_run_as_one_process_sdpa(ranks, world):
    """Under CPU bf16 autocast a model hands attention fp32 q and k (after RoPE) and a bf16 v: every
    backend computes in bf16 as SDPA does there (a bf16 output, each gradient in its input's dtype), with
    an error of the dtype's order against fp64 (below 0.55 eps, as above; SDPA's own is printed on failure).
    Before, the mixed dtypes were refused with a TypeError, and a trainer whose config left autocast on
    (TRL's bf16=True default) could not run."""
    import torch

    bound = 0.55 * torch.finfo(torch.bfloat16).eps
    for r in values(ranks(world), "numerics/autocast"):
        sdpa = r.pop("sdpa")
        for backend, got in r.items():
            assert got["dtypes"] == sdpa["dtypes"] == ["torch.bfloat16", "torch.float32", "torch.float32", "torch.bfloat16"], (backend, got, sdpa)
            for what, err in zip(("out", "dq", "dk", "dv"), got["errors"]):
                assert err <= bound, f"{backend} {what}: relative RMS {err:.3g} at P={world} (SDPA's {sdpa['errors']}), bound {bound:.3g}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_kernel_calls_do_not_grow_with_documents(ranks, world, backend):
    """flash-attn calls per forward with 24 and with 1000 packed documents: one varlen call
    per (query chunk, key run), at most 2 per local chunk (2 under zigzag) and ring step,
    whatever the number of documents; and the result is right. Unpacked, the zigzag ring
    makes one call per step, its own block included (one causal call, as torch's ring)."""
    bound = 1 if backend == "ulysses" else 4 * world
    got = values(ranks(world), f"kernel-calls/{backend}")
    for docs in (None, 24, 1000):  # rank 0 compares the gathered output, the same on every rank, with the reference
        assert got[0][docs]["err"] < 2e-2 * 4, (docs, got[0])
    for r in got:
        for docs in (24, 1000):
            assert r[docs]["calls"] <= bound, (docs, r)
        assert r[1000]["varlen"] > 0
        assert r[None]["varlen"] == 0, r
        if backend == "ring":
            assert r[None]["calls"] == world, r


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_balanced_kernel_calls_do_not_grow_with_documents(ranks, world, backend):
    """The same under the balanced layout, whose ranks hold 8 chunks of 2016 tokens: at most 2 calls
    per local chunk and ring step (16 P), with 24 documents as with 1000, and the result right."""
    bound = 1 if backend == "ulysses" else 2 * 8 * world
    got = values(ranks(world), f"kernel-calls-balanced/{backend}")
    for docs in (None, 24, 1000):
        assert got[0][docs]["err"] < 2e-2 * 4, (docs, got[0])
    for r in got:
        for docs in (None, 24, 1000):
            assert r[docs]["calls"] <= bound, (docs, r)
        assert r[1000]["varlen"] > 0


@pytest.mark.parametrize("backend", PACKED_DOC_BACKENDS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_packed_rows_of_1_to_40_documents(ranks, world, backend):
    """Every layout on rows of 1 to 40 documents (documents shorter than 2P tokens, one longer
    than half the row), fp64: out and dq, dk, dv within 1e-10 of one process (halo: window 5)."""
    results = values(ranks(world), f"packed-docs/{backend}")
    for rank, r in enumerate(results):
        assert {lay for _, lay in r} == set(LAYOUTS), r.keys()
        for (row, lay), got in r.items():
            for what, err in got["errors"].items():
                assert isinstance(err, float) and err < TOL["torch.float64"], f"rank {rank}, {row}, {lay}: {what} error {err}"
    rows = results[0].values()
    assert {min(g["documents"] for g in rows), max(g["documents"] for g in rows)} == {1, 40}
    assert any(g["short"] > g["documents"] // 2 for g in rows), "a row of mostly documents shorter than 2P"
    assert any(2 * g["longest"] > g["seq"] > g["longest"] for g in rows), "a row with a document longer than half"
