"""The CPU fake of flash-attn 2.x (ulysses_sp.testing.fake_flash_attn) against an fp64
reference with explicit masks: private functions of 2.6.3 and 2.8.3 (forward and backward,
dense and varlen), the public autograd functions, the errors, and install()."""

import importlib.util
import inspect
import sys
import types

import pytest
import torch

from ulysses_sp.testing.fake_flash_attn import FakeFlashAttn, install

INF = float("inf")
DTYPES = [torch.bfloat16, torch.float16]
RTOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3}
VERSIONS = ["2.6.3", "2.8.3"]


# --------------------------------------------------------------------------- reference


def visible(sq, sk, causal=False, window=(-1, -1), seqlen_k=None):
    """Explicit [sq, sk] mask as flash-attn documents it: bottom-right aligned, key j visible to
    query i iff i + sk - sq - left <= j <= i + sk - sq + right. The sides are normalised as
    flash_api.cpp does against seqlen_k (max_seqlen_k for varlen): >= seqlen_k means -1,
    causal means right = 0, and a one-sided window gets seqlen_k on its negative side."""
    n = sk if seqlen_k is None else seqlen_k
    left, right = window
    left, right = (-1 if left >= n else left), (-1 if right >= n else right)
    if causal:
        right = 0
    if left < 0 and right < 0:
        return torch.ones(sq, sk, dtype=torch.bool)
    left, right = (n if left < 0 else left), (n if right < 0 else right)
    mask = torch.zeros(sq, sk, dtype=torch.bool)
    for i in range(sq):
        for j in range(sk):
            mask[i, j] = i + sk - sq - left <= j <= i + sk - sq + right
    return mask


def reference(q, k, v, mask, scale, softcap=0.0):
    """fp64 attention of one sequence, differentiable: q [Sq, H, D], k/v [Sk, Hkv, D] ->
    out [Sq, H, D], lse [H, Sq]; a row that sees no key has out 0 and lse +inf."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    lse = s.detach().masked_fill(~mask, -INF).logsumexp(-1)
    lse = lse.masked_fill(lse == -INF, INF)
    p = torch.softmax(s.masked_fill(~mask, -1e30), -1) * mask  # finite fill: no NaN grads on empty rows
    return torch.einsum("hqk,khd->qhd", p, v), lse


def close(actual, expected, dtype):
    """Same infinities, and finite entries within RTOL[dtype] of the reference's max."""
    a, e = actual.detach().double(), expected.detach().double()
    if a.shape != e.shape or not torch.equal(torch.isinf(a), torch.isinf(e)):
        return False
    inf = torch.isinf(e)
    if not torch.equal(a[inf], e[inf]):
        return False
    a, e = a[~inf], e[~inf]
    return e.numel() == 0 or bool((a - e).abs().max() <= RTOL[dtype] * e.abs().max() + 1e-6)


def assert_close(actual, expected, dtype, what):
    assert close(actual, expected, dtype), (
        f"{what}: max abs err {(actual.double() - expected.double()).abs().nan_to_num(posinf=0).max():.3g}, "
        f"ref max {expected.double().abs().nan_to_num(posinf=0).max():.3g}")


def randn(gen, *shape, dtype):
    return torch.randn(shape, generator=gen).to(dtype)


def ref_sequences(q, k, v, dout, spans, masks, scale, softcap):
    """Reference over sequences (q rows, k rows) of the packed tensors: out, lse [H, rows], grads."""
    qd, kd, vd = [t.double().requires_grad_() for t in (q, k, v)]
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[1], q.shape[0]), -INF, dtype=torch.float64)
    for ((q0, q1), (k0, k1)), mask in zip(spans, masks):
        o, l = reference(qd[q0:q1], kd[k0:k1], vd[k0:k1], mask, scale, softcap)
        out = out.index_put((torch.arange(q0, q1),), o)
        lse[:, q0:q1] = l
    out.backward(dout.double())
    return out.detach(), lse, qd.grad, kd.grad, vd.grad


