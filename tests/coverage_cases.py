"""Coverage, multi-head latent attention and verify_sequence_parallel, run inside the spawned ranks
(registered in tests/cases.py when transformers is installed)."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.distributed as dist
from torch import nn

import ulysses_sp as usp
from ulysses_sp import kernels
from ulysses_sp.models import adapters as _adapters  # noqa: F401 - registers the adapters of transformers' mixers
from ulysses_sp.mixers import MIXERS

from .model_families import EXACT, HYBRID, REFUSED, REFUSED_AT_FORWARD, REFUSED_WITHOUT_MIXER, config
from .reference import reference_attention

MLA_BACKENDS = ("ulysses", "allgather", "ring", "hybrid")
STRATEGY_FAMILIES = (  # each strategy on each kind of mixer it can run, beside what auto takes (hybrids/)
    ("allgather", "qwen3_next", (2, 3, 4)), ("ulysses", "qwen3_next_12kh", (2, 3, 4)), ("ulysses", "bamba_12h", (2, 3, 4)),
    ("ulysses", "bamba", (2, 4)), ("allgather", "bamba", (2, 3, 4)), ("allgather", "lfm2", (2, 3, 4)),
    ("state", "qwen3_5", (2, 3, 4)), ("state", "qwen3_next", (2, 3, 4)), ("state", "kimi_linear", (2, 3, 4)),
    ("state", "bamba", (2, 3, 4)), ("state", "zamba2", (2, 3, 4)), ("state", "mamba2", (2, 3, 4)), ("state", "minimax", (2, 3, 4)),
    ("state", "lfm2", (2, 3, 4)),
)
STATE_BALANCED = ("qwen3_5", "qwen3_next", "kimi_linear", "bamba", "minimax", "lfm2")
"""The families the state strategy runs under the balanced layout (Nemotron-H: hybrids-adapted-state)."""
BALANCED_FAMILIES = ("llama", "gemma3", "deepseek_v3", "qwen3_next", "qwen3_next_12kh", "lfm2", "bamba_12h", "rwkv")
"""Through verify under the balanced layout: GQA, sliding windows, MLA, and every mixer strategy."""
MIXER_LAYER_CASES = (  # strategy, family, worlds: the layer alone, its bytes counted
    ("ulysses", "qwen3_next_12kh", (1, 2, 3, 4)), ("ulysses", "bamba_12h", (1, 2, 3, 4)), ("ulysses", "bamba", (1, 2, 4)),
    ("halo", "lfm2", (1, 2, 3, 4)), ("ulysses", "kimi_linear_12h", (1, 2, 3, 4)), ("state", "qwen3_next_12kh", (1, 2, 3, 4)),
    ("state", "kimi_linear_12h", (1, 2, 3, 4)), ("state", "bamba_12h", (1, 2, 3, 4)), ("state", "minimax", (1, 2, 3, 4)),
)
STATE_PLANTS = ("entry-dropped", "halo-not-reset", "folded-out-of-order")
"""Defects the state strategy's tests must see: a fragment's entry state taken as zeros, the
convolution's halo not zeroed before a document that starts just before a fragment, the
fragments' maps folded in the chunk table's order instead of the row's."""
MLA_HEADS = 12
"""DeepSeek-V3's KV heads equal its q heads; 12 divide by 2, 3 and 4, so Ulysses runs at every P."""


def _summary(report) -> dict:
    attention = {n: e for errs in report.grad_errors.values() for n, e in errs.items() if "attn" in n or "attention" in n}
    return {
        "loss_error": report.loss_error,
        "worst": report.worst,
        "attention_params": sorted({n for n in attention if n.endswith("weight")})[:4],
        "params": len(report.grad_errors["unpacked"]),
        "backends": report.backends,
        "passed": report.passed,
        "layers": report.layers,
        "mixers": report.mixers,
    }


@contextlib.contextmanager
def fp64_throughout():
    """Test-only: the float32 that some families' own code casts to inside an fp64 model (Gated
    DeltaNet's and Mamba2's scans, gated norms) is float64 while open, so SP and one process can be
    compared at fp64's rounding; as shipped, they agree at float32's (``hybrids-shipped``)."""
    saved, default = (torch.float32, torch.float, torch.Tensor.float), torch.get_default_dtype()
    torch.float32 = torch.float = torch.float64
    torch.Tensor.float = torch.Tensor.double
    torch.set_default_dtype(torch.float64)  # tables built at init (MiniMax's decays) in float64 too
    try:
        yield
    finally:
        torch.float32, torch.float, torch.Tensor.float = saved
        torch.set_default_dtype(default)


_REFERENCES = {False: {}, True: {}}
"""verify_sequence_parallel's one-process runs, kept in this rank between cases (``references``),
by whether float32 is lifted, which its key cannot see: a family's layouts, backends and mixer
strategies on one world run them once."""


def family(topo, name: str, backend: str = "auto", lift: bool = False, mixer: str = "auto", **overrides) -> dict:
    """One exact family end to end through verify_sequence_parallel, on its config as built (fp64)."""
    with fp64_throughout() if lift else contextlib.nullcontext():
        report = usp.verify_sequence_parallel(config(name, **overrides), topo, backend=backend, shrink=False, raise_on_mismatch=False,
                                              mixer=mixer, references=_REFERENCES[lift])
    return dict(_summary(report), mixers=report.mixers, tolerance=report.tolerance, noise=report.rounding_noise)


MAMBA2_ADAPTED = {  # the other classes the Mamba2 adapter takes, on their transformers default configs (shrunk)
    "granitemoehybrid": {}, "nemotron_h": {}, "falcon_h1": {}, "falcon_h1-norm": {"mamba_rms_norm": True},
}


