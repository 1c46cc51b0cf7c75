"""Fused LM head + loss (ulysses_sp/loss.py), inside the spawned ranks; assertions in tests/test_loss.py.

Every case compares the tiled loss with ``sp_cross_entropy`` of the full logits on the same
rank's data (no extra communication), as relative errors: ``max|a - b| / max|b|`` per tensor.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import tempfile

import torch
import torch.distributed as dist

import ulysses_sp as usp
from ulysses_sp.loss import causal_lm_loss, sp_linear_cross_entropy

from .cases import Env, Parity, _topo_for, case, generator, raised

VOCAB, WIDTH = 50, 16


def _rel(a, b) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def _data(name: str, rank: int, tokens=(2, 13), dtype=torch.float32, bias=True, no_targets=False):
    g = generator(name, rank)
    h = torch.randn(*tokens, WIDTH, generator=g).to(dtype)
    w = (torch.randn(VOCAB, WIDTH, generator=g) * 0.5).to(dtype)
    b = torch.randn(VOCAB, generator=g).to(dtype) if bias else None
    y = torch.randint(0, VOCAB, tokens, generator=g)
    flat = y.view(-1)
    flat[:4] = -100  # the first tiles of small chunk sizes have no valid target
    flat[-1] = -100
    if no_targets:
        y[:] = -100
    return h, w, b, y


def _compare(topo, h, w, b, y, chunks, count_group=None) -> dict:
    """{chunk: {"loss": rel, "d<x>": rel}} of the tiled loss against sp_cross_entropy of the full logits."""
    leaves = [t for t in (h, w, b) if t is not None]
    names = ["dhidden", "dweight", "dbias"][: len(leaves)]

    def run(fn):
        xs = [t.detach().clone().requires_grad_() for t in leaves]
        loss = fn(*xs)
        (loss * 1.5).backward()  # a grad_output other than 1
        return loss.detach(), [x.grad for x in xs]

    def untiled(hh, ww, bb=None):
        logits = hh @ ww.T + (bb if bb is not None else 0)
        return usp.sp_cross_entropy(logits, y, topo, count_group=count_group)

    ref_loss, ref_grads = run(untiled)
    out = {"ref_loss": ref_loss.item()}
    for chunk in chunks:
        loss, grads = run(lambda hh, ww, bb=None: sp_linear_cross_entropy(hh, ww, y, topo, bias=bb, chunk_tokens=chunk, count_group=count_group))
        r = {"loss": _rel(loss, ref_loss) if ref_loss != 0 else abs(loss.item()), "dtype": str(loss.dtype)}
        for n, g, gr in zip(names, grads, ref_grads):
            r[n] = _rel(g, gr) if gr.abs().max() > 0 else g.abs().max().item()
        out[chunk] = r
    return out


CHUNKS = (1, 3, 5, 7, 26, 100, None)
"""26 tokens per rank: tiles of 1, tiles that do not divide (3, 5, 7), exactly one tile, more than the tokens, the default."""


@case("loss/tiles", (1, 2))
def tiles(env: Env) -> dict:
    """fp32, bias or not, ignore_index tokens (whole first tiles without a target), a rank with
    no target at all (rank 1 of 2), count_group=WORLD over DP ranks (world 2, SP 1)."""
    topo = env.topo(env.world)
    out = {
        "bias": _compare(topo, *_data("tiles", env.rank), CHUNKS),
        "no bias": _compare(topo, *_data("tiles-nb", env.rank, bias=False), (3, None)),
        "fp64": _compare(topo, *_data("tiles-64", env.rank, dtype=torch.float64), (4,)),
        "1-d tokens": _compare(topo, *_data("tiles-1d", env.rank, tokens=(11,)), (4,)),
    }
    out["fp64"]["dtype"] = out["fp64"][4]["dtype"]
    out["rank without targets"] = _compare(topo, *_data("tiles-empty", env.rank, no_targets=env.rank == 1), (3, None))
    out["no targets anywhere"] = _compare(topo, *_data("tiles-none", env.rank, no_targets=True), (3,))
    if env.world > 1:
        dp = env.topo(1, "contiguous")
        out["count_group world"] = _compare(dp, *_data("tiles-dp", env.rank), (4,), count_group=dist.group.WORLD)
    return out


@case("loss/bf16", (1,))
def bf16(env: Env) -> dict:
    """bf16 hidden/weight: both losses against the fp32 computation of the same bf16 inputs."""
    topo = env.topo(1)
    h, w, b, y = _data("bf16", env.rank, tokens=(2, 40), dtype=torch.bfloat16)
    exact = _compare(topo, h.float(), w.float(), b.float(), y, ())  # only the fp32 reference
    out = {}
    for label, fn in (
        ("untiled", lambda hh, ww, bb: usp.sp_cross_entropy(hh @ ww.T + bb, y, topo)),
        ("tiled", lambda hh, ww, bb: sp_linear_cross_entropy(hh, ww, y, topo, bias=bb, chunk_tokens=7)),
    ):
        xs = [t.clone().requires_grad_() for t in (h, w, b)]
        loss = fn(*xs)
        loss.backward()
        xs32 = [t.float().requires_grad_() for t in (h, w, b)]
        ref = usp.sp_cross_entropy(xs32[0] @ xs32[1].T + xs32[2], y, topo)
        ref.backward()
        out[label] = {"loss": _rel(loss, ref.detach()), "dtype": str(loss.dtype), "grad dtypes": [str(x.grad.dtype) for x in xs]}
        out[label].update({n: _rel(x.grad, x32.grad) for n, x, x32 in zip(("dhidden", "dweight", "dbias"), xs, xs32)})
    out["exact ref loss"] = exact["ref_loss"]
    return out


@case("loss/tied", (1, 2))
def tied(env: Env) -> dict:
    """The head's weight is the embedding table: its gradient is the sum of both uses."""
    topo = env.topo(env.world)
    g = generator("tied", env.rank)
    table = torch.randn(VOCAB, WIDTH, generator=g) * 0.5
    mix = torch.randn(WIDTH, WIDTH, generator=g) * 0.3
    ids = torch.randint(0, VOCAB, (2, 13), generator=g)
    y = torch.randint(0, VOCAB, (2, 13), generator=g)
    y[0, :3] = -100

    def run(tiled):
        e, m = table.clone().requires_grad_(), mix.clone().requires_grad_()
        hidden = torch.tanh(e[ids] @ m)
        loss = sp_linear_cross_entropy(hidden, e, y, topo, chunk_tokens=4) if tiled else usp.sp_cross_entropy(hidden @ e.T, y, topo)
        loss.backward()
        return loss.detach(), e.grad, m.grad

    ref, ours = run(False), run(True)
    return {"loss": _rel(ours[0], ref[0]), "dtable": _rel(ours[1], ref[1]), "dmix": _rel(ours[2], ref[2])}