# --------------------------------------------------------------------------- calling either version


def fwd(fa, legacy, q, k, v, scale, causal, window, softcap, varlen=None):
    window = (window,) if legacy else tuple(window)
    args = (0.0, scale, causal, *window, softcap, None, False)
    if varlen is None:
        res = fa._flash_attn_forward(q, k, v, *args)
    else:
        res = fa._flash_attn_varlen_forward(q, k, v, *varlen, *args)
    assert len(res) == (8 if legacy else 4)
    return res


def bwd(fa, legacy, dout, q, k, v, out, lse, scale, causal, window, softcap, varlen=None):
    """Runs the private backward into fresh buffers; returns (dq, dk, dv, softmax_d)."""
    grads = [torch.full_like(t, float("nan")) for t in (q, k, v)]  # must be overwritten everywhere
    window = (window,) if legacy else tuple(window)
    args = (0.0, scale, causal, *window, softcap, None, False)
    if varlen is None:
        res = fa._flash_attn_backward(dout, q, k, v, out, lse, *grads, *args, rng_state=None)
    else:
        res = fa._flash_attn_varlen_backward(dout, q, k, v, out, lse, *grads, *varlen, *args, rng_state=None)
    if legacy:
        assert isinstance(res, tuple) and len(res) == 4 and all(r is g for r, g in zip(res, grads))
        softmax_d = res[3]
    else:
        assert isinstance(res, torch.Tensor)
        softmax_d = res
    return (*grads, softmax_d)


def run_private(version, dtype, spans, h, hkv, causal, window, softcap, varlen, seed=0):
    """Private forward + backward of `version` on packed sequences, checked against the
    reference. Dense calls use spans of equal lengths reshaped to [B, S, ...]. 2.6 runs with
    head dim 12 (its forward pads in C++), 2.8 with 16. Returns (out, lse) in packed layout."""
    legacy = version.startswith("2.6")
    d = 12 if legacy else 16
    gen = torch.Generator().manual_seed(seed)
    total_q, total_k = spans[-1][0][1], spans[-1][1][1]
    q, dout = randn(gen, total_q, h, d, dtype=dtype), randn(gen, total_q, h, d, dtype=dtype)
    k, v = randn(gen, total_k, hkv, d, dtype=dtype), randn(gen, total_k, hkv, d, dtype=dtype)
    scale = d ** -0.5
    max_q = max(b - a for (a, b), _ in spans)
    max_k = max(b - a for _, (a, b) in spans)
    masks = [visible(q1 - q0, k1 - k0, causal, window, max_k if varlen else None) for (q0, q1), (k0, k1) in spans]
    ref = ref_sequences(q, k, v, dout, spans, masks, scale, softcap)

    n_seq = len(spans)
    cu = [torch.tensor([0] + [s[i][1] for s in spans], dtype=torch.int32) for i in (0, 1)]
    extra = (cu[0], cu[1], max_q, max_k) if varlen else None

    def pack(t):  # packed rows -> [B, S, ...] for dense calls
        return t if varlen else t.reshape(n_seq, t.shape[0] // n_seq, *t.shape[1:])

    with install(version) as fake:
        fa = sys.modules["flash_attn.flash_attn_interface"]
        res = fwd(fa, legacy, pack(q), pack(k), pack(v), scale, causal, window, softcap, extra)
        if legacy:
            out, qp, kp, vp, out_padded, lse, s_dmask, rng_state = res
            assert out.shape[-1] == d and out_padded.shape[-1] == qp.shape[-1] == 16 and s_dmask is None
            assert torch.equal(out, out_padded[..., :d])
        else:
            out, lse, s_dmask, rng_state = res
            qp, kp, vp, out_padded = pack(q), pack(k), pack(v), out
            assert s_dmask.numel() == 0
        assert rng_state.dtype == torch.int64 and rng_state.shape == (2,)
        assert out.dtype == dtype and lse.dtype == torch.float32
        dq, dk, dv, softmax_d = bwd(fa, legacy, pack(dout), qp, kp, vp, out_padded, lse, scale, causal, window,
                                    softcap, extra)
        assert fake.calls == {f"_flash_attn{'_varlen' if varlen else ''}_{p}": 1 for p in ("forward", "backward")}

    assert softmax_d.dtype == torch.float32
    if varlen:
        assert lse.shape == (h, total_q) and softmax_d.shape == (h, total_q + 128 * n_seq)
    else:
        sq = total_q // n_seq
        assert lse.shape == (n_seq, h, sq) and softmax_d.shape == (n_seq, h, (sq + 127) // 128 * 128)
    out_flat = out.reshape(total_q, h, d)
    lse_flat = lse if varlen else lse.transpose(0, 1).reshape(h, -1)  # [H, rows]
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), (out_flat, lse_flat, dq, dk, dv), ref):
        got = got.reshape(*want.shape[:-1], got.shape[-1])
        assert_close(got[..., :want.shape[-1]], want, dtype, name)
        assert not got[..., want.shape[-1]:].any(), f"{name}: padded head dims must stay 0"
    return out_flat, lse_flat


