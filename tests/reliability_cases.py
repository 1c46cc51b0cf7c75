"""Reliability cases (issue #8): gradient edge cases, determinism, property-based parity.

Registered in tests/cases.py's CASES (imported at its end); the assertions are in
tests/test_gradients.py, tests/test_numerics.py and tests/test_fuzz.py. Errors are
relative to max(1, |reference|), as in test_parity. Existing coverage not repeated
here: frozen inputs (parity ``grads=``), transposed [B, H, S, D] leaves (parity
``strided``) and a zero batch (errors/attention).
"""

from __future__ import annotations

import os
import traceback
import zlib

import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import ulysses_sp as usp
from ulysses_sp import layout

from .cases import BACKENDS, Env, Parity, _topo_for, case, generator, max_err
from .reference import reference_attention

GRAD_CASES: list[str] = []
"""Names of the gradient cases; each returns ``{tensor: error}`` (a string when a gradient is missing or unexpected)."""


def _data(env: Env, name: str, sets: int = 1, hq: int = 12, lay: str = "zigzag"):
    """Topology, ``sets`` full fp64 (q, k, v) and one dout. 4 kv heads (3 at P=3) so every backend runs."""
    topo = _topo_for(env, Parity(), lay)
    hkv = 3 if env.world == 3 else 4
    gen = generator(name)

    def randn(h):
        return torch.randn(2, 48, h, 8, generator=gen, dtype=torch.float64)

    return topo, [tuple(randn(h) for h in (hq, hkv, hkv)) for _ in range(sets)], randn(hq)


def _reference(full, dout, grads: str = "qkv", **kw):
    leaves = [t.clone().requires_grad_(n in grads) for n, t in zip("qkv", full)]
    out = reference_attention(*leaves, **kw)
    out.backward(dout)
    return {"out": out.detach(), **{f"d{n}": t.grad for n, t in zip("qkv", leaves)}}


def _grads(shards) -> dict:
    return {f"d{n}": t.grad for n, t in zip("qkv", shards)}


def _errors(topo, got: dict, want: dict, dim: int = 1, cu_seqlens=None) -> dict:
    """Per name, this rank's tensor against its shard of the full reference (no communication,
    so a rank with a wrong gradient cannot hang the others)."""
    errs = {}
    for n, w in want.items():
        g = got[n]
        if g is None or w is None:
            errs[n] = 0.0 if g is None and w is None else ("missing gradient" if g is None else "gradient for a frozen input")
        else:
            errs[n] = max_err(g.double(), usp.shard_sequence(w, topo, dim, cu_seqlens)) / max(1.0, w.abs().max().item())
    return errs


def _grad_case(name: str, fn, backend: str, *args) -> None:
    name = f"grad/{backend}/{name}"
    GRAD_CASES.append(name)
    case(name)(lambda env: fn(env, backend, *args))


# --------------------------------------------------------------------------- gradients

OTHER_RANKS = {  # the loss of every SP rank but 0 (rank 0's is <out, dout>)
    "zero": lambda out, d: 0 * out.sum(),  # upstream gradient: an expanded (stride 0) zero
    "slice": lambda out, d: (out[:, :1] * d[:, :1]).sum(),
    "ones": lambda out, d: out.sum(),  # an expanded one
}


def _upstream(kind: str, dout, topo):
    """The global upstream gradient that the ranks' losses together give the output."""
    full = torch.zeros_like(dout)
    for r in range(topo.sp_size):
        d = layout.shard(dout, topo.layout, topo.sp_size, r)
        x = torch.zeros_like(d, requires_grad=True)
        loss = (x * d).sum() if r == 0 else OTHER_RANKS[kind](x, d)
        full[:, layout.positions(topo.layout, dout.shape[1], topo.sp_size, r)] = torch.autograd.grad(loss, x)[0]
    return full


def other_ranks_upstream(env: Env, backend: str, kind: str, grads: str) -> dict:
    """Rank 0's loss uses all of out; the other ranks' use none, a slice, or an unweighted sum."""
    topo, (full,), dout = _data(env, f"upstream-{kind}")
    want = _reference(full, _upstream(kind, dout, topo), grads)
    shards = [usp.shard_sequence(t, topo).requires_grad_(n in grads) for n, t in zip("qkv", full)]
    out = usp.sp_attention(*shards, topo, backend=backend)
    d = usp.shard_sequence(dout, topo)
    ((out * d).sum() if topo.sp_rank == 0 else OTHER_RANKS[kind](out, d)).backward()
    return _errors(topo, {"out": out, **_grads(shards)}, want)


