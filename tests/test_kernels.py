"""Local kernels (one process) and proof that the reference catches a wrong mask or scale."""

import contextlib
import math
import sys

import pytest
import torch

from ulysses_sp import kernels
from ulysses_sp.kernels import torch_kernel
from ulysses_sp.testing import fake_flash_attn

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


def contract_mask(sq, sk, causal, window=(-1, -1)):
    """The kernel contract's mask, literally: query i sees key j iff (left < 0 or j >= i + sk - sq - left)
    and (right < 0 or j <= i + sk - sq + right) and (not causal or j <= i + sk - sq)."""
    left, right = window
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    ok = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        ok &= j >= i + sk - sq - left
    if right >= 0:
        ok &= j <= i + sk - sq + right
    if causal:
        ok &= j <= i + sk - sq
    return ok


def explicit(q, k, v, *, causal, scale, bounds=None, window=(-1, -1), softcap=0.0):
    """fp64 (out, lse) with an explicit mask: :func:`contract_mask` within each sequence of
    ``bounds`` ((q0, q1, k0, k1) per sequence; one sequence by default); lse -inf, out 0 for empty rows."""
    sq, sk, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    allowed = torch.zeros(sq, sk, dtype=torch.bool)
    for q0, q1, k0, k1 in bounds or [(0, sq, 0, sk)]:
        allowed[q0:q1, k0:k1] = contract_mask(q1 - q0, k1 - k0, causal, window)
    scores = torch.einsum("bqhd,bkhd->bhqk", q.double(), k.repeat_interleave(groups, 2).double()) * scale
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
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
@pytest.mark.quick
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


@pytest.mark.parametrize("what", ["inf in q", "nan in q", "inf in k", "inf and -inf in q"])
def test_non_finite_input_gives_nan_like_the_reference(what):
    """The CPU flash op returns 0 for a query row holding an inf; the kernels must not (the
    torch kernel finds non-finite blocks by their sum: +inf and -inf together sum to NaN)."""
    q, k, v = qkv(s=4, hq=2, hkv=1, d=8)
    t, row = (k, 1) if what.endswith("k") else (q, 2)
    t[0, row, 0] = float("inf" if what.startswith("inf") else "nan")
    if what == "inf and -inf in q":
        t[0, row, 1] = float("-inf")
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


# --------------------------------------------------------------------------- windows and soft-capping

WINDOW_CASES = {  # name: (Sq, Sk, varlen lengths of q and of k or None, causal, window, softcap)
    "sliding-causal (W-1, 0)": (24, 24, None, True, (5, 0), 0.0),
    "sliding-keys-longer": (10, 24, None, True, (3, -1), 0.0),
    "band": (24, 24, None, False, (3, 2), 0.0),
    "band-keys-longer": (9, 24, None, False, (1, 4), 0.0),
    "band-queries-longer (empty top rows)": (30, 10, None, False, (2, 1), 0.0),
    "open-right-queries-longer": (30, 8, None, False, (2, -1), 0.0),  # flash-attn would bound the right at Sk
    "right-past-keys (empty top rows)": (30, 8, None, False, (-1, 12), 0.0),  # flash-attn would drop the bound
    "varlen-sliding": (28, 28, ((7, 0, 9, 12), (7, 6, 0, 15)), True, (3, 0), 0.0),
    "varlen-open-right": (24, 14, ((12, 3, 0, 9), (3, 0, 5, 6)), False, (1, -1), 0.0),
    "softcap": (16, 24, None, False, None, 1.5),
    "softcap-sliding": (24, 24, None, True, (5, 0), 2.0),
    "softcap-varlen-band": (24, 24, ((5, 0, 11, 8), (5, 3, 0, 16)), False, (2, 3), 1.0),
}
KERNEL_CONFIGS = {  # name: (kernel, dtype, fake flash-attn version, torch_kernel.TILE, tolerance)
    "math-fp64": ("math", torch.float64, None, None, TOL),
    "math-fp32": ("math", torch.float32, None, None, 1e-5),
    "torch-fp64": ("torch", torch.float64, None, None, TOL),
    "torch-fp32-tiles-of-8": ("torch", torch.float32, None, 8, 1e-5),
    "torch-bf16-tiles-of-8": ("torch", torch.bfloat16, None, 8, 2e-2),
    "flash-2.6.3": ("flash_attn", torch.bfloat16, "2.6.3", None, 2e-2),
    "flash-2.7.2": ("flash_attn", torch.bfloat16, "2.7.2", None, 2e-2),
    "flash-2.8.3": ("flash_attn", torch.bfloat16, "2.8.3", None, 2e-2),
}


def rel(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1)).item()


