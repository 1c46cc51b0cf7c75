"""Hugging Face transformers cases (run inside the spawned ranks; transformers imported lazily)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import ulysses_sp as usp

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SEQ = 45


def tiny_model(family: str, dtype=torch.float32, **overrides):
    """A randomly initialised 2-layer model with GQA (4 q heads, 2 kv heads); no hub access."""
    import transformers

    config_class = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config"}[family]
    settings = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attention_dropout=0.0, use_cache=False,
    )
    if family == "mistral":
        settings["sliding_window"] = None
    config = getattr(transformers, config_class)(**{**settings, **overrides})
    torch.manual_seed(0)
    # sdpa, not eager: eager takes the softmax in fp32 even for fp64 models
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dtype)
    return model.train()


def batch(packed: bool) -> dict:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 64, (1, SEQ), generator=g)
    out = {"input_ids": ids, "labels": ids.clone()}
    if packed:
        pos = torch.cat([torch.arange(n) for n in (7, 2, 20, 16)]).unsqueeze(0)
        out["position_ids"] = pos
        out["labels"] = ids.masked_fill(pos == 0, -100)  # a document does not predict the next one
    return out


def _rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


def hf_parity(topo, family: str, backend: str, packed=False, checkpointing=False, dtype=torch.float32) -> dict:
    """Logits, loss and every parameter gradient of the SP model against the same model on one process."""
    import torch.distributed as dist

    ref = tiny_model(family, dtype)
    sp_model = copy.deepcopy(ref)
    data = batch(packed)
    ref_logits = ref(input_ids=data["input_ids"], position_ids=data.get("position_ids")).logits
    # the loss by hand: transformers' own casts logits to fp32, which would blur the fp64 case
    ref_loss = F.cross_entropy(ref_logits[0, :-1], data["labels"][0, 1:], ignore_index=-100)
    ref_loss.backward()

    usp.apply_sequence_parallel(sp_model, topo, backend=backend)
    if checkpointing:
        sp_model.gradient_checkpointing_enable()
    local = usp.shard_batch(data, topo)
    logits = sp_model(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
    loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    loss.backward()

    worst, grad_rel = None, 0.0
    for (name, p), p_ref in zip(sp_model.named_parameters(), ref.parameters()):
        grad = p.grad.clone()
        dist.all_reduce(grad, group=topo.sp_group)  # the SP group's gradient is the sum of its ranks'
        if _rel(grad, p_ref.grad) >= grad_rel:
            worst, grad_rel = name, _rel(grad, p_ref.grad)
    with torch.no_grad():
        full_logits = usp.gather_sequence(logits, topo)[:, :SEQ]
        eval_logits = sp_model.eval()(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
    chosen = sorted({b.name for layer in sp_model.modules() if "_ulysses_sp_attention" in layer.__dict__
                     for b in layer.__dict__["_ulysses_sp_attention"]._chosen.values()})
    usp.remove_sequence_parallel(sp_model)
    return {
        "logits_rel": _rel(full_logits, ref_logits.detach()),
        "eval_logits_rel": _rel(usp.gather_sequence(eval_logits, topo)[:, :SEQ], ref_logits.detach()),
        "loss_err": abs(loss.item() - ref_loss.item()),
        "grad_rel": grad_rel,
        "worst_param": worst,
        "restored": sp_model.config._attn_implementation,
        "chosen": chosen,
    }


HF_CASES = {f"{family}/ulysses": dict(family=family, backend="ulysses") for family in FAMILIES}
HF_CASES.update({f"llama/{backend}": dict(family="llama", backend=backend) for backend in ("allgather", "ring", "hybrid", "auto")})
HF_CASES.update({
    "llama/ulysses/packed": dict(family="llama", backend="ulysses", packed=True),
    "qwen2/ring/packed": dict(family="qwen2", backend="ring", packed=True),
    "mistral/allgather/checkpointing": dict(family="mistral", backend="allgather", checkpointing=True),
    "qwen3/hybrid/packed+checkpointing": dict(family="qwen3", backend="hybrid", packed=True, checkpointing=True),
    "qwen3/allgather/fp64": dict(family="qwen3", backend="allgather", dtype=torch.float64),
})


def hf_errors(topo) -> dict:
    """Features the backends cannot do: a clear error naming the feature and the backend."""
    from .cases import raised

    data = usp.shard_batch(batch(False), topo)
    out = {}
    for name, family, overrides in (
        ("sliding window", "mistral", {"sliding_window": 8}),
        ("dropout in training", "llama", {"attention_dropout": 0.1}),
    ):
        model = tiny_model(family, **overrides)
        usp.apply_sequence_parallel(model, topo, backend="ring")
        out[name] = raised(lambda m=model: m(input_ids=data["input_ids"], position_ids=data["position_ids"]))
    return out
