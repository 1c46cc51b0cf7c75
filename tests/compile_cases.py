"""SP attention under ``torch.compile(fullgraph=True)`` (ulysses_sp/eager_ops.py), inside the
spawned ranks; assertions in tests/test_compile.py. Every case runs the same shards eagerly and
compiled and returns the differences (outputs, each gradient), the bytes each way sent, and the
graphs and graph breaks compiled (the eager control: what ``torch._dynamo.explain`` saw)."""

from __future__ import annotations

import datetime
import functools
import itertools

import torch

import ulysses_sp as usp
from ulysses_sp import comm

from .cases import case, generator, max_err, raised
from .reference import reference_attention

# backend -> attention options it needs (halo runs only windowed layers); at P=4 the hybrid is 2 x 2
BACKENDS = {"ulysses": {}, "ulysses-g2": {}, "allgather": {}, "ring": {}, "hybrid": {}, "halo": {"window": 6}}
KERNELS = ("torch", "math")
HQ, HKV, D = 4, 2, 8


def _shards(env, topo, name: str, packed: bool = False, v_dim: int = D):
    """Global q, k, v (and cu_seqlens), and this rank's shards of them as leaves."""
    s = 8 * env.world
    g = generator(name)
    full = [torch.randn(2, s, h, d, generator=g) for h, d in ((HQ, D), (HKV, D), (HKV, v_dim))]
    cu = torch.tensor([0, 5, s - 3, s]) if packed else None
    local = [usp.shard_sequence(t, topo, cu_seqlens=cu).clone().requires_grad_() for t in full]
    return full, cu, local


def _run(fn, local, cu, options, g_out):
    """fn's output and gradients (of <out, g_out>), and the bytes it sent in attention traffic (the
    first call's agreement check is not repeated)."""
    leaves = [t.detach().clone().requires_grad_() for t in local]
    if options.get("sinks") is not None:  # a parameter of the model: its gradient is compared too
        options = dict(options, sinks=options["sinks"].detach().clone().requires_grad_())
        leaves_and_sinks = [*leaves, options["sinks"]]
    else:
        leaves_and_sinks = leaves
    with usp.CommCounter() as counter:
        out = fn(*leaves, cu_seqlens=cu, **options)
        (out * g_out).sum().backward()
    return [out.detach()] + [t.grad for t in leaves_and_sinks], sum(o.sent for op, o in counter.by_op.items() if op != "handshake")


def _counting(backend) -> tuple:
    """``backend`` (a name or a callable), and the list of the graphs Dynamo hands it (one per graph compiled)."""
    graphs, inner = [], torch._dynamo.lookup_backend(backend)

    def compile_fn(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    return compile_fn, graphs


def in_turn(env, name: str):
    """Inductor, with the ranks lowering in turn: rank 0 compiles each graph into Inductor's cache and
    marks it on the group's store; every other rank waits for the mark and then finds the graph there
    (the ranks trace the same graphs in the same order). Lowering side by side, each rank did all of
    Inductor's work: rank 1's compile-model/ at P=2 took 14.0 CPU s on an empty cache, 7.4 in turn."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    store, made = torch.distributed.distributed_c10d._get_default_store(), itertools.count()

    def inner(gm, example_inputs, **options):
        mark = f"in-turn/{name}/{next(made)}"
        if env.rank != 0:
            store.wait([mark], datetime.timedelta(seconds=300))
        compiled = compile_fx_inner(gm, example_inputs, **options)
        if env.rank == 0:
            store.set(mark, "compiled")
        return compiled

    return functools.partial(compile_fx, inner_compile=inner)


def _cache(what: str) -> int:
    """Graphs so far that Inductor's cache could not key (``bypass``: each then compiled anew in every
    process; an op argument it cannot pickle does it) or did not have (``miss``).
    AOTAutograd's own cache is not counted: it also refuses any graph holding an
    ``autograd.Function``, a limit of torch's, not ours."""
    return torch._dynamo.utils.counters["inductor"][f"fxgraph_cache_{what}"]


