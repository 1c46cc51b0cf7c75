"""Dropout per SP rank (``ulysses_sp.dropout``) in the pooled ranks: tiny transformers models under
SP in training mode, their dropout masks read through hooks."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import ulysses_sp as usp
from ulysses_sp.dropout import RankDropout, remove_rank_dropout

from .cases import case
from .model_families import config

SEQ = 48


def _gpt2(p: float):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config("gpt2", resid_pdrop=p, embd_pdrop=p)).double().train()


def _embedding_mask(model, topo, data) -> torch.Tensor:
    """The mask GPT-2's embedding dropout drew for this rank's tokens (its input has no zeros)."""
    seen = []
    handle = model.transformer.drop.register_forward_hook(lambda m, args, out: seen.append((out != 0).flatten()))
    model(**usp.model_inputs(usp.shard_batch(data, topo)))
    handle.remove()
    return seen[0]


@case("dropout/masks", (2, 3))
def masks(env) -> dict:
    """Embedding dropout (p 0.5) at the same local positions on every rank: with the SP rank's own
    stream, and (the control) with it removed, as before; functional dropout under the mode."""
    topo = env.topo()
    data = {"input_ids": torch.arange(SEQ)[None] % 64}
    model = usp.apply_sequence_parallel(_gpt2(0.5), topo)
    torch.manual_seed(1)
    mine = _embedding_mask(model, topo, data)
    remove_rank_dropout(model)
    torch.manual_seed(1)
    shared = _embedding_mask(model, topo, data)
    torch.manual_seed(1)
    with RankDropout(topo.sp_rank):
        functional = F.dropout(torch.ones(4096, dtype=torch.float64), 0.5) != 0
    everyone = [torch.zeros_like(t) for t in (mine, shared, functional) for _ in range(topo.sp_size)]
    gathered = {}
    for i, (name, t) in enumerate((("mine", mine), ("shared", shared), ("functional", functional))):
        out = everyone[i * topo.sp_size:(i + 1) * topo.sp_size]
        torch.distributed.all_gather(out, t, group=topo.sp_group)
        gathered[name] = [o.tolist() for o in out]
    return {"masks": gathered, "kept": {"mine": mine.double().mean().item(), "functional": functional.double().mean().item()},
            "sizes": (mine.numel(), functional.numel())}


@case("dropout/zero", (2,))
def zero(env) -> dict:
    """With every dropout 0, and with dropout in evaluation: the switched model's logits and the
    RNG state after are those of the same model with per-rank dropout removed, bit for bit."""
    topo = env.topo()
    data = usp.model_inputs(usp.shard_batch({"input_ids": torch.arange(SEQ)[None] % 64}, topo))
    out = {}
    for what, model in (("p=0", _gpt2(0.0)), ("eval", _gpt2(0.5).eval())):
        usp.apply_sequence_parallel(model, topo)
        runs = []
        for remove in (False, True):
            if remove:
                remove_rank_dropout(model)
            torch.manual_seed(2)
            logits = model(**data).logits
            runs.append((logits, torch.get_rng_state()))
        out[what] = torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    return out


def _grads(model, topo, data, **options):
    usp.apply_sequence_parallel(model, topo, **options)
    torch.manual_seed(3)
    local = usp.shard_batch(data, topo)
    loss = usp.sp_cross_entropy(model(**usp.model_inputs(local)).logits, local["shift_labels"], topo)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _opt(p: float):
    import transformers

    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config("opt", dropout=p)).double().train()


@case("dropout/recompute", (2,))
def recompute(env) -> dict:
    """OPT's (functional) dropout 0.3 under activation checkpointing (ours, per layer and offloaded,
    and transformers'): the recomputation draws the masks the forward drew, so loss and gradients
    equal those without checkpointing; a different draw there would change every gradient below the layer."""
    topo = env.topo()
    data = {"input_ids": torch.arange(SEQ)[None] % 64, "labels": torch.arange(SEQ)[None] % 64}
    base = _opt(0.3)
    ref_loss, ref = _grads(copy.deepcopy(base), topo, data)
    out = {}
    for name, options in (("layers", {"checkpoint": "layers"}), ("offload", {"checkpoint": "offload"}), ("transformers", {})):
        model = copy.deepcopy(base)
        if name == "transformers":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        loss, grads = _grads(model, topo, data, **options)
        out[name] = max([abs(loss - ref_loss).item()] + [(g - r).abs().max().item() for g, r in zip(grads, ref)])
    no_dropout_loss, _ = _grads(_opt(0.0), topo, data)
    out["dropout changes the loss"] = abs(no_dropout_loss - ref_loss).item()
    return out


@case("dropout/layerdrop", (2, 3))
def layerdrop(env) -> dict:
    """OPT with layer drop 0.5 and (functional) dropout 0.2 trains three steps under SP: the layers
    each rank ran, call by call (the same on every rank: the draw stays on the shared stream)."""
    import transformers

    topo = env.topo()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("opt", num_hidden_layers=4, layerdrop=0.5, dropout=0.2)).double().train()
    usp.apply_sequence_parallel(model, topo)
    ran = []
    for i, layer in enumerate(model.model.decoder.layers):
        layer.register_forward_pre_hook(lambda m, args, i=i: ran.append(i))
    data = usp.shard_batch({"input_ids": torch.arange(SEQ)[None] % 64, "labels": torch.arange(SEQ)[None] % 64}, topo)
    for _ in range(3):
        loss = usp.sp_cross_entropy(model(**usp.model_inputs(data)).logits, data["shift_labels"], topo)
        loss.backward()
        ran.append(-1)
    everyone = [None] * topo.sp_size
    torch.distributed.all_gather_object(everyone, ran, group=topo.sp_group)
    return {"ran": everyone}