def run_case(config, case, monkeypatch, seed=0):
    """The kernel's (out, lse, dq, dk, dv) and the fp64 reference's, from the same inputs."""
    name, dtype, version, tile, _ = KERNEL_CONFIGS[config]
    sq, sk, lens, causal, window, softcap = WINDOW_CASES[case]
    if tile:
        monkeypatch.setattr(torch_kernel, "TILE", tile)
    q, k, v = qkv(s=sq, sk=sk, hq=4, hkv=2, seed=seed, dtype=dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    varlen = kernels.Varlen.build(*lens, batch=2, device="cpu") if lens else None
    opts = dict(causal=causal, scale=0.3, varlen=varlen, window=window, softcap=softcap)
    with fake_flash_attn.install(version) if version else contextlib.nullcontext():
        kernel = kernels.get_kernel(name)
        out, lse = kernel.block_forward(q, k, v, **opts)
        got = [out, lse, *kernel.block_backward(dout, q, k, v, out, lse, **opts)]
    ref_opts = dict(causal=causal, scale=0.3, bounds=varlen.bounds() if varlen else None, window=window or (-1, -1), softcap=softcap)
    ref, ref_lse = explicit(q, k, v, **ref_opts)
    _, ref_grads = grads(lambda *t: explicit(*t, **ref_opts)[0], *(t.double() for t in (q, k, v)), dout.double())
    return got, [ref, ref_lse, *ref_grads]


@pytest.mark.parametrize("case", WINDOW_CASES)
@pytest.mark.parametrize("config", KERNEL_CONFIGS)
def test_windows_and_softcap_match_explicit_masks(config, case, monkeypatch):
    """Every kernel against the contract's mask in fp64 (GQA 4/2 heads): out, lse (-inf and out 0,
    zero dq, on rows that see no key), dq, dk, dv from the kernel's own (out, lse)."""
    (out, lse, *g), (ref, ref_lse, *rg) = run_case(config, case, monkeypatch)
    dtype, tol = KERNEL_CONFIGS[config][1], KERNEL_CONFIGS[config][4]
    assert out.dtype == dtype and lse.dtype == kernels.accumulator_dtype(dtype) and lse.shape == ref_lse.shape
    empty = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), empty)
    if "empty" in case or "varlen" in case:
        assert empty.any(), "the case must hold rows that see no key"
    assert not out.transpose(1, 2)[empty].any() and not g[0].transpose(1, 2)[empty].any()
    errors = [rel(out, ref), rel(lse[~empty], ref_lse[~empty])] + [rel(a, b) for a, b in zip(g, rg)]
    assert max(errors) < tol, f"errors out/lse/dq/dk/dv {errors}"


@pytest.mark.parametrize("config", ["math-fp64", "torch-fp64", "torch-fp32-tiles-of-8", "flash-2.8.3"])
@pytest.mark.parametrize("case", ["causal", "sliding"])
def test_a_strided_last_dimension_gives_the_same_attention(config, case, monkeypatch):
    """q, k, v, dout and out whose last dimension is strided (a view that transposed D, as a
    convolution's output is): the same out, lse and gradients as contiguous copies. torch's CPU
    fused op returned wrong values for such views without an error (1.9 off here), and flash-attn's
    C interface refuses them, before the kernels copied them (``common.last_dim_contiguous``)."""
    name, dtype, version, tile, _ = KERNEL_CONFIGS[config]
    if tile:
        monkeypatch.setattr(torch_kernel, "TILE", tile)
    q, k, v = qkv(s=20, sk=20, hq=4, hkv=2, seed=3, dtype=dtype)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(4)).to(dtype)

    def strided(t):
        out = t.transpose(-1, -2).contiguous().transpose(-1, -2)
        assert out.stride(-1) != 1 and torch.equal(out, t)
        return out

    opts = dict(causal=True, scale=0.3, window=(5, 0) if case == "sliding" else None)
    with fake_flash_attn.install(version) if version else contextlib.nullcontext():
        kernel = kernels.get_kernel(name)
        runs = []
        for make in (lambda t: t, strided):
            out, lse = kernel.block_forward(make(q), make(k), make(v), **opts)
            runs.append([out, lse, *kernel.block_backward(make(dout), make(q), make(k), make(v), make(out), lse, **opts)])
    for got, want in zip(*runs):
        assert torch.equal(got, want), (config, (got.double() - want.double()).abs().max().item())


@pytest.mark.parametrize("config", ["torch-bf16-tiles-of-8", "flash-2.8.3"])
def test_window_shifted_by_one_fails_the_tolerance(config, monkeypatch):
    """The bf16 tolerance catches a window one key too wide or too narrow, in out and dq."""
    case = "sliding-causal (W-1, 0)"
    (out, _, dq, *_), _ = run_case(config, case, monkeypatch)
    sq, sk, _, causal, (left, right), _ = WINDOW_CASES[case]
    q, k, v = qkv(s=sq, sk=sk, hq=4, hkv=2, dtype=torch.bfloat16)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for wrong in ((left - 1, right), (left + 1, right)):
        ref, (dq_ref, *_) = grads(lambda *t: explicit(*t, causal=causal, scale=0.3, window=wrong)[0], *(t.double() for t in (q, k, v)), dout.double())
        assert rel(out, ref) > 5 * KERNEL_CONFIGS[config][4] and rel(dq, dq_ref) > 5 * KERNEL_CONFIGS[config][4]