# --------------------------------------------------------------------------- the reference itself


def test_reference_masks_match_flash_attn_docstring():
    """The examples of flash_attn_func's docstring (causal, bottom-right aligned)."""
    assert visible(2, 5, causal=True).int().tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert visible(5, 2, causal=True).int().tolist() == [[0, 0], [0, 0], [0, 0], [1, 0], [1, 1]]
    # docstring window rule: keys in [i + sk - sq - left, i + sk - sq + right]
    assert visible(3, 6, window=(1, 0)).int().tolist() == [[0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 1, 1]]


# --------------------------------------------------------------------------- private functions


DENSE_CASES = {
    "full": dict(sq=8, sk=8, h=2, hkv=2),
    "causal_gqa": dict(sq=8, sk=8, h=4, hkv=2, causal=True),
    "causal_sq_lt_sk_mqa": dict(sq=5, sk=11, h=2, hkv=1, causal=True),
    "causal_sq_gt_sk": dict(sq=11, sk=5, h=2, hkv=2, causal=True),
    "window": dict(sq=9, sk=9, h=2, hkv=2, window=(3, 1)),
    "window_causal_sq_lt_sk": dict(sq=7, sk=12, h=4, hkv=4, causal=True, window=(2, 5)),
    "window_right_ge_sk": dict(sq=12, sk=4, h=2, hkv=1, window=(0, 9)),
    "softcap_causal": dict(sq=8, sk=8, h=2, hkv=2, causal=True, softcap=1.0),
    "softcap_window_gqa": dict(sq=6, sk=10, h=4, hkv=2, window=(2, 2), softcap=2.0),
    "seqlen_k_0": dict(sq=3, sk=0, h=2, hkv=2),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DENSE_CASES)
def test_dense_forward_backward(case, dtype, version):
    c = dict(causal=False, window=(-1, -1), softcap=0.0) | DENSE_CASES[case]
    b, sq, sk = 2, c.pop("sq"), c.pop("sk")
    spans = [((i * sq, (i + 1) * sq), (i * sk, (i + 1) * sk)) for i in range(b)]
    out, lse = run_private(version, dtype, spans, varlen=False, **c)
    if case == "causal_sq_gt_sk":  # bottom-right: the first sq - sk rows see no key
        assert not out.reshape(b, sq, -1)[:, :sq - sk].any()
        assert torch.isposinf(lse.reshape(-1, b, sq)[:, :, :sq - sk]).all()
        assert torch.isfinite(lse.reshape(-1, b, sq)[:, :, sq - sk:]).all()
    if case == "window_right_ge_sk":  # right 9 >= sk: -1, then sk again (one-sided): rows 0-3 see nothing
        assert torch.isposinf(lse.reshape(-1, b, sq)[:, :, :4]).all() and torch.isfinite(lse.reshape(-1, b, sq)[:, :, 4:]).all()
    if case == "seqlen_k_0":
        assert not out.any() and torch.isposinf(lse).all()