def compare(env, topo, attn, name: str, options: dict, packed: bool = False, v_dim: int = D, backend: str = "inductor",
            attention: bool = True) -> dict:
    """Eager against ``torch.compile(attn, fullgraph=True)``: largest differences, bytes, graphs;
    and when ``attn`` is the attention, the compiled output's difference from the one-process reference.
    The graphs are those compiled for the call (not a second trace by ``torch._dynamo.explain``,
    which cost a trace each); a graph break would have raised (``fullgraph``), and is counted."""
    torch._dynamo.reset()  # each case compiles afresh: SequenceParallelAttention.forward is one code object
    full, cu, local = _shards(env, topo, name, packed, v_dim)
    g_out = torch.randn(*local[0].shape[:3], v_dim, generator=generator(name, 1))
    eager, eager_bytes = _run(attn, local, cu, options, g_out)
    counting, graphs = _counting(in_turn(env, name) if backend == "inductor" else backend)
    breaks, bypassed, missed = sum(torch._dynamo.utils.counters["graph_break"].values()), _cache("bypass"), _cache("miss")
    compiled, compiled_bytes = _run(torch.compile(attn, fullgraph=True, backend=counting), local, cu, options, g_out)
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values()) - breaks
    want = reference_attention(*full, cu_seqlens=None if cu is None else cu.tolist(), window=options.get("window"),
                               sinks=options.get("sinks")) if attention else None
    return {
        "eager": max(max_err(a, b) for a, b in zip(eager, compiled)),
        "reference": None if want is None else max_err(compiled[0], usp.shard_sequence(want, topo, cu_seqlens=cu)),
        "bytes": (eager_bytes, compiled_bytes),
        "graphs": (len(graphs), breaks),
        "cache bypassed": _cache("bypass") - bypassed,
        "cache missed": _cache("miss") - missed,
    }


@case("compile/", worlds=(2, 4))
def every_backend(env) -> dict:
    """Each backend with the torch and math kernels, causal GQA (halo: a window of 6)."""
    topo = env.topo(ulysses_degree=2)
    return {f"{b}-{k}": compare(env, topo, usp.SequenceParallelAttention(topo, backend=b, kernel=k), f"compile/{b}-{k}", options)
            for b, options in BACKENDS.items() for k in KERNELS}


@case("compile-forms/", worlds=(2,))
def other_forms(env) -> dict:
    """Packed documents (cu_seqlens a tensor), a value head dim other than q/k's (MLA), ``auto``,
    the functional form, AOTAutograd without Inductor, the attention inside Inductor's own code,
    and the contiguous and balanced (packed) layouts."""
    topo = env.topo()
    ring = usp.SequenceParallelAttention(topo, backend="ring", kernel="torch")

    def functional(q, k, v, **options):
        return usp.sp_attention(q, k, v, topo, backend="allgather", kernel="math", **options)

    return {
        "packed": compare(env, topo, ring, "compile-forms/packed", {}, packed=True),
        "mla": compare(env, topo, usp.SequenceParallelAttention(topo, backend="ulysses", kernel="torch"), "compile-forms/mla", {}, v_dim=6),
        "auto": compare(env, topo, usp.SequenceParallelAttention(topo, kernel="torch"), "compile-forms/auto", {}),
        "functional": compare(env, topo, functional, "compile-forms/functional", {}),
        "aot_eager": compare(env, topo, ring, "compile-forms/aot", {"window": 6}, backend="aot_eager"),
        "sinks": compare(env, topo, ring, "compile-forms/sinks", {"sinks": torch.randn(HQ, generator=generator("compile-forms/sinks")) + 1.0},
                         packed=True),
        "surrounded": compare(env, topo, _Surrounded(ring), "compile-forms/surrounded", {}, attention=False),
        "contiguous": compare(env, env.topo(layout="contiguous"), usp.SequenceParallelAttention(env.topo(layout="contiguous"), backend="ring",
                                                                                              kernel="torch"), "compile-forms/contiguous", {}),
        "balanced": compare(env, env.topo(layout="balanced"), usp.SequenceParallelAttention(env.topo(layout="balanced"), backend="ulysses",
                                                                                          kernel="torch"), "compile-forms/balanced", {}, packed=True),
        # control: the eager call traced as it is breaks the graph (collectives, host reads), so the check can fail
        "traced-eager": _graphs(ring._forward, _shards(env, topo, "compile-forms/traced")[2]),
    }


class _Surrounded(torch.nn.Module):
    """The attention between computations Inductor owns: its inputs made in the graph, its output
    used once. Inductor reuses a buffer once the graph no longer reads it, so the op must hold no
    storage of the graph's (the ring saves q, k, v and its output for the backward)."""

    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, q, k, v, **options):
        q, k, v = q * 1.5, k + 0.25, v * 2.0
        y = self.attn(q, k, v, **options).sin()
        return (y * 3.0 + q).cos() - (k * v).sum() + y


def _graphs(fn, local) -> tuple[int, int]:
    torch._dynamo.reset()
    explained = torch._dynamo.explain(fn)(*(t.detach() for t in local), causal=True, softmax_scale=None, cu_seqlens=None, window=None, softcap=None)
    return explained.graph_count, explained.graph_break_count


@case("compile-errors/", worlds=(2,))
def errors(env) -> dict:
    """Compiled calls refuse what eager calls refuse, on every rank, before any collective."""
    topo = env.topo()
    torch._dynamo.reset()
    attn = torch.compile(usp.SequenceParallelAttention(topo, backend="ulysses", kernel="torch"), fullgraph=True)
    q = torch.randn(1, 8, 3, D)  # 3 heads do not split over 2 ranks
    seq = 8 if env.rank == 0 else 12  # the ranks disagree on the shard length
    shapes = torch.randn(1, seq, HQ, D)
    good = torch.randn(1, 8, HQ, D)
    with_profile = torch.compile(lambda t: usp.sp_attention(t, t, t, topo, profile=usp.CPU_GLOO_PROFILE), fullgraph=True)
    return {"heads": raised(lambda: attn(q, q, q)), "ranks": raised(lambda: attn(shapes, shapes, shapes)),
            "profile": raised(lambda: with_profile(good), errors=(Exception,))}