@pytest.mark.parametrize("name", ["torch", "math"])
def test_local_attention_takes_a_hugging_face_window(name):
    """``window=W``: query i sees key j iff i - W < j <= i, i.e. the contract's (W - 1, 0), causal."""
    w, s = 5, 24
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    assert torch.equal(contract_mask(s, s, True, (w - 1, 0)), (i - w < j) & (j <= i))
    q, k, v = qkv(s=s, hq=4, hkv=2)
    dout = torch.randn_like(q)
    out, g = grads(lambda *t: kernels.local_attention(*t, causal=True, kernel=name, window=w, softcap=2.0), q, k, v, dout)
    ref, rg = grads(lambda *t: explicit(*t, causal=True, scale=0.25, window=(w - 1, 0), softcap=2.0)[0], q, k, v, dout)
    assert max(rel(a, b) for a, b in zip([out, *g], [ref, *rg])) < TOL


def test_window_and_softcap_are_validated():
    q, k, v = qkv(s=4, hq=2, hkv=1, d=8)
    for window in ((-2, 0), (1,), (1.5, 0), 3):
        with pytest.raises(ValueError, match="window must be None or"):
            kernels.attend(q, k, v, kernel="math", causal=False, scale=1.0, window=window)
    for softcap in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="softcap must be a finite float >= 0"):
            kernels.attend(q, k, v, kernel="math", causal=False, scale=1.0, softcap=softcap)
    for window, causal in ((0, True), (3, False), ((2, 0), True)):
        with pytest.raises(ValueError, match="window must be an int >= 1 with causal=True"):
            kernels.local_attention(q, k, v, causal=causal, window=window)


def _record_attention_calls(calls):
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).split(".")[-1]
            if "attention" in name:
                window = tuple((kwargs or {}).get(f"window_size_{side}") for side in ("left", "right"))
                bias = args[4 if name.endswith("backward") else 3] if "efficient" in name else None
                calls.append((name, [tuple(a.shape) for a in args[:3]], window if window != (None, None) else
                              (tuple(bias.shape), bias.stride(2)) if bias is not None else None))
            return func(*args, **(kwargs or {}))

    return Record()


@pytest.mark.parametrize("case", ["bf16-sliding", "fp32-sliding", "bf16-open-right-queries-longer", "bf16-softcap"])
def test_torch_kernel_cuda_window_calls(case):
    """Windows on the torch kernel's CUDA path, on the meta device. bf16: flash-attn inside torch
    (``_flash_attention_forward``/``_backward`` with window_size_left/right, K/V at their own 2
    heads) in one call where Sq <= Sk + 1, else in tiles of Sk + 1 rows over the keys each
    sees (a tile whose window covers its keys takes the plain op). fp32: the memory-efficient
    op per tile of TILE rows, K/V repeated, an additive bias broadcast over [B, H] with rows
    padded to 16 keys. Soft-capping: no fused op, the math kernel."""
    dtype = torch.float32 if case.startswith("fp32") else torch.bfloat16
    sk, causal, window = (64, False, (16, -1)) if "open-right" in case else (256, True, (63, 0))
    calls = []
    kernel = kernels.get_kernel("torch")
    with _record_attention_calls(calls):
        q = torch.empty(1, 256, 8, 64, dtype=dtype, device="meta")
        k, v = (torch.empty(1, sk, 2, 64, dtype=dtype, device="meta") for _ in range(2))
        opts = dict(causal=causal, scale=0.125, window=window, softcap=30.0 if "softcap" in case else 0.0)
        out, lse = kernel.block_forward(q, k, v, **opts)
        grads = kernel.block_backward(out, q, k, v, out, lse, **opts)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (1, 8, 256) and lse.dtype == torch.float32
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape] and all(g.dtype == dtype for g in grads)
    q_, kv_ = (1, 256, 8, 64), (1, 256, 2, 64)
    expect = {
        "bf16-sliding": [("_flash_attention_forward", [q_, kv_, kv_], (63, 0))],
        # tiles of 128 rows: keys [0, 128) and [65, 256); the bias rows are 128 and 192 wide
        "fp32-sliding": [("_scaled_dot_product_efficient_attention", [(1, 8, 128, 64), (1, 8, n, 64), (1, 8, n, 64)], ((1, 8, 128, n), pad))
                         for n, pad in ((128, 128), (191, 192))],
        # tiles of 65 rows: the first three see every key (plain op), the last (61 rows) the window
        "bf16-open-right-queries-longer": [("_scaled_dot_product_flash_attention", [(1, 8, 65, 64), (1, 2, 64, 64), (1, 2, 64, 64)], None)] * 3
        + [("_flash_attention_forward", [(1, 61, 8, 64), (1, 64, 2, 64), (1, 64, 2, 64)], (16, -1))],
        "bf16-softcap": [],
    }[case]
    forward, backward = calls[: len(calls) // 2], calls[len(calls) // 2 :]
    assert forward == expect, calls
    assert [(n, w) for n, _, w in backward] == [(n.replace("_forward", "") + "_backward", w) for n, _, w in expect], calls