VARLEN_SPANS = [((0, 3), (0, 5)), ((3, 3), (5, 9)), ((3, 10), (9, 9)), ((10, 12), (9, 15))]  # Sq 3,0,7,2; Sk 5,4,0,6
VARLEN_CASES = {
    "full": dict(),
    "causal": dict(causal=True),
    "window": dict(window=(2, 1)),
    "softcap_causal": dict(causal=True, softcap=1.5),
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES)
def test_varlen_forward_backward(case, dtype, version):
    c = dict(causal=False, window=(-1, -1), softcap=0.0) | VARLEN_CASES[case]
    out, lse = run_private(version, dtype, VARLEN_SPANS, h=4, hkv=2, varlen=True, **c)
    assert not out[3:10].any() and torch.isposinf(lse[:, 3:10]).all()  # the sequence with seqlen_k = 0


def test_varlen_window_normalised_against_max_seqlen_k():
    """flash_api.cpp normalises windows against max_seqlen_k, not each sequence's length.
    Window (-1, 3) with max_seqlen_k = 8 stays right = 3 (left becomes 8), so in a sequence
    with Sq = 6, Sk = 2 query i sees keys j <= i - 1 and row 0 sees nothing. The same
    sequence in a dense call (seqlen_k = 2 <= 3) has right -> -1: no mask at all."""
    gen = torch.Generator().manual_seed(1)
    q, k, v = (randn(gen, n, 2, 8, dtype=torch.bfloat16) for n in (8, 10, 10))
    cu_q, cu_k = torch.tensor([0, 6, 8], dtype=torch.int32), torch.tensor([0, 2, 10], dtype=torch.int32)
    with install("2.8.3"):
        from flash_attn.flash_attn_interface import _flash_attn_forward, _flash_attn_varlen_forward

        _, lse, _, _ = _flash_attn_varlen_forward(q, k, v, cu_q, cu_k, 6, 8, 0.0, 0.5, False, -1, 3)
        _, lse_alone, _, _ = _flash_attn_forward(q[None, :6], k[None, :2], v[None, :2], 0.0, 0.5, False, -1, 3,
                                                 0.0, None, False)
    # row i of sequence 0 sees j <= i + 2 - 6 + 3 = i - 1: rows 0 sees nothing
    assert torch.isposinf(lse[:, 0]).all() and torch.isfinite(lse[:, 1:]).all()
    assert torch.isfinite(lse_alone).all()


def test_mask_shifted_by_one_token_fails_the_tolerance():
    """The tolerances catch off-by-one masks and top-left alignment, in out and in dq."""
    gen = torch.Generator().manual_seed(2)
    dtype = torch.bfloat16
    for sq, sk, wrong in ((8, 8, visible(8, 8, window=(-1, 1))),  # causal shifted right by one
                          (8, 8, visible(8, 8, True) & ~torch.eye(8, dtype=torch.bool)),  # shifted left (diag lost)
                          (4, 8, torch.ones(4, 8, dtype=torch.bool).tril())):  # top-left aligned causal
        q, k, v, dout = (randn(gen, n, 2, 16, dtype=dtype) for n in (sq, sk, sk, sq))
        leaves = [t[None].clone().requires_grad_() for t in (q, k, v)]
        with install() as fake:
            out = fake.interface.flash_attn_func(*leaves, causal=True)
        (dq,) = torch.autograd.grad(out, leaves[0], dout[None])
        qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
        for mask, expect in ((visible(sq, sk, True), True), (wrong, False)):
            ref, _ = reference(qd, kd, vd, mask, 16 ** -0.5)
            (dq_ref,) = torch.autograd.grad(ref, qd, dout.double())
            assert close(out[0], ref, dtype) is expect and close(dq[0], dq_ref, dtype) is expect


# --------------------------------------------------------------------------- signatures and conventions