def _model_grads(ref, topo, data, compiler, **apply) -> tuple[float, dict, int]:
    """The SP loss and gradients of a copy of ``ref`` switched with ``apply``, and the attention
    bytes its forward and backward sent; its decoder layers compiled (``tiling.compile_layers``;
    fullgraph unless it has mixers) with ``compiler``, a ``torch.compile`` backend, unless it is None."""
    import copy

    from ulysses_sp import tiling
    from ulysses_sp.models.token_mixers import mixer_layers

    model = usp.apply_sequence_parallel(copy.deepcopy(ref), topo, **apply)
    if compiler is not None:
        tiling.compile_layers(model, fullgraph=not mixer_layers(model), backend=compiler)
    local = usp.shard_batch(data, topo)
    with usp.CommCounter() as counter:
        if getattr(ref.config, "final_logit_softcapping", None):  # the fused loss refuses a transform after the head
            loss = usp.sp_cross_entropy(model(**usp.model_inputs(local)).logits, local["shift_labels"], topo)
        else:
            loss = usp.causal_lm_loss(model, local, topo)
        loss.backward()
    sent = sum(o.sent for op, o in counter.by_op.items() if op != "handshake")
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}, sent


def _one_process(ref, data: dict) -> tuple[float, dict]:
    """The loss and gradients of a copy of ``ref`` without SP on the whole batch: the token mean over
    the targets ``shard_batch`` keeps (a document's last token predicts nothing)."""
    import copy

    import torch.nn.functional as F

    model = copy.deepcopy(ref)
    logits = model(input_ids=data["input_ids"], position_ids=data.get("position_ids")).logits
    targets = F.pad(data["labels"][:, 1:], (0, 1), value=-100)
    if "position_ids" in data:
        targets = targets.masked_fill(F.pad(data["position_ids"][:, 1:] == 0, (0, 1), value=False), -100)
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _relative(grads: dict, want: dict) -> float:
    """The gradients' difference, all parameters as one vector, relative to ``want``'s norm."""
    difference = sum((grads[n] - g).square().sum() for n, g in want.items()).sqrt()
    return (difference / sum(g.square().sum() for g in want.values()).sqrt()).item()


@case("compile-model/", worlds=(2, 3))
def compiled_models(env) -> dict:
    """A packed Llama batch with the memory stack (layer checkpointing around the compiled layer,
    the tiled MLP one op in it), Gemma 2 (sliding windows and soft-capping per layer) and Qwen3.5
    (its Gated DeltaNet mixers run eagerly between graphs; the tiled loss through the model's
    hooks), compiled: the loss and gradient differences (all parameters as one vector, relative to
    the norm) from eager SP and from one process, and the bytes sent eager and compiled (each
    attention call, recomputations included, sends its share)."""
    from .hf_cases import tiny_model
    from .hf_trainer_cases import model_for

    torch._dynamo.reset()
    seq = 24 * env.world  # the same shard shapes at every P: the compiled kernels are the same, built once
    ids = torch.randint(0, 64, (1, seq), generator=generator("compile-model/"))
    whole = {"input_ids": ids, "labels": ids}
    packed = {**whole, "position_ids": torch.cat([torch.arange(20), torch.arange(seq - 20)])[None]}
    runs = {"llama-packed-stack": (model_for({"family": "llama"}), packed, dict(backend="ring", checkpoint="layers", tiled_mlp=8)),
            "gemma2": (tiny_model("gemma2"), whole, {}),
            "qwen3_5": (model_for({"family": "qwen3_5"}), whole, {})}
    out = {}
    bypassed, missed = _cache("bypass"), _cache("miss")
    for name, (ref, data, apply) in runs.items():
        (eager_loss, eager, eager_sent), (loss, grads, sent) = (_model_grads(ref, env.topo(), data, compiler, **apply)
                                                                for compiler in (None, in_turn(env, f"compile-model/{name}")))
        one_loss, one = _one_process(ref, data)
        summed = dict(zip(grads, comm.all_reduce_sums(list(grads.values()), env.topo().sp_group)))  # each rank holds its tokens' share
        out[name] = {"eager": (abs(loss - eager_loss), _relative(grads, eager)), "one process": (abs(loss - one_loss), _relative(summed, one)),
                     "bytes": (eager_sent, sent)}
    return {"models": out, "cache bypassed": _cache("bypass") - bypassed, "cache missed": _cache("miss") - missed}
