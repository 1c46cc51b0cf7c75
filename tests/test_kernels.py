"""Local kernels (one process) and proof that the reference catches a wrong mask or scale."""

import math

import pytest
import torch

from ulysses_sp import kernels

from .reference import reference_attention

TOL = 1e-10


def qkv(b=2, s=24, hq=8, hkv=2, d=16, sk=None, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g, dtype=dtype)
    k, v = (torch.randn(b, sk or s, hkv, d, generator=g, dtype=dtype) for _ in range(2))
    return q, k, v


def grads(fn, q, k, v, dout):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [8, 2, 1])
def test_local_attention_matches_reference(causal, hkv):
    q, k, v = qkv(hkv=hkv)
    dout = torch.randn_like(q)
    out, g = grads(lambda *t: kernels.local_attention(*t, causal=causal, scale=0.2), q, k, v, dout)
    ref, rg = grads(lambda *t: reference_attention(*t, causal=causal, scale=0.2), q, k, v, dout)
    assert (out - ref).abs().max() < TOL
    for a, b in zip(g, rg):
        assert (a - b).abs().max() < TOL


@pytest.mark.parametrize("path", ["cpu-kernel", "math"])
@pytest.mark.parametrize("causal", [True, False])
def test_attention_with_lse_and_backward(path, causal, monkeypatch):
    q, k, v = qkv()
    if path == "math":  # the off-CPU fallback, forced here so it is tested
        fwd = lambda *a, **kw: kernels._math_with_lse(*a, kw["causal"], kw["scale"])
        bwd = lambda *a, **kw: kernels._math_backward(*a, kw["causal"], kw["scale"])
    else:
        fwd, bwd = kernels.attention_with_lse, kernels.attention_with_lse_backward
    scale = 1 / math.sqrt(q.shape[-1])
    out, lse = fwd(q, k, v, causal=causal, scale=scale)
    dout = torch.randn_like(q)
    ref, rg = grads(lambda *t: reference_attention(*t, causal=causal), q, k, v, dout)
    assert (out - ref).abs().max() < TOL
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k.repeat_interleave(4, 2)) * scale
    if causal:
        scores = scores.masked_fill(~torch.ones(24, 24, dtype=torch.bool).tril(), float("-inf"))
    assert (lse - scores.logsumexp(-1)).abs().max() < TOL
    for a, b in zip(bwd(dout, q, k, v, out, lse, causal=causal, scale=scale), rg):
        assert (a - b).abs().max() < TOL


def test_merge_partials_equals_attention_over_all_keys():
    q, k, v = qkv(s=8, sk=20)
    parts = [(k[:, :7], v[:, :7]), (k[:, 7:], v[:, 7:])]
    out = lse = None
    for kp, vp in parts:
        out, lse = kernels.merge_partials(out, lse, *kernels.attention_with_lse(q, kp, vp, causal=False))
    full, full_lse = kernels.attention_with_lse(q, k, v, causal=False)
    assert (out - full).abs().max() < TOL and (lse - full_lse).abs().max() < TOL
    # a block that sees no key (lse = -inf) changes nothing
    empty_lse = torch.full_like(lse, float("-inf"))
    out2, lse2 = kernels.merge_partials(out, lse, torch.zeros_like(out), empty_lse)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_merge_partials_accumulates_in_fp32():
    q, k, v = qkv(s=8, sk=16, dtype=torch.bfloat16)
    out, lse = kernels.merge_partials(None, None, *kernels.attention_with_lse(q, k[:, :8], v[:, :8], causal=False))
    assert out.dtype == torch.float32 and lse.dtype == torch.float32


def test_empty_sequence_is_an_error_not_a_crash():
    q, k, v = qkv(s=0)
    with pytest.raises(ValueError, match="non-empty"):
        kernels.local_attention(q, k, v, causal=True)


def test_reference_catches_a_wrong_mask_and_scale():
    """What the parity tolerance (1e-10) is up against."""
    q, k, v = qkv(s=32)
    right = reference_attention(q, k, v, causal=True)
    assert (reference_attention(q, k, v, causal=True, diagonal=1) - right).abs().max() > 1e-2
    assert (reference_attention(q, k, v, causal=False) - right).abs().max() > 1e-2
    scale = 1 / math.sqrt(q.shape[-1])
    assert (reference_attention(q, k, v, causal=True, scale=scale * (1 + 1e-6)) - right).abs().max() > 1e-8
    assert (reference_attention(q, k, v, causal=True, cu_seqlens=(0, 31, 32)) - right).abs().max() > 1e-2


@pytest.mark.parametrize("what", ["inf in q", "nan in q", "inf in k"])
def test_non_finite_input_gives_nan_like_the_reference(what):
    """The CPU flash op returns 0 for a query row holding an inf; the kernels must not."""
    q, k, v = qkv(s=4, hq=2, hkv=1, d=8)
    t, row = (k, 1) if what.endswith("k") else (q, 2)
    t[0, row, 0] = float("inf" if what.startswith("inf") else "nan")
    ref = reference_attention(q, k, v, causal=True).isnan()
    assert ref.any()
    assert torch.equal(kernels.local_attention(q, k, v, causal=True).isnan(), ref)
    assert torch.equal(kernels.attention_with_lse(q, k, v, causal=True)[0].isnan(), ref)