SIGNATURES = {
    "2.8.3": {
        "_flash_attn_forward": "q k v dropout_p softmax_scale causal window_size_left window_size_right softcap "
                               "alibi_slopes return_softmax",
        "_flash_attn_varlen_forward": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
                                      "softmax_scale causal window_size_left=-1 window_size_right=-1 softcap=0.0 "
                                      "alibi_slopes=None return_softmax=False block_table=None leftpad_k=None "
                                      "seqused_k=None zero_tensors=False",
        "_flash_attn_backward": "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size_left "
                                "window_size_right softcap alibi_slopes deterministic rng_state=None",
        "_flash_attn_varlen_backward": "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                       "max_seqlen_k dropout_p softmax_scale causal window_size_left window_size_right "
                                       "softcap alibi_slopes deterministic rng_state=None zero_tensors=False",
    },
    "2.6.3": {
        "_flash_attn_forward": "q k v dropout_p softmax_scale causal window_size softcap alibi_slopes return_softmax",
        "_flash_attn_varlen_forward": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p "
                                      "softmax_scale causal window_size=(-1, -1) softcap=0.0 alibi_slopes=None "
                                      "return_softmax=False block_table=None leftpad_k=None seqused_k=None",
        "_flash_attn_backward": "dout q k v out softmax_lse dq dk dv dropout_p softmax_scale causal window_size "
                                "softcap alibi_slopes deterministic rng_state=None",
        "_flash_attn_varlen_backward": "dout q k v out softmax_lse dq dk dv cu_seqlens_q cu_seqlens_k max_seqlen_q "
                                       "max_seqlen_k dropout_p softmax_scale causal window_size softcap alibi_slopes "
                                       "deterministic rng_state=None",
    },
}
PUBLIC = {
    "flash_attn_func": "q k v dropout_p=0.0 softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 "
                       "alibi_slopes=None deterministic=False return_attn_probs=False",
    "flash_attn_varlen_func": "q k v cu_seqlens_q cu_seqlens_k max_seqlen_q max_seqlen_k dropout_p=0.0 "
                              "softmax_scale=None causal=False window_size=(-1, -1) softcap=0.0 alibi_slopes=None "
                              "deterministic=False return_attn_probs=False block_table=None",
}


def signature(fn):
    return " ".join(str(p).replace(" ", "") if p.default is inspect.Parameter.empty else
                    f"{p.name}={p.default!r}" for p in inspect.signature(fn).parameters.values())


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.quick
def test_signatures(version):
    with install(version) as fake:
        import flash_attn
        from flash_attn import flash_attn_interface as fa

        assert flash_attn.__version__ == version and fake.version == version
        for name, expected in {**SIGNATURES[version], **PUBLIC}.items():
            assert signature(getattr(fa, name)) == expected, name
        assert flash_attn.flash_attn_func is fa.flash_attn_func
        assert flash_attn.flash_attn_varlen_func is fa.flash_attn_varlen_func


def test_zero_tensors_arrived_in_2_7_3():
    q = torch.zeros(4, 1, 8, dtype=torch.float16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with install("2.7.2") as fake:
        assert "zero_tensors" not in inspect.signature(fake.interface._flash_attn_varlen_forward).parameters
        with pytest.raises(TypeError):
            fake.interface._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, 1.0, False, zero_tensors=True)
        assert len(fake.interface._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, 1.0, False)) == 4
    with install("2.7.3") as fake:
        assert len(fake.interface._flash_attn_varlen_forward(q, q, q, cu, cu, 4, 4, 0.0, 1.0, False,
                                                             zero_tensors=True)) == 4


