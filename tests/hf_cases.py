"""Hugging Face transformers cases (run inside the spawned ranks; transformers imported lazily)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

import ulysses_sp as usp

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SEQ = 45
WINDOW = 8
"""Sliding window of the windowed models: shorter than a rank's shard (24 or 12 of the 48 padded
tokens at P=2, 4) and at P=4 longer than a zigzag chunk (6), so windows cut inside shards and
reach across chunks and ranks."""
_SLIDE_FULL = ["sliding_attention", "full_attention"]
WINDOWED = {  # family: (config class, attention of the one-process reference, overrides, {feature: overrides without it})
    "mistral-window": ("MistralConfig", "sdpa", dict(sliding_window=WINDOW), {"window": dict(sliding_window=None)}),
    # Qwen2 derives layer_types from max_window_layers: layers i >= max_window_layers slide, so layer 0 is full, layer 1 slides
    "qwen2-window": ("Qwen2Config", "sdpa", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),
                     {"window": dict(use_sliding_window=False)}),
    # sdpa cannot softcap (Gemma 2 refuses it): eager is the reference, fine in fp32. Weights of std 0.2 give scores
    # of a few units, so a cap of 2 changes the logits by tens of percent (std 0.02 would leave it at 1e-6).
    "gemma2": ("Gemma2Config", "eager", dict(sliding_window=WINDOW, attn_logit_softcapping=2.0, layer_types=_SLIDE_FULL, initializer_range=0.2),
               {"window": dict(sliding_window=4096), "softcap": dict(attn_logit_softcapping=None)}),
    "gemma3": ("Gemma3TextConfig", "sdpa", dict(sliding_window=WINDOW, layer_types=_SLIDE_FULL), {"window": dict(sliding_window=4096)}),
}
_CONFIGS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config", "gpt_oss": "GptOssConfig"}


def tiny_model(family: str, dtype=torch.float32, without: str | None = None, **overrides):
    """A randomly initialised 2-layer model with GQA (4 q heads, 2 kv heads); no hub access.
    A family of ``WINDOWED`` has its sliding window (and softcap); ``without="window"`` (or
    ``"softcap"``) gives the same weights without that feature."""
    import transformers

    settings = dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, attention_dropout=0.0, use_cache=False,
    )
    # sdpa, not eager: eager takes the softmax in fp32 even for fp64 models
    attn_implementation = "sdpa"
    if family in WINDOWED:
        config_class, attn_implementation, on, off = WINDOWED[family]
        settings.update(on, **(off[without] if without else {}))
        if family.startswith("gemma"):
            settings["query_pre_attn_scalar"] = settings["head_dim"]
    else:
        config_class = _CONFIGS[family]
    if family == "mistral":
        settings["sliding_window"] = None
    if family == "gpt_oss":  # learned attention sinks on sliding and full layers; sdpa cannot run them
        settings.update(num_local_experts=2, num_experts_per_tok=1, sliding_window=WINDOW, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
        attn_implementation = "eager"
    config = getattr(transformers, config_class)(**{**settings, **overrides})
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation).to(dtype)
    for module in model.modules():  # initialised near 0, a sink weighs about one key; drawn around 1, a dropped or doubled one shows
        if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
            torch.nn.init.normal_(module.sinks, 1.0, 1.0)
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


def sliding_layers(config) -> list[int]:
    """The layers with a sliding window: ``layer_types`` where the model has them, else all
    when ``sliding_window`` is set (Mistral); the attention modules read it the same way."""
    types = getattr(config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types) if t == "sliding_attention"]
    return list(range(config.num_hidden_layers)) if getattr(config, "sliding_window", None) is not None else []


def layer_backends(config, backend: str):
    """``"halo+ring"``: halo on the sliding layers, ring on the others, as a callable
    ``layer_idx -> name`` (what apply_sequence_parallel takes); any other name as it is."""
    if "+" not in backend:
        return backend
    sliding, full = backend.split("+")
    slides = set(sliding_layers(config))
    return lambda i: sliding if i in slides else full


def _one_process_logits(model, inputs):
    """The model on the whole row, one packed document at a time (a new one where positions restart):
    transformers' eager attention of some families (GPT-OSS) lets packed documents see each other."""
    pos = inputs["position_ids"]
    if pos is None:
        return model(**inputs).logits
    starts = [i for i in range(pos.shape[1]) if pos[0, i] == 0] + [pos.shape[1]]
    return torch.cat([model(input_ids=inputs["input_ids"][:, a:b], position_ids=pos[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)


def hf_parity(topo, family: str, backend: str, packed=False, checkpointing=False, dtype=torch.float32) -> dict:
    """Logits, loss and every parameter gradient of the SP model against the same model on one process."""
    ref = tiny_model(family, dtype)
    sp_model = copy.deepcopy(ref)
    data = batch(packed)
    inputs = dict(input_ids=data["input_ids"], position_ids=data.get("position_ids"))
    ref_logits = _one_process_logits(ref, inputs)
    # the loss by hand: transformers' own casts logits to fp32, which would blur the fp64 case
    ref_loss = F.cross_entropy(ref_logits[0, :-1], data["labels"][0, 1:], ignore_index=-100)
    ref_loss.backward()
    effects = {}  # how much the window / softcap change the one-process logits: the parity is not vacuous
    with torch.no_grad():
        for feature in WINDOWED.get(family, (None, None, None, {}))[3]:
            effects[feature] = _rel(_one_process_logits(tiny_model(family, dtype, without=feature), inputs), ref_logits.detach())

    usp.apply_sequence_parallel(sp_model, topo, backend=layer_backends(sp_model.config, backend))
    if checkpointing:
        sp_model.gradient_checkpointing_enable()
    local = usp.shard_batch(data, topo)
    logits = sp_model(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
    loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    loss.backward()

    worst, grad_rel = None, 0.0
    names, params = zip(*sp_model.named_parameters())
    summed = usp.comm.all_reduce_sums([p.grad for p in params], topo.sp_group)  # the SP group's gradient is the sum of its ranks'
    for name, grad, p_ref in zip(names, summed, ref.parameters()):
        if _rel(grad, p_ref.grad) >= grad_rel:
            worst, grad_rel = name, _rel(grad, p_ref.grad)
    with torch.no_grad():
        full_logits = usp.gather_sequence(logits, topo)[:, :SEQ]
        eval_logits = sp_model.eval()(input_ids=local["input_ids"], position_ids=local["position_ids"], cu_seq_lens_q=local.get("cu_seqlens")).logits
    chosen = {layer.layer_idx: sorted({b.name for b in layer.__dict__["_ulysses_sp_attention"]._chosen.values()})
              for layer in sp_model.modules() if "_ulysses_sp_attention" in layer.__dict__}
    usp.remove_sequence_parallel(sp_model)
    return {
        "logits_rel": _rel(full_logits, ref_logits.detach()),
        "eval_logits_rel": _rel(usp.gather_sequence(eval_logits, topo)[:, :SEQ], ref_logits.detach()),
        "loss_err": abs(loss.item() - ref_loss.item()),
        "grad_rel": grad_rel,
        "worst_param": worst,
        "original": ref.config._attn_implementation,
        "restored": sp_model.config._attn_implementation,
        "chosen": sorted({n for names in chosen.values() for n in names}),
        "chosen_by_layer": chosen,
        "sliding_layers": sliding_layers(ref.config),
        "effects": effects,
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
# Sliding windows (and Gemma 2's softcap): every backend on Mistral (every layer slides), one or two on
# the models that mix sliding and full layers; halo runs only windowed layers, so "halo+ring" is
# halo on the sliding layers and ring on the full ones.
HF_CASES.update({f"mistral-window/{backend}": dict(family="mistral-window", backend=backend)
                 for backend in ("ulysses", "allgather", "ring", "hybrid", "halo", "auto")})
HF_CASES.update({
    "mistral-window/halo/packed": dict(family="mistral-window", backend="halo", packed=True),
    "qwen2-window/halo+ring": dict(family="qwen2-window", backend="halo+ring"),
    "qwen2-window/hybrid/packed": dict(family="qwen2-window", backend="hybrid", packed=True),
    "gemma2/ulysses": dict(family="gemma2", backend="ulysses"),
    "gemma2/halo+allgather/packed": dict(family="gemma2", backend="halo+allgather", packed=True),
    "gemma3/ring/packed": dict(family="gemma3", backend="ring", packed=True),
    "gemma3/halo+ulysses": dict(family="gemma3", backend="halo+ulysses"),
    "gemma3/auto": dict(family="gemma3", backend="auto"),
})
# GPT-OSS: learned attention sinks (s_aux) on alternating sliding and full layers
HF_CASES.update({f"gpt_oss/{backend}": dict(family="gpt_oss", backend=backend) for backend in ("ulysses", "hybrid", "auto")})
HF_CASES.update({
    "gpt_oss/ring/packed": dict(family="gpt_oss", backend="ring", packed=True),
    "gpt_oss/halo+allgather/packed": dict(family="gpt_oss", backend="halo+allgather", packed=True),
})


def hf_errors(topo) -> dict:
    """Features the backends cannot do: a clear error naming the feature and the backend."""
    from .cases import raised

    data = usp.shard_batch(batch(False), topo)
    out = {}
    for name, family, overrides in (
        ("dropout in training", "llama", {"attention_dropout": 0.1}),
    ):
        model = tiny_model(family, **overrides)
        usp.apply_sequence_parallel(model, topo, backend="ring")
        out[name] = raised(lambda m=model: m(input_ids=data["input_ids"], position_ids=data["position_ids"]))
    # an additive bias passed as the mask (ALiBi-style): dropping it would be silently wrong
    from ulysses_sp.models.switch import sp_attention_forward

    layer = usp.apply_sequence_parallel(tiny_model("llama"), topo, backend="ring").model.layers[0].self_attn
    q = torch.randn(1, 4, data["input_ids"].shape[1], 8)
    out["additive mask"] = raised(lambda: sp_attention_forward(layer, q, q[:, :2], q[:, :2], -torch.rand(1, 1, q.shape[2], q.shape[2])))
    # generation: the second step's keys include the cached ones
    model = usp.apply_sequence_parallel(tiny_model("llama"), topo, backend="ring").eval()
    cache = model(input_ids=data["input_ids"], position_ids=data["position_ids"], use_cache=True).cache
    step = dict(input_ids=data["input_ids"][:, -2:], position_ids=data["position_ids"][:, -2:] + SEQ)
    out["kv cache"] = raised(lambda: model(**step, cache=cache, use_cache=True))
    return out