def adapted_default(topo, name: str, mixer: str = "ulysses") -> dict:
    """A family whose mixer the Mamba2 adapter takes, from its default config shrunk by verify, under
    mixer="ulysses" with float32 lifted to float64."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with fp64_throughout():
        report = usp.verify_sequence_parallel(CONFIG_MAPPING[name.split("-")[0]](**MAMBA2_ADAPTED[name]), topo, mixer=mixer,
                                              raise_on_mismatch=False)
    return dict(_summary(report), mixers=report.mixers)


SINK_DEFAULTS = {"granite_swa": (2, 3, 4), "granitemoe_swa": (2,), "flint": (2,), "mimo_v2_flash": (2,)}
"""The families with learned attention sinks beside GPT-OSS, on their default configs (shrunk), and
the worlds each runs on: Granite SWA's NoPE full layers, Flint's window of 513, MiMo-V2-Flash's
value head dim (128) unlike its query/key one (192), sinks on its sliding layers only."""


SHRUNK_DEFAULTS = {  # case: (model type, settings over its default config, worlds)
    "gemma4_text": ("gemma4_text", {}, (2, 3, 4)),
    "gemma4_text-shared-moe": ("gemma4_text", dict(num_kv_shared_layers=12, attention_k_eq_v=True, num_global_key_value_heads=1, enable_moe_block=True,
                                                   num_experts=4, top_k_experts=2, moe_intermediate_size=16), (2, 4)),
    "gemma3n_text": ("gemma3n_text", {}, (2, 4)),
    "longcat_flash": ("longcat_flash", {}, (2, 4)),
}
"""Families from their default configs shrunk by verify, with a window of 8 where they have one (verify's
rows cross it). Gemma 4 and Gemma 3n: per-layer head dims (the full layers' 16 beside 8), per-layer
inputs, the last layers reusing earlier layers' keys and values (the shipped Gemma 4 E2B/E4B share
the last 20 and 18), Gemma 4's keys as values on full layers (one global KV head) and MoE block,
Gemma 3n's AltUp, LAuReL and activation sparsity. LongCat-Flash: two multi-head latent attention
sublayers per layer, in a class whose name does not say attention."""


INDEXED = {  # case: (model type, settings over its default config)
    "deepseek_v32": ("deepseek_v32", {}),
    "glm_moe_dsa-shared": ("glm_moe_dsa", dict(index_topk_freq=2, index_skip_topk_offset=1)),
    "axk2": ("axk2", {}),
    "hy_v4": ("hy_v4", {}),
}
"""DeepSeek Sparse Attention's families from their default configs shrunk by verify: the indexer keeps 6 keys a query
of rows of 29 to 53 tokens (8 heads of 8, so that exact ties of its scores are rare: see docs/guides/transformers.md).
GLM-5 with every other layer reusing the layer before's choice (its default has none; Hy4's default has them)."""


def indexed_default(topo, name: str) -> dict:
    """A DSA family through verify, float32 lifted, and the strategy each of its attention modules ran."""
    model_type, settings = INDEXED[name]
    return shrunk_default(topo, model_type, **settings)


def indexed_in_chunks(topo, name: str) -> dict:
    """`indexed_default` with one query a chunk, in the indexer's scores and in the attention over the chosen latents."""
    from ulysses_sp.mixers import indexed

    saved = indexed.CHUNK_ELEMENTS, indexed.INDEX_CHUNK_ELEMENTS
    indexed.CHUNK_ELEMENTS = indexed.INDEX_CHUNK_ELEMENTS = 1
    try:
        return indexed_default(topo, name)
    finally:
        indexed.CHUNK_ELEMENTS, indexed.INDEX_CHUNK_ELEMENTS = saved


def indexed_planted(topo) -> dict:
    """Control: DeepSeek-V3.2's indexer choosing among this rank's own keys only (its mask cut to them under SP)."""
    from transformers.models.deepseek_v32 import modeling_deepseek_v32 as dsv32

    from ulysses_sp import layout

    own = dsv32.DeepseekV32Indexer.forward

    def local_keys_only(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs):
        rows, keys = attention_mask.shape[-2:]
        if rows != keys:  # under SP: this rank's queries against the whole row's keys
            mine = torch.zeros(keys, dtype=torch.bool, device=attention_mask.device)
            mine[layout.positions(topo.layout, keys, topo.sp_size, topo.sp_rank)] = True
            attention_mask = attention_mask & mine
        return own(self, hidden_states, q_resid, position_embeddings, attention_mask, *args, **kwargs)

    dsv32.DeepseekV32Indexer.forward = local_keys_only
    try:
        return shrunk_default(topo, "deepseek_v32")
    finally:
        dsv32.DeepseekV32Indexer.forward = own