def test_backward_allocates_missing_grads_and_writes_given_ones_in_place():
    gen = torch.Generator().manual_seed(3)
    q, k, v = (randn(gen, 1, 4, 2, 8, dtype=torch.float16) for _ in range(3))
    with install("2.8.3") as fake:
        fa = fake.interface
        out, lse, _, _ = fa._flash_attn_forward(q, k, v, 0.0, 0.5, True, -1, -1, 0.0, None, False)
        dq = torch.zeros_like(q)
        softmax_d = fa._flash_attn_backward(out, q, k, v, out, lse, dq, None, None, 0.0, 0.5, True, -1, -1, 0.0,
                                            None, False)
        assert softmax_d.shape == (1, 2, 128) and dq.abs().sum() > 0


# --------------------------------------------------------------------------- errors


def h16(*shape, dtype=torch.float16, seed=4):
    return randn(torch.Generator().manual_seed(seed), *shape, dtype=dtype)


@pytest.fixture
def fa28():
    with install("2.8.3") as fake:
        yield fake.interface


def fwd28(fa, q, k, v, **kw):
    args = dict(dropout_p=0.0, softmax_scale=0.25, causal=False, window_size_left=-1, window_size_right=-1,
                softcap=0.0, alibi_slopes=None, return_softmax=False) | kw
    return fa._flash_attn_forward(q, k, v, **args)


Q, K = h16(1, 4, 2, 16), h16(1, 4, 2, 16, seed=5)
CU = torch.tensor([0, 4], dtype=torch.int32)
BWD_ARGS = (0.0, 0.25, False, -1, -1, 0.0, None, False)  # dropout_p ... deterministic


@pytest.mark.parametrize("args, kwargs, match", [
    ((Q.float(), K.float(), K.float()), {}, "^FlashAttention only support fp16 and bf16 data type$"),
    ((Q, K.bfloat16(), K), {}, "^query and key must have the same dtype$"),
    ((h16(1, 4, 2, 260),) * 3, {}, "^FlashAttention forward only supports head dimension at most 256$"),
    ((h16(1, 4, 2, 12),) * 3, {}, "^query, key, value, and out_ must have a head_size that is a multiple of 8$"),
    ((h16(1, 4, 3, 16), K, K), {}, "^Number of heads in key/value must divide number of heads in query$"),
    ((Q, h16(2, 4, 2, 16), K), {}, r"^k must have shape \(batch_size, seqlen_k, num_heads_k, head_size\)$"),
    ((Q, K, K), dict(return_softmax=True), "^return_softmax is only supported when p_dropout > 0.0$"),
], ids=["fp32", "mixed_dtypes", "head_dim_260", "head_dim_12", "heads_not_dividing", "k_batch", "return_softmax"])
def test_forward_errors(fa28, args, kwargs, match):
    with pytest.raises(RuntimeError, match=match):
        fwd28(fa28, *args, **kwargs)


def test_unsupported_features(fa28):
    with pytest.raises(NotImplementedError, match="dropout_p"):
        fwd28(fa28, Q, K, K, dropout_p=0.1)
    with pytest.raises(NotImplementedError, match="alibi_slopes"):
        fwd28(fa28, Q, K, K, alibi_slopes=torch.ones(2))
    with pytest.raises(NotImplementedError, match="block_table"):
        fa28.flash_attn_varlen_func(Q[0], K[0], K[0], CU, CU, 4, 4, block_table=torch.zeros(1, 1, dtype=torch.int32))


def test_strided_last_dim(fa28):
    """flash-attn's Python wrappers copy q/k/v/out/dout with a strided last dim
    (maybe_contiguous), so those work; the dq/dk/dv buffers are not copied and the C++
    rejects them."""
    strided = h16(1, 4, 2, 32)[..., ::2]
    assert strided.stride(-1) != 1
    assert torch.equal(fwd28(fa28, strided, K, K)[0], fwd28(fa28, strided.contiguous(), K, K)[0])
    out, lse, _, _ = fwd28(fa28, Q, K, K)
    with pytest.raises(RuntimeError, match="^dq must have contiguous last dimension$"):
        fa28._flash_attn_backward(out, Q, K, K, out, lse, h16(1, 4, 2, 32)[..., ::2], None, None, *BWD_ARGS)