@case("loss/errors", (1,))
def errors(env: Env) -> dict:
    topo = env.topo(1)
    h, w, b, y = _data("errors", 0)

    def call(hidden_local=h, weight=w, shift_labels_local=y, **kw):
        return lambda: sp_linear_cross_entropy(hidden_local, weight, shift_labels_local, topo, **{"bias": b, **kw})

    y_oob = y.clone()
    y_oob[1, 2] = VOCAB
    return {
        "hidden width": raised(call(hidden_local=h[..., :-1])),
        "weight 1-d": raised(call(weight=w[0])),
        "labels length": raised(call(shift_labels_local=y[:, :-1])),
        "labels float": raised(call(shift_labels_local=y.float())),
        "label out of range": raised(call(shift_labels_local=y_oob)),
        "bias shape": raised(call(bias=b[:-1])),
        "dtype mismatch": raised(call(hidden_local=h.double())),
        "chunk 0": raised(call(chunk_tokens=0)),
        "chunk -3": raised(call(chunk_tokens=-3)),
        "chunk 2.5": raised(call(chunk_tokens=2.5)),
        "softcap model": _softcap_error(topo),
    }


def _softcap_error(topo) -> str:
    if importlib.util.find_spec("transformers") is None:
        return None  # the test skips this entry
    from .hf_cases import batch, tiny_model

    model = tiny_model("gemma2")
    local = usp.shard_batch(batch(False), topo)
    return raised(lambda: causal_lm_loss(model, local, topo))


# --------------------------------------------------------------------------- Hugging Face models

HF_LOSS = {
    "llama/ulysses": dict(backend="ulysses"),
    "llama/allgather": dict(backend="allgather"),
    "llama/ring": dict(backend="ring"),
    "llama/hybrid": dict(backend="hybrid"),
    "llama/ulysses/packed": dict(backend="ulysses", packed=True),
    "llama/ring/packed+tied": dict(backend="ring", packed=True, tie_word_embeddings=True),
    "llama/allgather/tied": dict(backend="allgather", tie_word_embeddings=True),
}


