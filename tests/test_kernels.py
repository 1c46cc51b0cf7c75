"""Local kernels (one process) and proof that the reference catches a wrong mask or scale."""

import math
import sys

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


def explicit(q, k, v, *, causal, scale, bounds=None):
    """(out, lse) with an explicit mask: causal bottom-right aligned within each sequence of
    ``bounds`` ((q0, q1, k0, k1) per sequence; one sequence by default); lse -inf, out 0 for empty rows."""
    sq, sk, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    allowed = torch.zeros(sq, sk, dtype=torch.bool)
    for q0, q1, k0, k1 in bounds or [(0, sq, 0, sk)]:
        i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
        allowed[q0:q1, k0:k1] = (j <= i + (k1 - k0) - (q1 - q0)) if causal else True
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.repeat_interleave(groups, 2).double()) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1)
    probs = torch.where(allowed, torch.exp(scores - lse.unsqueeze(-1)), 0.0)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(groups, 2).double()), lse


SHAPES = {  # name: (Sq, Sk, varlen lengths of q and of k, or None)
    "square": (24, 24, None),
    "keys-longer": (10, 24, None),
    "queries-longer": (24, 10, None),
    "varlen": (24, 24, ((5, 0, 11, 8), (5, 3, 0, 16))),
}


@pytest.mark.parametrize("name", ["torch", "math"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [4, 1])
def test_block_forward_and_backward_match_explicit_masks(name, shape, causal, hkv):
    """The kernel contract in fp64: out, lse (-inf for a row that sees nothing), and the
    gradients from the final (out, lse), for bottom-right causal masks and packed sequences."""
    sq, sk, lens = SHAPES[shape]
    q, k, v = qkv(s=sq, sk=sk, hkv=hkv)
    varlen = kernels.Varlen.build(*lens, batch=2, device="cpu") if lens else None
    bounds = varlen.bounds() if varlen else None
    kernel = kernels.get_kernel(name)
    out, lse = kernel.block_forward(q, k, v, causal=causal, scale=0.3, varlen=varlen)
    ref, ref_lse = explicit(q, k, v, causal=causal, scale=0.3, bounds=bounds)
    assert (out - ref).abs().max() < TOL
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert (lse - ref_lse).nan_to_num(0.0, 0.0, 0.0).abs().max() < TOL
    if shape == "varlen" or (causal and shape == "queries-longer"):
        assert torch.isneginf(lse).any(), "the case must hold rows that see no key"
    dout = torch.randn_like(q)
    _, rg = grads(lambda *t: explicit(*t, causal=causal, scale=0.3, bounds=bounds)[0], q, k, v, dout)
    for got, want in zip(kernel.block_backward(dout, q, k, v, out, lse, causal=causal, scale=0.3, varlen=varlen), rg):
        assert (got - want).abs().max() < TOL


@pytest.mark.parametrize("name", ["torch", "math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hkv", [8, 2, 1])
def test_attend_matches_reference(name, causal, hkv):
    q, k, v = qkv(hkv=hkv)
    dout = torch.randn_like(q)
    out, g = grads(lambda *t: kernels.attend(*t, kernel=name, causal=causal, scale=0.2), q, k, v, dout)
    ref, rg = grads(lambda *t: reference_attention(*t, causal=causal, scale=0.2), q, k, v, dout)
    assert (out - ref).abs().max() < TOL
    for a, b in zip(g, rg):
        assert (a - b).abs().max() < TOL


def test_packed_attend_is_one_autograd_node():
    """Packed input loops over documents inside the kernel, under one autograd node: no
    per-document graph whose slice backward allocates a full-size gradient per document."""
    q, k, v = qkv(b=1, s=64, hq=2, hkv=1, d=8)
    lens = (4,) * 16
    varlen = kernels.Varlen.build(lens, lens, batch=1, device="cpu")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kernels.attend(*leaves, kernel="torch", causal=True, scale=0.3, varlen=varlen)
    assert [f[0].variable for f in out.grad_fn.next_functions[:3]] == leaves, "one node straight from q, k, v"
    out.sum().backward()
    _, rg = grads(lambda *t: reference_attention(*t, causal=True, scale=0.3, cu_seqlens=tuple(range(0, 65, 4))), q, k, v, torch.ones_like(q))
    for a, b in zip(leaves, rg):
        assert (a.grad - b).abs().max() < TOL


def test_auto_and_forced_kernels_resolve_or_say_why(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # not installed
    assert kernels.resolve_kernel("auto", torch.bfloat16, cpu, 64) == "torch"
    assert kernels.resolve_kernel("auto", torch.bfloat16, cuda, 64) == "torch"
    assert kernels.resolve_kernel("auto", torch.float64, cuda, 64) == "math", "no fused CUDA op takes fp64"
    with pytest.raises(ValueError, match="flash-attn is not installed"):
        kernels.resolve_kernel("flash_attn", torch.bfloat16, cuda, 64)
    with pytest.raises(ValueError, match="unknown attention kernel"):
        kernels.resolve_kernel("flash", torch.bfloat16, cuda, 64)


def test_merge_partials_equals_attention_over_all_keys():
    q, k, v = qkv(s=8, sk=20)
    fwd = kernels.get_kernel("torch").block_forward
    out = lse = None
    for kp, vp in [(k[:, :7], v[:, :7]), (k[:, 7:], v[:, 7:])]:
        out, lse = kernels.merge_partials(out, lse, *fwd(q, kp, vp, causal=False, scale=0.25))
    full, full_lse = fwd(q, k, v, causal=False, scale=0.25)
    assert (out - full).abs().max() < TOL and (lse - full_lse).abs().max() < TOL
    # a block that sees no key (lse = -inf) changes nothing
    empty_lse = torch.full_like(lse, float("-inf"))
    out2, lse2 = kernels.merge_partials(out, lse, torch.zeros_like(out), empty_lse)
    assert torch.equal(out2, out) and torch.equal(lse2, lse)


def test_merge_partials_accumulates_in_fp32():
    q, k, v = qkv(s=8, sk=16, dtype=torch.bfloat16)
    out, lse = kernels.merge_partials(None, None, *kernels.get_kernel("torch").block_forward(q, k[:, :8], v[:, :8], causal=False, scale=0.25))
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
    for name in ("torch", "math"):
        assert torch.equal(kernels.get_kernel(name).block_forward(q, k, v, causal=True, scale=0.3)[0].isnan(), ref)


@pytest.mark.parametrize("device,dtype,sk", [
    ("fake-cuda", torch.bfloat16, 256),
    *(("meta", dtype, sk) for dtype in (torch.bfloat16, torch.float32) for sk in (256, 384)),
])
def test_torch_kernel_cuda_ops_and_shapes(device, dtype, sk):
    """Which ATen ops the torch kernel calls on CUDA, with which shapes, without a GPU:
    FakeTensorMode with CUDA tensors (this CPU build cannot even slice those, so one square
    block), and meta tensors, which take the same CUDA path. bf16: the flash op with K/V at
    their own 2 heads (GQA not repeated); fp32: the memory-efficient op with K/V repeated to
    8 heads. Sk > Sq causal splits into a visible prefix and a square diagonal, merged."""
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if "scaled_dot_product" in str(func):
                calls.append((str(func.overloadpacket).split(".")[-1], [tuple(a.shape) for a in args[:3]]))
            return func(*args, **(kwargs or {}))

    kernel = kernels.get_kernel("torch")
    fake = device == "fake-cuda"
    with FakeTensorMode() if fake else contextlib.nullcontext(), Record():
        q = torch.empty(1, 256, 8, 64, dtype=dtype, device="cuda" if fake else "meta")
        k, v = (torch.empty(1, sk, 2, 64, dtype=dtype, device=q.device) for _ in range(2))
        out, lse = kernel.block_forward(q, k, v, causal=True, scale=0.125)
        grads = kernel.block_backward(out, q, k, v, out, lse, causal=True, scale=0.125)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1, 8, 256) and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    op = "_scaled_dot_product_flash_attention" if dtype == torch.bfloat16 else "_scaled_dot_product_efficient_attention"
    kv_heads = 2 if dtype == torch.bfloat16 else 8
    blocks = [256] if sk == 256 else [sk - 256, 256]  # the prefix and the diagonal
    assert calls == [(op, [(1, 8, 256, 64)] + [(1, kv_heads, n, 64)] * 2) for n in blocks] + [
        (op + "_backward", [(1, 8, 256, 64)] * 2 + [(1, kv_heads, n, 64)]) for n in blocks
    ], calls