def module_twice(env: Env, backend: str) -> dict:
    """One module called twice in one step (the calls share k), one backward of the sum."""
    topo, ((q, k, v), (q2, _, v2)), dout = _data(env, "twice", sets=2)
    names = ("dq", "dk", "dv", "dq2", "dv2")
    leaves = [t.clone().requires_grad_() for t in (q, k, v, q2, v2)]
    ref = reference_attention(*leaves[:3]) + reference_attention(leaves[3], leaves[1], leaves[4])
    ref.backward(dout)
    shards = [usp.shard_sequence(t, topo).requires_grad_() for t in (q, k, v, q2, v2)]
    attn = usp.SequenceParallelAttention(topo, backend=backend)
    out = attn(*shards[:3]) + attn(shards[3], shards[1], shards[4])
    (out * usp.shard_sequence(dout, topo)).sum().backward()
    got = {"out": out, **{n: s.grad for n, s in zip(names, shards)}}
    return _errors(topo, got, {"out": ref.detach(), **{n: t.grad for n, t in zip(names, leaves)}})


def autograd_grad(env: Env, backend: str, wrt: str) -> dict:
    """``torch.autograd.grad(out, inputs, dout)`` for ``wrt`` (all of q, k, v need a gradient)."""
    topo, (full,), dout = _data(env, "autograd-grad")
    want = _reference(full, dout)
    shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
    out = usp.sp_attention(*shards, topo, backend=backend)
    got = torch.autograd.grad(out, [shards["qkv".index(n)] for n in wrt], usp.shard_sequence(dout, topo), create_graph=False)
    errs = _errors(topo, {"out": out, **{f"d{n}": g for n, g in zip(wrt, got)}}, {k: want[k] for k in ["out"] + [f"d{n}" for n in wrt]})
    errs[".grad untouched"] = 0.0 if all(s.grad is None for s in shards) else "autograd.grad wrote .grad"
    return errs