def test_backward_errors(fa28):
    out, lse, _, _ = fwd28(fa28, Q, K, K)
    with pytest.raises(RuntimeError, match="^dk must have the same dtype as q$"):
        fa28._flash_attn_backward(out, Q, K, K, out, lse, None, K.bfloat16(), None, *BWD_ARGS)
    with pytest.raises(RuntimeError, match=r"^dv must have shape \(batch_size, seqlen_k, num_heads_k, head_size\)$"):
        fa28._flash_attn_backward(out, Q, K, K, out, lse, None, None, h16(1, 5, 2, 16), *BWD_ARGS)
    with pytest.raises(RuntimeError, match="^query and dout must have the same dtype$"):
        fa28._flash_attn_backward(out.bfloat16(), Q, K, K, out, lse, None, None, None, *BWD_ARGS)
    with pytest.raises(RuntimeError, match="fake flash-attn: softmax_lse"):  # the kernel would read garbage
        fa28._flash_attn_backward(out, Q, K, K, out, lse.transpose(1, 2), None, None, None, *BWD_ARGS)


def test_varlen_errors(fa28):
    q, k = Q[0], K[0]
    with pytest.raises(RuntimeError, match="^cu_seqlens_q must have dtype int32$"):
        fa28._flash_attn_varlen_forward(q, k, k, CU.long(), CU, 4, 4, 0.0, 0.25, False)
    out, lse, _, _ = fa28._flash_attn_varlen_forward(q, k, k, CU, CU, 4, 4, 0.0, 0.25, False)
    with pytest.raises(RuntimeError, match="^cu_seqlens_k must have dtype int32$"):
        fa28._flash_attn_varlen_backward(out, q, k, k, out, lse, None, None, None, CU, CU.long(), 4, 4, *BWD_ARGS)
    with pytest.raises(RuntimeError, match=r"^cu_seqlens_k must have shape \(batch_size \+ 1\)$"):
        fa28._flash_attn_varlen_forward(q, k, k, CU, torch.tensor([0, 2, 4], dtype=torch.int32), 4, 4, 0.0, 0.25,
                                        False)
    with pytest.raises(RuntimeError, match="fake flash-attn: cu_seqlens_q"):  # past total_q: out of bounds
        fa28._flash_attn_varlen_forward(q, k, k, torch.tensor([0, 5], dtype=torch.int32), CU, 5, 4, 0.0, 0.25, False)
    with pytest.raises(RuntimeError, match="fake flash-attn: .* exceeds max_seqlen_k"):
        fa28._flash_attn_varlen_forward(q, k, k, CU, CU, 4, 3, 0.0, 0.25, False)


def test_2_6_head_dim_rules():
    """2.6.3 pads head dims inside its forward, but its backward wants padded q/k/v/out."""
    q12 = h16(1, 4, 2, 12)
    with install("2.6.3") as fake:
        fa = fake.interface
        res = fa._flash_attn_forward(q12, q12, q12, 0.0, 0.3, False, (-1, -1), 0.0, None, False)
        with pytest.raises(RuntimeError, match="^head_size should be a multiple of 8$"):
            fa._flash_attn_backward(res[0], q12, q12, q12, res[0], res[5], None, None, None, 0.0, 0.3, False,
                                    (-1, -1), 0.0, None, False)
        q260 = h16(1, 4, 2, 260)
        with pytest.raises(RuntimeError, match="^FlashAttention forward only supports head dimension at most 256$"):
            fa._flash_attn_forward(q260, q260, q260, 0.0, 0.3, False, (-1, -1), 0.0, None, False)


@pytest.mark.parametrize("version", ["2.5.9", "2.6.2", "3.0.0", "2.8", "latest"])
def test_unsupported_versions(version):
    with pytest.raises(ValueError):
        FakeFlashAttn(version)
    with pytest.raises(ValueError), install(version):
        pass