def hf_loss(topo, backend: str, packed=False, chunk_tokens=5, **overrides) -> dict:
    """causal_lm_loss (tiled) against the model's logits + sp_cross_entropy (untiled): loss and
    every parameter gradient of this rank (no reduction: each rank's own gradient must match)."""
    from .hf_cases import batch, tiny_model

    ref = tiny_model("llama", **overrides)
    ours = copy.deepcopy(ref)
    for m in (ref, ours):
        usp.apply_sequence_parallel(m, topo, backend=backend)
    local = usp.shard_batch(batch(packed), topo)
    logits = ref(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
    ref_loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    ref_loss.backward()
    loss = causal_lm_loss(ours, local, topo, chunk_tokens=chunk_tokens)
    loss.backward()
    worst, grad_rel = None, 0.0
    for (name, p), p_ref in zip(ours.named_parameters(), ref.parameters()):
        r = _rel(p.grad, p_ref.grad)
        if r >= grad_rel:
            worst, grad_rel = name, r
    return {
        "loss": _rel(loss.detach(), ref_loss.detach()),
        "grad_rel": grad_rel,
        "worst_param": worst,
        "tied": ours.get_output_embeddings().weight is ours.get_input_embeddings().weight,
        "forward restored": "forward" not in ours.get_output_embeddings().__dict__,
    }


# --------------------------------------------------------------------------- DeepSpeed

DS_LOSS = {"zero2": dict(stage=2), "zero3": dict(stage=3), "zero3/tied": dict(stage=3, tie_word_embeddings=True)}


def ds_loss(topo, stage: int, **overrides) -> dict:
    """One engine step, tiled (causal_lm_loss(engine, ...)) against untiled (engine logits +
    sp_cross_entropy): loss, every full gradient after backward and every parameter after step."""
    from ulysses_sp.integrations.deepspeed import SequenceParallelMPU, gradient_scale, use_cpu_accelerator_if_needed

    use_cpu_accelerator_if_needed()
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", os.path.join(tempfile.gettempdir(), "usp-torch-extensions"))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from .ds_cases import _ds_config, _global_batch
    from .hf_cases import tiny_model

    base = tiny_model("llama", **overrides)
    data = _global_batch(topo.dp_size)
    mine = {k: v[topo.dp_rank : topo.dp_rank + 1] for k, v in data.items()}
    local = usp.shard_batch(mine, topo)
    # SGD: the update is linear in the gradient (Adam's first step, g / |g|, blows up rounding of tiny gradients)
    config = {**_ds_config(stage, True), "zero_allow_untested_optimizer": True}
    results = []
    for tiled in (False, True):
        model = usp.apply_sequence_parallel(copy.deepcopy(base), topo, backend="ulysses")
        engine, *_ = deepspeed.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1.0), config=config, mpu=SequenceParallelMPU(topo),
        )
        if tiled:
            loss = causal_lm_loss(engine, local, topo, chunk_tokens=7, count_group=dist.group.WORLD)
        else:
            out = engine(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits
            loss = usp.sp_cross_entropy(out, local["shift_labels"], topo, count_group=dist.group.WORLD)
        engine.backward(loss * gradient_scale(engine, topo))
        grads = [safe_get_full_grad(p).clone() for p in engine.module.parameters()]
        shapes = [tuple(p.shape) for p in engine.module.parameters()]
        engine.step()
        params = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
        restored = "forward" not in engine.module.__dict__ and "forward" not in engine.module.get_output_embeddings().__dict__
        results.append((loss.detach(), grads, params, shapes, restored))
        engine.destroy()
    (ref_loss, ref_grads, ref_params, _, _), (loss, grads, params, shapes, restored) = results
    return {
        "loss": _rel(loss, ref_loss),
        "grad_rel": max(_rel(g, r) for g, r in zip(grads, ref_grads)),
        "param_rel": max(_rel(p, r) for p, r in zip(params, ref_params)),
        "moved": max(_rel(p, base_p.detach()) for p, base_p in zip(params, base.parameters())),
        "n_params": len(grads),
        "grad_shapes_full": all(tuple(g.shape) == tuple(bp.shape) for g, bp in zip(grads, base.parameters())),
        "partitioned": stage == 3 and any(s == (0,) or s == torch.Size([0]) for s in shapes),
        "restored": restored,
    }


def _hf_loss_case(env: Env, name: str) -> dict:
    return hf_loss(_topo_for(env, Parity(), "zigzag"), **HF_LOSS[name])


def _ds_loss_case(env: Env, name: str) -> dict:
    return ds_loss(_topo_for(env, Parity(sp_size=2), "zigzag"), **DS_LOSS[name])


if importlib.util.find_spec("transformers") is not None:
    for _name in HF_LOSS:
        case(f"loss/hf/{_name}", (2, 4))(lambda env, n=_name: _hf_loss_case(env, n))
if importlib.util.find_spec("deepspeed") is not None:
    for _name in DS_LOSS:
        case(f"loss/deepspeed/{_name}", (2,))(lambda env, n=_name: _ds_loss_case(env, n))


@case("loss/memory", (1,))
def memory(env: Env) -> dict:
    """The largest tensor any op makes in forward + backward (a dispatch mode sees every op):
    400 tokens x vocab 1000, tiles of 16 tokens; the untiled path for comparison."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Largest(TorchDispatchMode):
        numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    topo = env.topo(1)
    g = generator("memory")
    h = torch.randn(1, 400, 8, generator=g, requires_grad=True)
    w = torch.randn(1000, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 1000, (1, 400), generator=g)
    out = {}
    for label, fn in (("tiled", lambda: sp_linear_cross_entropy(h, w, y, topo, chunk_tokens=16)),
                      ("untiled", lambda: usp.sp_cross_entropy(h @ w.T, y, topo))):
        with Largest() as mode:
            fn().backward()
        out[label] = mode.numel
    return out