FUSED = {  # name: (global shape given kv heads, sequence dim, q/k/v as views of the fused tensor)
    "bs3hd": (lambda hkv: (2, 48, 3, 12, 8), 1, lambda x: [x[:, :, i] for i in range(3)]),
    "bshd-gqa": (lambda hkv: (2, 48, 12 + 2 * hkv, 8), 1, lambda x: x.split([12] + [(x.shape[2] - 12) // 2] * 2, dim=2)),
    "b3hsd-transposed": (lambda hkv: (2, 3, 12, 48, 8), 3, lambda x: [x[:, i].transpose(1, 2) for i in range(3)]),
}


def fused_qkv(env: Env, backend: str, kind: str) -> dict:
    """q, k, v are non-contiguous views of one fused projection output; its gradient is compared."""
    topo = _topo_for(env, Parity(), "zigzag")
    shape, dim, split = FUSED[kind]
    fused = torch.randn(shape(3 if env.world == 3 else 4), generator=generator(f"fused-{kind}"), dtype=torch.float64)
    leaf = fused.clone().requires_grad_()
    ref = reference_attention(*split(leaf))
    dout = torch.randn(ref.shape, generator=generator(f"fused-{kind}", 1), dtype=torch.float64)
    ref.backward(dout)
    local = usp.shard_sequence(fused, topo, dim).requires_grad_()
    out = usp.sp_attention(*split(local), topo, backend=backend)
    (out * usp.shard_sequence(dout, topo)).sum().backward()
    return {**_errors(topo, {"out": out}, {"out": ref.detach()}), **_errors(topo, {"dqkv": local.grad}, {"dqkv": leaf.grad}, dim)}


for _backend in BACKENDS:
    for _kind in OTHER_RANKS:
        for _grads_ in ("qkv", "q"):
            _grad_case(f"other-ranks-{_kind}-grad-{_grads_}", other_ranks_upstream, _backend, _kind, _grads_)
    _grad_case("module-twice", module_twice, _backend)
    for _wrt in ("qkv", "q"):
        _grad_case(f"autograd-grad-{_wrt}", autograd_grad, _backend, _wrt)
    for _kind in FUSED:
        _grad_case(f"fused-qkv-{_kind}", fused_qkv, _backend, _kind)


# --------------------------------------------------------------------------- numerics

DETERMINISM = {"zigzag-causal": {}, "contiguous-full-packed": {"causal": False, "cu_seqlens": (0, 5, 13, 14, 48)}}


@case("numerics/deterministic", (1, 2, 4))
def deterministic(env: Env) -> dict:
    """The same fp32 inputs twice through each backend: is every one of out, dq, dk, dv bitwise equal?"""
    result = {}
    for name, kw in DETERMINISM.items():
        topo, (full,), dout = _data(env, "deterministic", lay=name.split("-")[0])
        d = usp.shard_sequence(dout, topo).float()
        for backend in BACKENDS:
            runs = []
            for _ in range(2):
                shards = [usp.shard_sequence(t, topo).float().requires_grad_() for t in full]
                out = usp.sp_attention(*shards, topo, backend=backend, **kw)
                (out * d).sum().backward()
                runs.append([out.detach()] + [s.grad for s in shards])
            result[(name, backend)] = [torch.equal(a, b) for a, b in zip(*runs)]
    return result


# --------------------------------------------------------------------------- packed rows of 1 to 40 documents

PACKED_DOC_COUNTS = (1, 2, 3, 5, 8, 13, 21, 40)
PACKED_DOC_BACKENDS = (*BACKENDS, "halo")


def packed_rows(seq: int, p: int) -> dict:
    """Named document boundaries of ``seq``-token rows: per count, documents cut at random points
    (at 40 documents most are shorter than 2P tokens) and, from two documents on, the same count
    around one document longer than half the row, placed at a random offset."""
    gen = generator(f"packed-rows-{seq}-{p}")
    rows = {}
    for n in PACKED_DOC_COUNTS:
        cuts = torch.randperm(seq - 1, generator=gen)[: n - 1] + 1
        rows[f"{n} random"] = (0, *sorted(cuts.tolist()), seq)
        if n > 1:
            long = seq // 2 + 1 + int(torch.randint(0, seq // 4, (1,), generator=gen))
            start = int(torch.randint(0, seq - long + 1, (1,), generator=gen))
            ends = {start, start + long} - {0, seq}
            outside = torch.tensor([c for c in range(1, seq) if c < start or c > start + long])
            picked = outside[torch.randperm(len(outside), generator=gen)[: max(0, n - 1 - len(ends))]].tolist()
            rows[f"{n} with one longer than half"] = (0, *sorted({*picked, *ends}), seq)
    return rows


def packed_documents(env: Env, backend: str) -> dict:
    """Every layout, fp64, 48 tokens: this rank's max error of out, dq, dk, dv against one process
    per (row, layout), the row's longest document and its count of documents shorter than 2P."""
    window = 5 if backend == "halo" else None  # halo runs sliding-window layers only
    topo0, (full,), dout = _data(env, f"packed-documents-{backend}")
    seq, p, result = full[0].shape[1], env.world, {}
    for row, cu in packed_rows(seq, p).items():
        want = _reference(full, dout, causal=True, cu_seqlens=cu, window=window)
        for lay in layout.LAYOUTS:
            topo = _topo_for(env, Parity(), lay)
            shards = [usp.shard_sequence(t, topo, cu_seqlens=cu).requires_grad_() for t in full]
            out = usp.sp_attention(*shards, topo, backend=backend, cu_seqlens=cu, window=window)
            (out * usp.shard_sequence(dout, topo, cu_seqlens=cu)).sum().backward()
            lengths = [b - a for a, b in zip(cu, cu[1:])]
            result[(row, lay)] = {"errors": _errors(topo, {"out": out, **_grads(shards)}, want, cu_seqlens=cu),
                                  "documents": len(lengths), "longest": max(lengths), "short": sum(n < 2 * p for n in lengths), "seq": seq}
    return result


for _backend in PACKED_DOC_BACKENDS:
    case(f"packed-docs/{_backend}", (2, 3, 4))(lambda env, be=_backend: packed_documents(env, be))


# --------------------------------------------------------------------------- property-based parity

FUZZ_EXAMPLES = int(os.environ.get("USP_FUZZ_EXAMPLES", "100"))


@st.composite
def fuzz_configs(draw, world: int) -> dict:
    backend = draw(st.sampled_from(BACKENDS))
    lay = draw(st.sampled_from(layout.LAYOUTS))
    divisors = [u for u in range(1, world + 1) if world % u == 0]
    ulysses_degree = draw(st.sampled_from(divisors)) if backend == "hybrid" else (2 if world % 2 == 0 else 1)
    seq = layout.required_multiple(lay, world) * draw(st.integers(1, 4))  # global tokens = P * local
    hkv = draw(st.integers(1, 4))
    cuts = draw(st.none() | st.lists(st.integers(1, seq - 1), unique=True, max_size=4)) if seq > 1 else None
    return {
        "backend": backend, "layout": lay, "ulysses_degree": ulysses_degree, "batch": draw(st.integers(1, 2)), "seq": seq,
        "hq": hkv * draw(st.integers(1, 3)), "hkv": hkv, "head_dim": draw(st.sampled_from((4, 8, 16))),
        "causal": draw(st.booleans()), "grads": draw(st.sampled_from(("qkv", "q", "kv", "v"))),
        "scale": draw(st.sampled_from((None, 0.3))), "cu_seqlens": None if cuts is None else (0, *sorted(cuts), seq),
    }


def _fuzz_one(env: Env, cfg: dict, seed: int):
    """Errors of one config, or None when the backend's check() refuses it."""
    topo = env.topo(env.world, cfg["layout"], cfg["ulysses_degree"])
    gen = torch.Generator().manual_seed(seed)
    full = [torch.randn(cfg["batch"], cfg["seq"], h, cfg["head_dim"], generator=gen, dtype=torch.float64) for h in (cfg["hq"], cfg["hkv"], cfg["hkv"])]
    dout = torch.randn(full[0].shape, generator=gen, dtype=torch.float64)
    kw = {"causal": cfg["causal"], "cu_seqlens": cfg["cu_seqlens"]}
    docs = cfg["cu_seqlens"] or (0, cfg["seq"])  # the balanced layout places tokens by document
    shards = [usp.shard_sequence(t, topo, cu_seqlens=docs).requires_grad_(n in cfg["grads"]) for n, t in zip("qkv", full)]
    spec = usp.attention.make_spec(*shards, topo, softmax_scale=cfg["scale"], **kw)
    if usp.get_backend(cfg["backend"]).check(spec, topo) is not None:
        return None
    out = usp.sp_attention(*shards, topo, backend=cfg["backend"], softmax_scale=cfg["scale"], **kw)
    (out * usp.shard_sequence(dout, topo, cu_seqlens=docs)).sum().backward()
    return _errors(topo, {"out": out, **_grads(shards)}, _reference(full, dout, cfg["grads"], scale=cfg["scale"], **kw), cu_seqlens=docs)


@case("fuzz/parity")
def fuzz_parity(env: Env) -> dict:
    """Hypothesis draws configs against the fp64 reference. Every rank must draw the same
    examples (or the collectives mismatch): derandomized, no database, no shrinking, no health
    checks (they time the draws), and the test body never fails (a failure would change what
    Hypothesis draws next); errors, the worst configs and exceptions are returned instead."""
    stats = {"run": 0, "skipped": 0, "max": {}, "worst": {}, "failures": [], "digest": 0}

    @settings(derandomize=True, database=None, deadline=None, max_examples=FUZZ_EXAMPLES, phases=[Phase.explicit, Phase.generate],
              suppress_health_check=list(HealthCheck), print_blob=False)
    @given(fuzz_configs(env.world), st.integers(0, 2**31 - 1))
    def one(cfg, seed):
        stats["digest"] = zlib.crc32(repr((cfg, seed)).encode(), stats["digest"])
        try:
            errs = _fuzz_one(env, cfg, seed)
        except Exception:
            stats["failures"].append({"config": cfg, "seed": seed, "error": traceback.format_exc(limit=-3)})
            return
        if errs is None:
            stats["skipped"] += 1
            return
        stats["run"] += 1
        for name, err in errs.items():
            if not isinstance(err, float):
                stats["failures"].append({"config": cfg, "seed": seed, "error": f"{name}: {err}"})
            elif err >= stats["max"].get(name, -1.0):
                stats["max"][name], stats["worst"][name] = err, {**cfg, "seed": seed}

    one()
    return stats