def _counted_step(topo, config):
    """A model of ``config`` (fp64) under SP on two rows of 16 tokens a rank: the bytes of a forward and a backward counted
    after a warm-up (the first forward's checks send their own). (model, inputs, logits, forward's counter, backward's)."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()
    usp.apply_sequence_parallel(model, topo)
    ids = torch.randint(0, config.vocab_size, (2, 16 * topo.sp_size), generator=torch.Generator().manual_seed(0))
    inputs = usp.model_inputs(usp.shard_batch({"input_ids": ids, "labels": ids}, topo))
    with torch.no_grad():
        model(**inputs)
    with usp.CommCounter() as fwd:
        logits = model(**inputs).logits
    with usp.CommCounter() as bwd:
        logits.sum().backward()
    return model, inputs, logits, fwd, bwd


def indexed_bytes(topo) -> dict:
    """The bytes GLM-5's DSA layers send (every other one reusing the choice before it), counted in a forward
    and a backward after a warm-up (the first forward's checks send their own), with the dimensions to count them by."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ulysses_sp.models.shrink import shrink_config

    config = shrink_config(CONFIG_MAPPING["glm_moe_dsa"](**INDEXED["glm_moe_dsa-shared"][1]))
    model, _, _, fwd, bwd = _counted_step(topo, config)
    attention = model.model.layers[0].self_attn
    return {"bytes": (fwd.bytes_sent, bwd.bytes_sent), "ops": (sorted(fwd.by_op), sorted(bwd.by_op)), "rows": 2, "local": 16,
            "latent": attention.kv_lora_rank + attention.qk_rope_head_dim, "index": config.index_head_dim, "types": list(config.indexer_types)}


COMPRESSED = {  # case: settings over DeepSeek-V4's default config
    "deepseek_v4": {},
    "deepseek_v4-kinds": dict(layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"], num_hidden_layers=3),
}
"""DeepSeek-V4 from its default config shrunk by verify (windows of 8 for its sliding window and heavily compressed layers,
4 for its compressed sparse ones, the indexer keeping 6 entries): its default's layers (heavily compressed, hash-routed,
and one compressed sparse), and one layer of each kind (a sliding one too). Unpacked rows only (packed ones are refused)."""


def compressed_default(topo, name: str) -> dict:
    """DeepSeek-V4 through verify, float32 lifted, and the strategy each of its attention modules ran."""
    return shrunk_default(topo, "deepseek_v4", **COMPRESSED[name])


def compressed_in_chunks(topo) -> dict:
    """`compressed_default` (one layer of each kind) with one query a chunk, in the indexer's scores and in the attention."""
    from ulysses_sp.mixers import compressed

    saved = compressed.CHUNK_ELEMENTS, compressed.INDEX_CHUNK_ELEMENTS
    compressed.CHUNK_ELEMENTS = compressed.INDEX_CHUNK_ELEMENTS = 1
    try:
        return compressed_default(topo, "deepseek_v4-kinds")
    finally:
        compressed.CHUNK_ELEMENTS, compressed.INDEX_CHUNK_ELEMENTS = saved


def compressed_planted(topo) -> dict:
    """Control: compressed sparse attention's first window on each chunk made without the previous window's overlap series
    (as if the chunk began the row)."""
    from ulysses_sp.mixers import compressed

    own = compressed._Collect.update_overlap_state
    compressed._Collect.update_overlap_state = lambda self, *args: (None, None)
    try:
        return compressed_default(topo, "deepseek_v4-kinds")
    finally:
        compressed._Collect.update_overlap_state = own


def compressed_packed(topo) -> str:
    """DeepSeek-V4 given packed rows: the refusal's words."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    try:
        usp.verify_sequence_parallel(CONFIG_MAPPING["deepseek_v4"](**COMPRESSED["deepseek_v4-kinds"]), topo, packed=(False, True))
    except ValueError as refused:
        return str(refused)
    return "not refused"


def two_rows(topo, model_type: str, **settings) -> dict:
    """A family from its default config shrunk, float32 lifted, on a batch of two rows of unequal lengths (the shorter
    padded by the batch, then both by `shard_batch`): SP's loss and every gradient against one process running each row
    alone at its own length."""
    import torch.nn.functional as F
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ulysses_sp.models import verify
    from ulysses_sp.models.shrink import shrink_config

    with fp64_throughout():
        config = shrink_config(CONFIG_MAPPING[model_type](**settings))
        ref = verify._build(config, topo.device, 0)
        lengths = (5 * topo.sp_size + 3, 9 * topo.sp_size + 2)
        ids = torch.randint(0, config.vocab_size, (2, max(lengths)), generator=torch.Generator().manual_seed(1))
        labels = ids.clone()
        labels[0, lengths[0]:] = -100

        def one_process():
            total = sum(F.cross_entropy(ref(input_ids=ids[r:r + 1, :n]).logits[0, :-1], ids[r, 1:n], reduction="sum") for r, n in enumerate(lengths))
            return total / sum(n - 1 for n in lengths)

        loss_error, errors, _, mixers = verify._one_run(ref, topo, {"input_ids": ids, "labels": labels}, verify._grads(ref, one_process()),
                                                        "auto", "auto", "auto")
    return {"loss_error": loss_error, "worst": max(errors.values()), "params": len(errors), "mixers": sorted(set(mixers.values()))}


def compressed_calls_alike(topo) -> dict:
    """DeepSeek-V4 (one layer of each kind) on a row of 10 tokens a rank, one query an indexer call: at P=3 (zigzag chunks
    of 5, 12 rows with their halos, rank 0's first chunk 5) rank 0 compresses no heavily compressed window. The parameters
    left without a gradient on this rank, how many windows each rank makes, and how many calls its indexer took (ZeRO-3
    gathers a module's weights at each call: a collective)."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as dsv4

    from ulysses_sp.mixers import compressed
    from ulysses_sp.models.shrink import shrink_config

    config = shrink_config(CONFIG_MAPPING["deepseek_v4"](**COMPRESSED["deepseek_v4-kinds"]))
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation="eager").double()
    usp.apply_sequence_parallel(model, topo)
    ids = torch.randint(0, config.vocab_size, (1, 10 * topo.sp_size), generator=torch.Generator().manual_seed(0))
    local = usp.shard_batch({"input_ids": ids, "labels": ids}, topo)
    calls, own, saved = [], dsv4.DeepseekV4Indexer.forward, compressed.INDEX_CHUNK_ELEMENTS
    dsv4.DeepseekV4Indexer.forward = lambda self, *args, **kwargs: calls.append(1) or own(self, *args, **kwargs)
    compressed.INDEX_CHUNK_ELEMENTS = 1
    try:
        usp.sp_cross_entropy(model(**usp.model_inputs(local)).logits, local["shift_labels"], topo).backward()
    finally:
        dsv4.DeepseekV4Indexer.forward, compressed.INDEX_CHUNK_ELEMENTS = own, saved
    heavy = next(m for m in model.modules() if getattr(m, "layer_type", None) == "heavily_compressed_attention")
    return {"without": sorted(n for n, p in model.named_parameters() if p.grad is None), "calls": len(calls),
            "owned": [len(w) for w in compressed.CompressedAttention(topo).owned(heavy, 10)]}


def halo_calls_alike(topo) -> dict:
    """LFM2 (its short convolution under halo, a call a document piece of each chunk) on a packed row of 12 tokens a
    rank whose first document ends inside rank 0's first chunk: how many calls its convolution took on this rank (ZeRO-3
    gathers its weights at each call, a collective: a rank calling it less stopped the others)."""
    import transformers
    from transformers.models.lfm2 import modeling_lfm2

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("lfm2")).double()
    usp.apply_sequence_parallel(model, topo)
    n = 12 * topo.sp_size
    ids = torch.randint(0, 64, (1, n), generator=torch.Generator().manual_seed(0))
    local = usp.shard_batch({"input_ids": ids, "labels": ids, "position_ids": torch.cat([torch.arange(3), torch.arange(n - 3)])[None]}, topo)
    calls, own = [], modeling_lfm2.Lfm2ShortConv.forward
    modeling_lfm2.Lfm2ShortConv.forward = lambda self, *args, **kwargs: calls.append(1) or own(self, *args, **kwargs)
    try:
        usp.sp_cross_entropy(model(**usp.model_inputs(local)).logits, local["shift_labels"], topo).backward()
    finally:
        modeling_lfm2.Lfm2ShortConv.forward = own
    return {"calls": len(calls), "mixers": sorted(set(usp.models.token_mixers.mixer_layers(model).values()))}


def compressed_bytes(topo) -> dict:
    """What DeepSeek-V4's layers (one of each kind) send, by collective, in a forward and a backward after a warm-up, under the
    contiguous layout (16 tokens a rank: the windows of 4 and 8 never cross a rank), with the dimensions to count them by."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from ulysses_sp.models.shrink import shrink_config

    config = shrink_config(CONFIG_MAPPING["deepseek_v4"](**COMPRESSED["deepseek_v4-kinds"]))
    model, inputs, logits, fwd, bwd = _counted_step(topo, config)
    cos, _ = model.model.rotary_emb(logits, inputs["position_ids"], layer_type="main")
    return {"fwd": {op: b.sent for op, b in fwd.by_op.items()}, "bwd": {op: b.sent for op, b in bwd.by_op.items()}, "rows": 2, "local": 16,
            "hidden": config.hidden_size, "head_dim": config.head_dim, "index": config.index_head_dim, "rope": 2 * cos.shape[-1],
            "rates": config.compress_rates, "window": config.sliding_window, "types": list(config.layer_types), "rank": topo.sp_rank}


def shrunk_default(topo, name: str, backend: str = "auto", **overrides) -> dict:
    """A family from its default config shrunk by verify, float32 lifted (Granite SWA's eager code
    forces its sink scaling and softmax to float32, Gemma's norms compute in it), so the comparison
    is at fp64's rounding."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    with fp64_throughout():
        report = usp.verify_sequence_parallel(CONFIG_MAPPING[name](**overrides), topo, backend=backend, raise_on_mismatch=False)
    return _summary(report)


LLAMA4_PLANTS = ("temperature-from-local-index", "chunks-dropped")
"""Defects the Llama 4 cases must see: the NoPE layers' temperature from each rank's own token index
(transformers' code left on), and the chunked layers run as full causal attention."""


def llama4_case(topo, backend: str, plant: str | None = None) -> dict:
    """Llama 4's chunked and temperature-tuned NoPE layers (tests/model_families.py's config, 12 heads),
    float32 lifted, under ``backend``; ``plant``: one of `LLAMA4_PLANTS`, patched in for the call."""
    from ulysses_sp.models import llama4

    saved = llama4.scale_queries, llama4.chunked_boundaries, llama4.install
    if plant == "temperature-from-local-index":
        def install(model, layers):
            saved[2](model, layers)
            for m in layers:
                if m.__dict__.pop("_ulysses_sp_temperature", None) is not None:
                    m.attn_temperature_tuning = True

        llama4.install = install
    elif plant == "chunks-dropped":
        llama4.chunked_boundaries = lambda cu, seq_len, chunk: None if cu is None else tuple(cu.tolist())
    try:
        with fp64_throughout():
            report = usp.verify_sequence_parallel(config("llama4_text", num_attention_heads=MLA_HEADS, num_key_value_heads=MLA_HEADS), topo,
                                                  backend=backend, shrink=False, raise_on_mismatch=False)
    finally:
        llama4.scale_queries, llama4.chunked_boundaries, llama4.install = saved
    return _summary(report)


def kernelized(topo) -> dict:
    with fp64_throughout():  # the Gated DeltaNet computes its gates in float32: lifted, so the comparison is exact
        return _kernelized(topo)


def _kernelized(topo) -> dict:
    """A hybrid as from_pretrained loads it, where transformers turns its Hub kernels on by default (the
    ``kernels`` package is its dependency) and re-kernelizes on every train()/eval() switch, dropping each
    kernel-decorated module's instance forward: the mixers' SP forward must survive it. Loss and gradients
    of the Gated DeltaNet model after eval() then train(), against the same model on whole sequences."""
    import transformers

    from .cases import generator, max_err

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("qwen3_5")).to(torch.float64)
    model.set_use_kernels(True)  # what from_pretrained does by default
    ids = torch.randint(0, 64, (2, 24), generator=generator("kernelized"))
    whole = model(input_ids=ids, labels=ids)
    whole.loss.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    usp.apply_sequence_parallel(model, topo)
    model.eval()
    model.train()  # a new kernels mode: kernelize runs again
    local = usp.shard_batch({"input_ids": ids, "labels": ids}, topo)
    logits = model(**usp.model_inputs(local)).logits
    loss = usp.sp_cross_entropy(logits, local["shift_labels"], topo)
    loss.backward()
    names, params = zip(*model.named_parameters())
    grads = dict(zip(names, usp.comm.all_reduce_sums([p.grad for p in params], topo.sp_group)))
    return {"use_kernels": bool(getattr(model, "use_kernels", False)), "loss": abs(loss.item() - whole.loss.item()),
            "grad": max(max_err(grads[n], ref[n]) for n in ref)}


def raised_on(fn) -> str:
    from .cases import raised

    return raised(fn)


def ulysses_all_or_none(topo) -> dict:
    """mixer="ulysses" on a model whose Gated DeltaNet it can split but whose second mixer (a planted
    causal convolution) has no adapter: refused, with no layer left switched."""
    import transformers

    from ulysses_sp.models.token_mixers import mixer_layers

    model = transformers.AutoModelForCausalLM.from_config(config("qwen3_next_12kh"))
    model.model.layers[1].token_mix = _CausalConv(32, 4)
    return {"apply": raised_on(lambda: usp.apply_sequence_parallel(model, topo, mixer="ulysses")),
            "left": len(mixer_layers(model)) + sum("forward" in m.__dict__ for m in model.modules())}


MIXER_LAYERS = {  # family: its first layer's mixer
    "qwen3_next_12kh": lambda model: model.model.layers[0].linear_attn,
    "bamba": lambda model: model.model.layers[0].mamba,
    "bamba_12h": lambda model: model.model.layers[0].mamba,
    "lfm2": lambda model: model.model.layers[0].conv,
    "kimi_linear_12h": lambda model: model.model.layers[0].self_attn,
    "minimax": lambda model: model.model.layers[0].self_attn,
}


def _output(layer, x):
    """The layer's output on ``x``: MiniMax's lightning attention takes its position embeddings and mask
    (unused) and returns its final state beside."""
    if type(layer).__name__ == "MiniMaxLightningAttention":
        return layer(x, None, None)[0]
    return layer(x)


def _by_hand(layer, strategy: str, topo, b: int, local: int, itemsize: int) -> tuple[tuple[int, int], float | None]:
    """What one rank sends forward and backward, and its share of the compute (halo: None), from the layer's dimensions."""
    p, r = topo.sp_size, topo.sp_rank
    if strategy == "state":  # every fragment's convolution tail and summary [B | A], all-gathered; their gradients reduce-scattered
        fragments = len(usp.layout.chunk_table(topo.layout, p, local * p)[0])
        conv = getattr(layer, "conv1d", None)  # MiniMax's lightning attention has none
        tail = 0 if conv is None else min(local // fragments, conv.kernel_size[0] - 1) * conv.in_channels
        if hasattr(layer, "num_v_heads"):  # Gated DeltaNet: [dk, dv + dk] per value head
            summary = layer.num_v_heads * layer.head_k_dim * (layer.head_v_dim + layer.head_k_dim)
        elif hasattr(layer, "ssm_state_size"):  # Mamba2: [head_dim, state + head_dim] per head
            summary = layer.num_heads * layer.head_dim * (layer.ssm_state_size + layer.head_dim)
        else:  # Kimi Delta Attention and lightning attention: [d, 2d] per head
            summary = getattr(layer, "num_heads", getattr(layer, "num_attention_heads", None)) * layer.head_dim * 2 * layer.head_dim
        return ((p - 1) * fragments * b * (tail + summary) * itemsize,) * 2, (1 + 2 * summary / sum(w.numel() for w in layer.parameters())) / p
    if strategy == "halo":  # the kernel - 1 tokens before each chunk whose predecessor another rank holds; their gradients back
        zigzag = topo.layout == "zigzag"  # rank r holds chunks r and 2P-1-r: successors r+1 (rank r+1) and 2P-r (rank r-1)
        sent, received = (r < p - 1) + (r >= 1 and zigzag), (r >= 1) + (r < p - 1 and zigzag)
        return tuple(n * (layer.conv_kernel_size - 1) * b * layer.conv.in_channels * itemsize for n in (sent, received)), None
    if hasattr(layer, "num_k_heads"):  # Gated DeltaNet: q, k, v and the gates b, a in; the output back
        keys = 2 * layer.key_dim * (1 if layer.num_k_heads % p == 0 else p // layer.num_k_heads)
        per_token = (keys + layer.value_dim + 2 * layer.num_v_heads) * itemsize + layer.value_dim * itemsize
    elif hasattr(layer, "forget_gate"):  # Kimi Delta Attention: q, k, v and the input gate, the decay in float32 (lifted: 8 bytes); the output
        per_token = (3 * layer.qkv_dim + layer.num_heads) * itemsize + layer.qkv_dim * 8 + layer.qkv_dim * itemsize
    else:  # Mamba2: x, B, C (each group replicated to P/groups ranks when fewer than P) and dt in; the scan's output back
        groups = layer.n_groups if layer.n_groups % p == 0 else p
        per_token = (layer.intermediate_size + 2 * groups * layer.ssm_state_size + layer.num_heads) * itemsize + layer.intermediate_size * 8
    return ((p - 1) * b * local * per_token // p,) * 2, 1 / p


def mixer_layer(topo, name: str, strategy: str, per_rank: int = 16, bounds=None) -> dict:
    """One hybrid family's mixer under ``strategy``, called as the model would, packed in three
    documents, against the layer on each document alone in one process (float32 lifted to
    float64): output, input gradient and every parameter's gradient (summed over the SP group);
    the bytes sent against the strategy's estimate and a count by hand from the layer's dimensions."""
    import transformers

    from ulysses_sp.mixers import get_mixer

    from .cases import max_err

    with fp64_throughout():
        torch.manual_seed(0)
        layer = MIXER_LAYERS[name](transformers.AutoModelForCausalLM.from_config(config(name)).double())
        b, s, h = 2, per_rank * topo.sp_size, getattr(layer, "o_proj", getattr(layer, "out_proj", None)).out_features
        x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
        w = torch.randn(b, s, h, dtype=torch.float64)
        bounds = bounds or [0, 5, 5 + s // 2, s]
        ref = torch.cat([_output(layer, x[:, a:e]) for a, e in zip(bounds, bounds[1:])], dim=1)
        (ref * w).sum().backward()
        ref_grads = [x.grad.clone()] + [p.grad.clone() for p in layer.parameters()]
        layer.zero_grad()
        x_local = usp.shard_sequence(x.detach(), topo).requires_grad_()
        mixer = get_mixer(strategy, topo, layer)
        with usp.CommCounter() as fwd:
            out = mixer(layer, layer.forward, (x_local,), {}, b, x_local.shape[1], torch.tensor(bounds, dtype=torch.int32))
            out = out[0] if isinstance(out, tuple) else out
        with usp.CommCounter() as bwd:
            (out * usp.shard_sequence(w, topo)).sum().backward()
        estimate = mixer.estimate(layer, b, x_local.shape[1], h, 8)
    grads = [p.grad for p in layer.parameters()]
    if topo.sp_size > 1:
        grads = usp.comm.all_reduce_sums(grads, topo.sp_group)
    by_hand, share = _by_hand(layer, strategy, topo, b, s // topo.sp_size, 8)
    return {
        "errors": [max_err(out, usp.shard_sequence(ref.detach(), topo)), max_err(x_local.grad, usp.shard_sequence(ref_grads[0], topo))]
                  + [max_err(g, r) / r.abs().max().item() for g, r in zip(grads, ref_grads[1:])],
        "bytes": (fwd.bytes_sent, bwd.bytes_sent),
        "by_hand": by_hand,
        "share": share,
        "estimate": (estimate.comm_bytes, estimate.bwd_comm_bytes, estimate.compute),
        "ops": (sorted(fwd.by_op), sorted(bwd.by_op)),
    }


def state_planted(topo, plant: str) -> dict:
    """The state strategy on Qwen3-Next's layer with one of `STATE_PLANTS` patched into
    ``mixers.state.Fragments`` for the call; a document starts 1 token before a chunk (zigzag, P=2:
    chunks of 8), so the halo reaches across it."""
    from ulysses_sp.mixers.state import Fragments

    saved = Fragments.entry_states, Fragments.document_start
    if plant == "entry-dropped":
        Fragments.entry_states = lambda self, summaries, value_dim: [torch.zeros_like(s[..., :value_dim]) for s in summaries]
    elif plant == "halo-not-reset":
        Fragments.document_start = lambda self, i: 0
    elif plant == "folded-out-of-order":  # the chunk table's order (rank by rank) taken as the row's
        def entry_states(self, summaries, value_dim):
            order = [c for ids in self.table for c in ids]
            return saved[0](dataclasses.replace(self, table=[[order.index(c) for c in ids] for ids in self.table],
                                                mine=tuple(order.index(c) for c in self.mine)), summaries, value_dim)

        Fragments.entry_states = entry_states
    try:
        return mixer_layer(topo, "qwen3_next_12kh", "state", bounds=[0, 7, 20, 32])
    finally:
        Fragments.entry_states, Fragments.document_start = saved


def mixer_low_precision(topo, name: str, strategy: str) -> dict:
    """The mixer in bf16 (float32 inside, as shipped) under ``strategy``, against the same layer in
    float64 (float32 lifted) on the same bf16 inputs: relative RMS of the output and the input gradient."""
    import copy

    import transformers

    from ulysses_sp.mixers import get_mixer

    from .cases import gather_all, rel_rms

    torch.manual_seed(0)
    layer = MIXER_LAYERS[name](transformers.AutoModelForCausalLM.from_config(config(name))).bfloat16()
    exact = copy.deepcopy(layer).double()
    b, s, h = 2, 48, getattr(layer, "o_proj", getattr(layer, "out_proj", None)).out_features
    x = torch.randn(b, s, h).bfloat16().double()
    w = torch.randn(b, s, h).bfloat16().double()
    with fp64_throughout():
        x_ref = x.clone().requires_grad_()
        ref = _output(exact, x_ref)
        (ref * w).sum().backward()
    x_local = usp.shard_sequence(x, topo).bfloat16().requires_grad_()
    out = get_mixer(strategy, topo, layer)(layer, layer.forward, (x_local,), {}, b, x_local.shape[1], None)
    out = out[0] if isinstance(out, tuple) else out
    (out * usp.shard_sequence(w, topo).bfloat16()).sum().backward()
    out_full, dx_full = gather_all([out, x_local.grad], topo)
    return {"out": rel_rms(out_full.double(), ref), "dx": rel_rms(dx_full.double(), x_ref.grad)}


class _CausalConv(nn.Module):
    """A depthwise causal convolution over [B, S, H]: the smallest token mixer."""

    def __init__(self, hidden: int, kernel: int):
        super().__init__()
        self.conv = nn.Conv1d(hidden, hidden, kernel, groups=hidden, padding=kernel - 1)

    def forward(self, x_bsh):
        return self.conv(x_bsh.transpose(1, 2))[..., :x_bsh.shape[1]].transpose(1, 2)


def mixer_allgather(topo, packed: bool) -> dict:
    """The allgather strategy on a causal convolution against one process (documents one by one
    when packed), forward and backward in fp64, and its bytes against (P-1) x the local input."""
    from ulysses_sp.mixers import get_mixer

    from .cases import max_err

    torch.manual_seed(0)
    b, s, h = 2, 8 * topo.sp_size, 6
    conv = _CausalConv(h, 4).double()
    x = torch.randn(b, s, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(b, s, h, dtype=torch.float64)
    cu = torch.tensor([0, 3, 3 + s // 2, s], dtype=torch.int32) if packed else None
    bounds = cu.tolist() if packed else [0, s]
    ref = torch.cat([conv(x[:, a:e]) for a, e in zip(bounds, bounds[1:])], dim=1)
    (ref * w).sum().backward()
    ref_dx, ref_dw = x.grad.clone(), conv.conv.weight.grad.clone()
    conv.zero_grad()
    x_local = usp.shard_sequence(x.detach(), topo).requires_grad_()
    mixer = get_mixer("auto", topo)
    with usp.CommCounter() as fwd:
        out = mixer(conv, conv.forward, (x_local,), {}, b, x_local.shape[1], cu)
    with usp.CommCounter() as bwd:
        (out * usp.shard_sequence(w, topo)).sum().backward()
    dw = conv.conv.weight.grad.clone()
    if topo.sp_size > 1:
        dist.all_reduce(dw, group=topo.sp_group)
    return {
        "errors": [max_err(out, usp.shard_sequence(ref.detach(), topo)), max_err(x_local.grad, usp.shard_sequence(ref_dx, topo)), max_err(dw, ref_dw)],
        "bytes": (fwd.bytes_sent, bwd.bytes_sent),
        "by_op": (sorted(fwd.by_op), sorted(bwd.by_op)),
        "analytic": (lambda e: (e.comm_bytes, e.bwd_comm_bytes))(mixer.estimate(conv, b, x_local.shape[1], h, 8)),
        "by_hand": ((topo.sp_size - 1) * b * (s // topo.sp_size) * h * 8,) * 2,
    }


def refused(topo) -> dict:
    """apply_sequence_parallel on each family it must refuse: the error, on every rank."""
    import transformers

    from .cases import raised

    out = {}
    for name in REFUSED:
        model = transformers.AutoModelForCausalLM.from_config(config(name))
        out[name] = raised(lambda m=model: usp.apply_sequence_parallel(m, topo, backend="ring"))
    for name in REFUSED_WITHOUT_MIXER:
        model = transformers.AutoModelForCausalLM.from_config(config(name))
        out[name] = raised(lambda m=model: usp.apply_sequence_parallel(m, topo, backend="ring", mixer="none"))
    for name in REFUSED_AT_FORWARD:
        out[name] = raised(lambda n=name: usp.verify_sequence_parallel(config(n), topo, shrink=False))
    return out


class _OwnAttention(nn.Module):
    """An attention layer that does its own softmax attention (no attention interface), in place
    of a Llama layer's self_attn: the structural check must refuse it."""

    def __init__(self, llama_attention):
        super().__init__()
        self.layer_idx, self.head_dim = llama_attention.layer_idx, llama_attention.head_dim
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (getattr(llama_attention, f"{x}_proj") for x in "qkvo")

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in (self.q_proj, self.k_proj, self.v_proj))
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


class _ConvAttention(_OwnAttention):
    """GQA attention (4 q, 2 kv heads) with a short convolution over its keys, as ZAYA's, so a mixer
    strategy runs it on the whole sequence; with ``bias``, it passes an additive position bias to the
    attention function, as Inkling's does."""

    def __init__(self, llama_attention, bias: bool):
        super().__init__(llama_attention)
        self.k_conv = nn.Conv1d(16, 16, kernel_size=3, groups=16, padding=2)
        self.config, self.bias, self.is_causal = llama_attention.config, bias, True
        self.num_key_value_groups = llama_attention.num_key_value_groups  # what the one-process sdpa repeats k, v by

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, **kwargs):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        k = self.k_conv(self.k_proj(hidden_states).transpose(1, 2))[..., :hidden_states.shape[1]].transpose(1, 2)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (self.q_proj(hidden_states), k, self.v_proj(hidden_states)))
        bias = torch.zeros(1, 1, q.shape[2], k.shape[2]) if self.bias else None
        out, _ = ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation](self, q, k, v, None, position_bias=bias)
        return self.o_proj(out.reshape(*hidden_states.shape[:-1], -1)), None


class _SoftmaxCore(_OwnAttention):
    """Own-code softmax attention under a name that does not say attention."""


class _HybridAttentionLayer(nn.Module):
    """A decoder layer named for attention that holds a short convolution (a mixer strategy takes it)
    beside own-code softmax attention in a child not named for attention: the check must look
    inside the layer rather than take its attention for the mixer's."""

    def __init__(self, llama_layer):
        super().__init__()
        self.token_conv = _CausalConv(32, 4)
        self.core = _SoftmaxCore(llama_layer.self_attn)

    def forward(self, hidden_states, position_embeddings=None, **kwargs):
        hidden_states = hidden_states + self.token_conv(hidden_states)
        return hidden_states + self.core(hidden_states, position_embeddings)[0]


def conv_attention(topo) -> dict:
    """A Llama whose layer 1 attention holds a convolution (the allgather mixer runs it whole, its
    attention call plain causal GQA attention over the gathered sequence): exact against one process."""
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config("llama", num_hidden_layers=3), attn_implementation="sdpa")
    model.model.layers[1].self_attn = _ConvAttention(model.model.layers[1].self_attn, bias=False)
    report = usp.verify_sequence_parallel(model, topo, shrink=False, raise_on_mismatch=False)
    return dict(_summary(report), mixers=report.mixers)


def planted(topo) -> dict:
    """Deliberately uncovered layers in a Llama: the error on every rank, with class and layer named."""
    import transformers

    from .cases import raised

    def llama():
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config("llama", num_hidden_layers=3), attn_implementation="sdpa")

    data = usp.shard_batch({"input_ids": torch.arange(24).remainder(64)[None]}, topo)
    out = {}
    model = llama()  # layer 1's attention computes its own attention
    model.model.layers[1].self_attn = _OwnAttention(model.model.layers[1].self_attn)
    out["own attention"] = raised(lambda: usp.apply_sequence_parallel(model, topo, backend="ring"))
    model = llama()  # layer 2 gets a short causal convolution over the sequence
    model.model.layers[2].token_shift = nn.Conv1d(32, 32, kernel_size=4, groups=32, padding=3)
    out["short convolution"] = raised(lambda: usp.apply_sequence_parallel(model, topo, backend="ring"))
    model = llama()  # layer 1: an attention-named decoder layer holding a mixer beside own-code attention
    model.model.layers[1] = _HybridAttentionLayer(model.model.layers[1])
    out["attention layer holding a mixer"] = raised(lambda: usp.apply_sequence_parallel(model, topo, backend="ring"))
    model = llama()  # the config says layer 1 is not attention, whatever its modules look like
    model.config.layer_types = ["full_attention", "mamba", "full_attention"]
    out["layer type"] = raised(lambda: usp.apply_sequence_parallel(model, topo, backend="ring"))
    model = llama()  # layer 1's attention holds a convolution (the mixer runs it whole) and passes a position bias
    model.model.layers[1].self_attn = _ConvAttention(model.model.layers[1].self_attn, bias=True)
    usp.apply_sequence_parallel(model, topo, backend="ring")
    out["mixer attention with a bias"] = raised(lambda: model(**usp.model_inputs(data)))
    model = llama()  # layer 1 routed, but to another attention implementation: only the forward can tell
    usp.apply_sequence_parallel(model, topo, backend="ring")
    layer_config = model.model.layers[1].self_attn.config = type(model.config).from_dict(model.config.to_dict())
    layer_config._attn_implementation = "sdpa"
    out["other implementation"] = raised(lambda: model(**usp.model_inputs(data)))
    torch._dynamo.reset()
    from ulysses_sp.tiling import compile_layers

    compile_layers(model, fullgraph=True, backend="aot_eager")  # the same check, made when the layer is compiled
    out["other implementation, compiled"] = raised(lambda: model(**usp.model_inputs(data)), errors=(Exception,))
    out["no position_ids"] = raised(lambda: model(input_ids=data["input_ids"]))
    usp.remove_sequence_parallel(model)
    out["hooks after remove"] = len(model._forward_pre_hooks) + sum(len(m._forward_hooks) for m in model.modules())
    return out


class _OwnShardOnly:
    """A planted bug: each rank attends to its own shard only, as an uncovered layer would."""

    name = "own-shard-only"

    def check(self, spec, topo):
        return None

    def estimate(self, spec, topo, profile):  # never auto's choice: registered backends are its candidates
        return dataclasses.replace(usp.get_backend("ring").estimate(spec, topo, profile), seconds=float("inf"))

    def forward(self, q, k, v, spec, topo):
        return kernels.attend(q, k, v, kernel=spec.kernel, causal=spec.causal, scale=spec.softmax_scale)


usp.register_backend(_OwnShardOnly())


class _OwnShardMixer:
    """A planted mixer strategy that runs the mixer on this rank's shard only."""

    name = "own-shard-only"

    def __init__(self, topo):
        pass

    def __call__(self, module, forward, args, kwargs, batch, seq_local, cu_seqlens):
        return forward(*args, **kwargs)


MIXERS["own-shard-only"] = _OwnShardMixer


def packed_dropped(topo) -> dict:
    """StableLM's attention does not forward cu_seq_lens_q: packed input must be refused, unpacked stay exact."""
    import transformers

    from .cases import raised

    config = transformers.StableLmConfig()
    return {"packed": raised(lambda: usp.verify_sequence_parallel(config, topo)),
            "unpacked": _summary(usp.verify_sequence_parallel(config, topo, packed=(False,)))}


def verify_random(topo) -> dict:
    """verify_sequence_parallel on a built model with dropout 0.1: its copy runs without randomness
    (one process and SP draw different dropout masks), the user's model keeps its dropout."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(config("bert-decoder"))
    report = usp.verify_sequence_parallel(model, topo, shrink=False, raise_on_mismatch=False)
    return {"report": _summary(report), "kept": sorted({m.p for m in model.modules() if isinstance(m, nn.Dropout)})}


def verify_references(topo) -> dict:
    """verify_sequence_parallel with ``references``: a second backend on the same model reuses the
    one-process runs (the one-process loss made to raise shows none ran) and reports what a fresh
    call reports; another seed, or a rank that lost them (all run them then, no hang), does not; a
    backend that sees only its shard is still caught."""
    from ulysses_sp.models import verify

    from .cases import raised

    llama, refs = config("llama"), {}

    def check(**options):
        return usp.verify_sequence_parallel(llama, topo, shrink=False, raise_on_mismatch=False, **options)

    def failing(ref, data, device):
        raise ValueError("planted: the one-process run ran")

    check(backend="ulysses", references=refs)
    kept, verify._one_process_loss = verify._one_process_loss, failing
    try:
        reused = check(backend="ring", references=refs)
    finally:
        verify._one_process_loss = kept
    out = {"reused": (reused.grad_errors, reused.rounding_noise) == ((fresh := check(backend="ring")).grad_errors, fresh.rounding_noise),
           "after one call on another backend": len(refs)}
    check(seed=1, references=refs)
    out["after another seed"] = len(refs)
    if topo.sp_rank == 0:
        refs.clear()
    out["one rank lost them"] = check(backend="ring", references=refs).grad_errors == fresh.grad_errors
    out["planted"] = raised(lambda: usp.verify_sequence_parallel(llama, topo, shrink=False, backend="own-shard-only", references=refs),
                            errors=(AssertionError,))
    return out


def verify_planted(topo) -> dict:
    """verify_sequence_parallel on a big Llama config (shrunk) with the planted backend: raises, naming attention parameters."""
    import transformers

    from .cases import raised

    big = transformers.LlamaConfig(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                                   num_key_value_heads=8, vocab_size=128256)
    from ulysses_sp.models import verify

    def failing(ref, data, device):  # one reference run fails, on the one rank that runs it
        raise ValueError("planted")

    kept, verify._one_process_loss = verify._one_process_loss, failing
    try:
        reference_failed = raised(lambda: usp.verify_sequence_parallel(big, topo), errors=(RuntimeError,))
    finally:
        verify._one_process_loss = kept
    return {
        "reference failed": reference_failed,
        "planted": raised(lambda: usp.verify_sequence_parallel(big, topo, backend="own-shard-only"), errors=(AssertionError,)),
        "planted mixer": raised(lambda: usp.verify_sequence_parallel(config("lfm2"), topo, shrink=False, mixer="own-shard-only"),
                                errors=(AssertionError,)),
        "exact": _summary(usp.verify_sequence_parallel(big, topo)),
    }


def mla_attention(topo, backend: str, packed: bool) -> dict:
    """SequenceParallelAttention with value head dim 6 and query/key head dim 12 against fp64
    attention on the whole sequence: out, dq, dk, dv; and the bytes it sent, against the same call
    with V zero-padded to 12 by hand."""
    from .cases import gather_all, generator, max_err

    b, s, h, d_qk, d_v = 2, 48, MLA_HEADS, 12, 6
    gen = generator(f"mla/{backend}")
    full = [torch.randn(b, s, h, d, generator=gen, dtype=torch.float64) for d in (d_qk, d_qk, d_v)]
    cu = [0, 7, 9, 30, 48] if packed else None
    shards = [usp.shard_sequence(t, topo).requires_grad_() for t in full]
    attn = usp.SequenceParallelAttention(topo, backend=backend)
    if attn(*shards, cu_seqlens=cu).shape[-1] != d_v:
        raise AssertionError("output head dim is not the value head dim")
    with usp.CommCounter() as counted:
        out = attn(*shards, cu_seqlens=cu)
        out.backward(usp.shard_sequence(torch.ones(b, s, h, d_v, dtype=torch.float64), topo))
    padded = [shards[0].detach(), shards[1].detach(), nn.functional.pad(shards[2].detach(), (0, d_qk - d_v))]
    attn(*padded, cu_seqlens=cu)
    with usp.CommCounter() as by_hand:
        attn(*[t.requires_grad_() for t in padded], cu_seqlens=cu).sum().backward()
    ref_in = [t.clone().requires_grad_() for t in full]
    ref = reference_attention(*ref_in, cu_seqlens=cu)
    ref.sum().backward()
    got = gather_all([out, *(x.grad for x in shards)], topo)
    return {
        "errors": [max_err(g, r) for g, r in zip(got, (ref.detach(), *(x.grad for x in ref_in)))],
        "bytes": (counted.bytes_sent, counted.bytes_recv),
        "bytes_padded_by_hand": (by_hand.bytes_sent, by_hand.bytes_recv),
        "chosen": sorted(x.name for x in attn._chosen.values()),
    }


def mla_errors(topo) -> dict:
    from .cases import raised

    t = lambda d, h=4: torch.randn(1, 4, h, d, dtype=torch.float64)  # noqa: E731
    return {"heads differ": raised(lambda: usp.sp_attention(t(8), t(8), t(6, h=2), topo, backend="ring"))}


def register(case, topo_for, hf: bool) -> None:
    for packed in (False, True):
        case(f"mixers/allgather/{'packed' if packed else 'unpacked'}", (1, 2, 3, 4))(
            lambda env, p=packed: mixer_allgather(topo_for(env), p))
    """The cases, on the worlds each needs; the model cases only with transformers installed."""
    for backend in MLA_BACKENDS:
        for packed in (False, True):
            case(f"mla/{backend}/{'packed' if packed else 'unpacked'}", (1, 2, 3, 4))(
                lambda env, be=backend, p=packed: mla_attention(topo_for(env), be, p))
    case("mla/errors", (2,))(lambda env: mla_errors(topo_for(env)))
    if not hf:
        return
    for name in EXACT:
        case(f"families/{name}", (2, 3))(lambda env, n=name: family(topo_for(env), n))
        case(f"families-contiguous/{name}", (2, 3))(lambda env, n=name: family(topo_for(env, "contiguous"), n))
    for backend in MLA_BACKENDS:
        case(f"families/deepseek_v3/{backend}", (2, 3, 4))(
            lambda env, be=backend: family(topo_for(env), "deepseek_v3", be, num_attention_heads=MLA_HEADS, num_key_value_heads=MLA_HEADS))
    case("families/refused", (2, 3))(lambda env: refused(topo_for(env)))
    for name in BALANCED_FAMILIES:  # the balanced layout: attention backends and mixer strategies from the batch's documents
        case(f"families-balanced/{name}", (2, 3, 4))(lambda env, n=name: family(topo_for(env, "balanced"), n, lift=n not in EXACT))
    for name in HYBRID:
        case(f"hybrids/{name}", (2, 3, 4))(lambda env, n=name: family(topo_for(env), n, lift=True))
        case(f"hybrids-contiguous/{name}", (2, 3, 4))(lambda env, n=name: family(topo_for(env, "contiguous"), n, lift=True))
        case(f"hybrids-shipped/{name}", (2,))(lambda env, n=name: family(topo_for(env), n))
    for lay in ("zigzag", "contiguous"):
        for strategy, name, worlds in STRATEGY_FAMILIES:
            case(f"hybrids-{strategy}/{lay}/{name}", worlds)(
                lambda env, lay=lay, s=strategy, n=name: family(topo_for(env, lay), n, lift=True, mixer=s))
        for strategy, name, worlds in MIXER_LAYER_CASES:
            case(f"mixers/{strategy}/{lay}/{name}", worlds)(lambda env, lay=lay, s=strategy, n=name: mixer_layer(topo_for(env, lay), n, s))
    for strategy, name, _ in MIXER_LAYER_CASES:
        case(f"mixers-bf16/{strategy}/{name}", (1, 2, 4))(lambda env, s=strategy, n=name: mixer_low_precision(topo_for(env), n, s))
    for name in MAMBA2_ADAPTED:
        case(f"hybrids-adapted/{name}", (2, 4))(lambda env, n=name: adapted_default(topo_for(env), n))
        case(f"hybrids-adapted-state/{name}", (2, 3, 4))(lambda env, n=name: adapted_default(topo_for(env), n, "state"))
    for name, worlds in SINK_DEFAULTS.items():
        case(f"sinks/{name}", worlds)(lambda env, n=name: shrunk_default(topo_for(env), n))
    for name, (model_type, settings, worlds) in SHRUNK_DEFAULTS.items():
        window = {"sliding_window": 8} if model_type.startswith("gemma") else {}
        case(f"defaults/{name}", worlds)(lambda env, t=model_type, s={**window, **settings}: shrunk_default(topo_for(env), t, **s))
    for name in INDEXED:
        case(f"indexed/{name}", (2, 3, 4))(lambda env, n=name: indexed_default(topo_for(env), n))
    case("indexed-planted/local-keys", (2,))(lambda env: indexed_planted(topo_for(env)))
    case("indexed-bytes", (2, 4))(lambda env: indexed_bytes(topo_for(env)))
    case("indexed-chunks/hy_v4", (2, 3))(lambda env: indexed_in_chunks(topo_for(env), "hy_v4"))
    for name in COMPRESSED:
        case(f"compressed/{name}", (2, 3, 4))(lambda env, n=name: compressed_default(topo_for(env), n))
    for lay in ("contiguous", "balanced"):
        case(f"compressed-{lay}/deepseek_v4-kinds", (3,))(lambda env, lay=lay: compressed_default(topo_for(env, lay), "deepseek_v4-kinds"))
    case("compressed-chunks/deepseek_v4-kinds", (2, 3))(lambda env: compressed_in_chunks(topo_for(env)))
    case("compressed-planted/no-overlap", (2,))(lambda env: compressed_planted(topo_for(env)))
    case("compressed-packed", (2,))(lambda env: compressed_packed(topo_for(env)))
    case("compressed-bytes", (2, 4))(lambda env: compressed_bytes(topo_for(env, "contiguous")))
    case("halo-calls-alike", (2,))(lambda env: halo_calls_alike(topo_for(env)))
    case("compressed-alike", (3,))(lambda env: compressed_calls_alike(topo_for(env)))
    case("compressed-rows/deepseek_v4-kinds", (2, 3))(lambda env: two_rows(topo_for(env), "deepseek_v4", **COMPRESSED["deepseek_v4-kinds"]))
    case("indexed-rows/deepseek_v32", (2,))(lambda env: two_rows(topo_for(env), "deepseek_v32"))
    for lay in ("contiguous", "balanced"):
        case(f"indexed-{lay}/hy_v4", (3,))(lambda env, lay=lay: indexed_default(topo_for(env, lay), "hy_v4"))
    for lay in ("contiguous", "balanced"):  # Gemma 4's shared layers and per-layer inputs in the other placements, at P=3
        case(f"defaults-{lay}/gemma4_text-shared-moe", (3,))(lambda env, lay=lay: shrunk_default(
            topo_for(env, lay), "gemma4_text", sliding_window=8, **SHRUNK_DEFAULTS["gemma4_text-shared-moe"][1]))
    for backend in MLA_BACKENDS:  # Granite SWA under each backend: 12 heads, so every backend applies at P = 2, 3, 4
        case(f"sinks/granite_swa/{backend}", (2, 3, 4))(lambda env, be=backend: shrunk_default(
            topo_for(env), "granite_swa", be, num_attention_heads=MLA_HEADS, num_key_value_heads=MLA_HEADS, hidden_size=96))
    for plant in STATE_PLANTS:
        case(f"mixers-state-planted/{plant}", (2,))(lambda env, p=plant: state_planted(topo_for(env), p))
    for lay in ("zigzag", "contiguous"):
        for name in ("qwen3_next_12kh", "bamba_12h"):  # documents of 1 and 2 tokens (shorter than the halo of 3), one ending on a chunk
            # boundary; and chunks of 1 token (zigzag, 2 a rank), so a halo spans several chunks and ranks
            case(f"mixers-state-edges/{lay}/{name}", (2, 4))(lambda env, lay=lay, n=name: [
                mixer_layer(topo_for(env, lay), n, "state", bounds=[0, 2, 3, 16, 17, 19, 16 * env.world])["errors"],
                mixer_layer(topo_for(env, lay), n, "state", per_rank=2, bounds=[0, 3, 2 * env.world])["errors"]])
    case("mixers-state-bytes", (2,))(lambda env: [mixer_layer(topo_for(env), "qwen3_next_12kh", "state", per_rank=n)["bytes"] for n in (64, 256)])
    for name in STATE_BALANCED:
        case(f"hybrids-state/balanced/{name}", (2, 3, 4))(lambda env, n=name: family(topo_for(env, "balanced"), n, lift=True, mixer="state"))
    for backend in MLA_BACKENDS:  # Llama 4 text under each backend (auto: families/llama4_text)
        case(f"llama4/{backend}", (2, 3, 4))(lambda env, be=backend: llama4_case(topo_for(env), be))
    case("llama4/auto", (4,))(lambda env: llama4_case(topo_for(env), "auto"))  # P = 2, 3: families/llama4_text
    case("sinks/gpt_oss/auto", (4,))(lambda env: family(topo_for(env), "gpt_oss", "auto", num_attention_heads=MLA_HEADS,
                                                        num_key_value_heads=MLA_HEADS))  # P = 2, 3: families/gpt_oss
    for plant in LLAMA4_PLANTS:
        case(f"llama4-planted/{plant}", (2, 4))(lambda env, p=plant: llama4_case(topo_for(env), "ring", p))
    for backend in MLA_BACKENDS:  # GPT-OSS under each backend, P = 2, 3, 4 (auto: families/gpt_oss)
        case(f"sinks/gpt_oss/{backend}", (2, 3, 4))(lambda env, be=backend: family(topo_for(env), "gpt_oss", be, num_attention_heads=MLA_HEADS,
                                                                                  num_key_value_heads=MLA_HEADS))
    case("mixers/ulysses/refused", (3,))(lambda env: {what: raised_on(lambda s=s: family(topo_for(env), "qwen3_next", mixer=s))
                                                      for what, s in (("heads", "ulysses"), ("halo", "halo"))})
    case("mixers/ulysses/refused-groups", (4,))(
        lambda env: raised_on(lambda: family(topo_for(env), "bamba_12h", mixer="ulysses", mamba_n_groups=6)))
    case("mixers/ulysses/all-or-none", (2,))(lambda env: ulysses_all_or_none(topo_for(env)))
    case("mixers/kernelized", (2,))(lambda env: kernelized(topo_for(env)))
    case("coverage/planted", (2, 3))(lambda env: planted(topo_for(env)))
    case("coverage/conv-attention", (2, 3))(lambda env: conv_attention(topo_for(env)))
    case("coverage-contiguous/conv-attention", (2, 3))(lambda env: conv_attention(topo_for(env, "contiguous")))
    case("verify/planted", (2,))(lambda env: verify_planted(topo_for(env)))
    case("verify/random", (2,))(lambda env: verify_random(topo_for(env)))
    case("verify/references", (2,))(lambda env: verify_references(topo_for(env)))
    case("coverage/packed-dropped", (2, 3))(lambda env: packed_dropped(topo_for(env)))