# --------------------------------------------------------------------------- public autograd functions


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_attn_func_autograd(dtype, version):
    """Head dim 12 (padded to 16 inside), GQA, causal with Sq < Sk, a window and softcap."""
    gen = torch.Generator().manual_seed(5)
    b, sq, sk, h, hkv, d = 2, 5, 9, 4, 2, 12
    q, dout = randn(gen, b, sq, h, d, dtype=dtype), randn(gen, b, sq, h, d, dtype=dtype)
    k, v = randn(gen, b, sk, hkv, d, dtype=dtype), randn(gen, b, sk, hkv, d, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with install(version) as fake:
        from flash_attn import flash_attn_func

        out, lse, s_dmask = flash_attn_func(*leaves, causal=True, window_size=(3, -1), softcap=3.0,
                                            return_attn_probs=True)
        out.backward(dout)
        assert fake.calls == {"flash_attn_func": 1, "_flash_attn_forward": 1, "_flash_attn_backward": 1}
    assert (s_dmask is None) if version == "2.6.3" else (s_dmask.numel() == 0)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    spans = [((i * sq, (i + 1) * sq), (i * sk, (i + 1) * sk)) for i in range(b)]
    mask = visible(sq, sk, True, (3, -1))
    ref = ref_sequences(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), dout.flatten(0, 1), spans, [mask] * b,
                        d ** -0.5, 3.0)
    got = (out, lse.transpose(0, 1).flatten(1), *(t.grad for t in leaves))
    for name, g, r in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert_close(g.reshape(r.shape), r, dtype, name)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_flash_attn_varlen_func_autograd(dtype, version):
    gen = torch.Generator().manual_seed(6)
    h, hkv, d = 4, 1, 20
    q, dout = randn(gen, 12, h, d, dtype=dtype), randn(gen, 12, h, d, dtype=dtype)
    k, v = randn(gen, 15, hkv, d, dtype=dtype), randn(gen, 15, hkv, d, dtype=dtype)
    cu_q, cu_k = (torch.tensor([0] + [s[i][1] for s in VARLEN_SPANS], dtype=torch.int32) for i in (0, 1))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with install(version) as fake:
        import flash_attn

        out = flash_attn.flash_attn_varlen_func(*leaves, cu_q, cu_k, 7, 6, softmax_scale=0.3, causal=True)
        out.backward(dout)
        assert fake.calls == {"flash_attn_varlen_func": 1, "_flash_attn_varlen_forward": 1,
                              "_flash_attn_varlen_backward": 1}
        fake.reset()
        assert not fake.calls
    masks = [visible(q1 - q0, k1 - k0, True, seqlen_k=6) for (q0, q1), (k0, k1) in VARLEN_SPANS]
    ref = ref_sequences(q, k, v, dout, VARLEN_SPANS, masks, 0.3, 0.0)
    for name, g, r in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in leaves)), ref[:1] + ref[2:]):
        assert_close(g, r, dtype, name)


# --------------------------------------------------------------------------- install()


def test_install_restores_sys_modules(monkeypatch):
    names = ("flash_attn", "flash_attn.flash_attn_interface")
    for name in names:
        monkeypatch.delitem(sys.modules, name, raising=False)
    with install("2.6.3") as fake:
        import flash_attn
        import flash_attn.flash_attn_interface as fa

        assert flash_attn is fake.package and fa is fake.interface and flash_attn.flash_attn_interface is fa
        assert importlib.util.find_spec("flash_attn") is not None
        with install("2.8.3") as inner:  # nesting: the inner one wins, then the outer comes back
            import flash_attn as inner_fa

            assert inner_fa.__version__ == "2.8.3" and inner.package is inner_fa
        assert sys.modules["flash_attn"] is fake.package
        assert sys.modules["flash_attn.flash_attn_interface"] is fake.interface
    assert all(name not in sys.modules for name in names)

    before = {name: types.ModuleType(name) for name in names}
    for name, module in before.items():
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(KeyError):
        with install():
            assert sys.modules["flash_attn"] is not before["flash_attn"]
            raise KeyError("boom")
    assert all(sys.modules[name] is module for name, module in before.items())
