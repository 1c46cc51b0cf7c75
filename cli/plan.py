"""``sp-bench plan``: which backend ``auto`` would pick for every layer of a model, and why (and, for
a hybrid model's other token mixers, the mixer strategy and what it moves).

Needs no ranks: it builds each layer's `AttnSpec` from a Hugging Face
config (or flags) and asks every backend's ``check()`` and ``estimate()`` on a
planning topology, with a profile (built-in or measured by ``calibrate``).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field

import torch

from ulysses_sp.models.coverage import ATTENTION_LAYER_TYPES, CHANNEL_LAYER_TYPES
from ulysses_sp.models.token_mixers import whole_strategy  # and the mixer classes' adapters, registered
from ulysses_sp.mixers import AUTO_ORDER, BUILT_IN, MIXERS, AutoMixer, get_mixer
from ulysses_sp.mixers.auto import seconds as mixer_seconds
from ulysses_sp.profile import Profile
from ulysses_sp.registry import choose_backend
from ulysses_sp.spec import AttnSpec, Estimate, MixerEstimate
from ulysses_sp.topology import Topology

__all__ = ["LayerShape", "layers_from_config", "plan_rows", "parse_tokens"]


@dataclass(frozen=True)
class LayerShape:
    q_heads: int
    kv_heads: int
    head_dim: int
    window: int | None = None
    """Sliding window (``AttnSpec.window``), None for full causal attention."""
    mixer: str | None = None
    """A hybrid model's other token mixer (its ``layer_types`` entry, e.g. ``linear_attention``),
    None for attention; such a layer runs a mixer strategy, not an attention backend."""
    hidden: int = 0
    """The model's hidden size: what a mixer strategy moves per token."""
    module: object = field(default=None, compare=False)
    """The mixer module transformers builds for the layer (on the meta device), None without transformers."""


def parse_tokens(text: str) -> int:
    """``4096``, ``8k`` (8192) or ``1m`` (1048576)."""
    text = str(text).strip().lower()
    scale = {"k": 1 << 10, "m": 1 << 20}.get(text[-1:], 1)
    try:
        value = int(float(text[:-1] if scale > 1 else text) * scale)
    except ValueError:
        raise ValueError(f"not a token count: {text!r} (examples: 4096, 8k, 1m)") from None
    if value <= 0:
        raise ValueError(f"token count must be positive, got {text!r}")
    return value


def layers_from_config(path: str) -> list[LayerShape]:
    """Per-layer attention shapes from a Hugging Face config.json (lists per layer are honoured),
    with each layer's sliding window: ``sliding_window`` on the layers ``layer_types`` marks
    ``sliding_attention``; without ``layer_types``, all but every ``sliding_window_pattern``-th
    (Gemma 3; Gemma 2 alternates), the layers from ``max_window_layers`` on (Qwen2, only with
    ``use_sliding_window``), else every layer (Mistral)."""
    with open(path) as f:
        config = json.load(f)
    config = config.get("text_config", config)
    n = config["num_hidden_layers"]
    heads = config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or config["hidden_size"] // (heads if isinstance(heads, int) else heads[0])

    def per_layer(value):
        return value if isinstance(value, list) else [value] * n

    kinds = config.get("layer_types") or getattr(_hf_config(config), "layer_types", None) or [None] * n  # Bamba's come from attn_layer_indices
    mixers = [kind if kind is not None and kind not in ATTENTION_LAYER_TYPES | CHANNEL_LAYER_TYPES else None for kind in kinds]
    modules = _mixer_modules(config) if any(mixers) else {}
    return [LayerShape(*shape, mixer=mixer, hidden=config["hidden_size"] if mixer else 0, module=modules.get(i) if mixer else None)
            for i, (shape, mixer) in enumerate(zip(zip(per_layer(heads), per_layer(kv), per_layer(head_dim), _windows(config, n)), mixers))]


def _hf_config(config: dict):
    """The transformers config of ``config``; None where transformers is not installed or does not know the model."""
    try:
        import transformers

        return transformers.AutoConfig.for_model(**config)
    except (ImportError, ValueError, KeyError, TypeError):
        return None


def _mixer_modules(config: dict) -> dict:
    """Layer index -> the token-mixer module transformers builds for the config, on the meta
    device (no memory); {} where transformers cannot build it."""
    hf_config = _hf_config(config)
    if hf_config is None:
        return {}
    import transformers

    from ulysses_sp.models.coverage import find_uncovered

    try:
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(hf_config)
    except (ValueError, KeyError, TypeError):
        return {}
    modules = dict(model.named_modules())
    found = {f.layer: modules[f.path] for f in find_uncovered(model) if f.kind == "mixer" and f.layer is not None and f.path in modules}
    found.update({m.layer_idx: m for m in modules.values() if whole_strategy(m, None)})  # DSA's layers, DeepSeek-V4's
    return found


def _windows(config: dict, n: int) -> list[int | None]:
    window = config.get("sliding_window")
    if not window or config.get("use_sliding_window") is False:
        return [None] * n
    if config.get("layer_types"):
        return [window if kind == "sliding_attention" else None for kind in config["layer_types"]]
    defaults = {"gemma2": 2, "gemma3": 6, "gemma3_text": 6}  # transformers' defaults when the config omits the pattern
    pattern = config.get("sliding_window_pattern") or defaults.get(config.get("model_type"))
    if pattern:
        return [window if (i + 1) % pattern else None for i in range(n)]
    first = config.get("max_window_layers", 0) if "use_sliding_window" in config else 0
    return [window if i >= first else None for i in range(n)]


def plan_rows(layers: list[LayerShape], *, seq_len: int, sp_size: int, ulysses_degree=None, ranks_per_node: int = 0,
              batch: int = 1, dtype=torch.bfloat16, causal: bool = True, layout: str = "zigzag", profile: Profile | None = None,
              cu_seqlens: tuple[int, ...] | None = None):
    """One row per group of consecutive identical layers (shape and window): (first, last, shape,
    chosen name, considered). ``cu_seqlens``: a packed row's document boundaries (None: one document)."""
    topo = Topology.for_planning(sp_size, ulysses_degree=ulysses_degree, ranks_per_node=ranks_per_node, layout=layout, profile=profile)
    multiple = sp_size * (1 if layout == "contiguous" else 2)
    if seq_len % multiple:
        raise ValueError(f"sequence length {seq_len} must be a multiple of {multiple} for {layout} over {sp_size} ranks")
    rows = []
    for index, shape in enumerate(layers):
        if rows and rows[-1][2] == shape:
            rows[-1][1] = index
            continue
        whole = None if shape.module is None else whole_strategy(shape.module, topo)
        if whole is not None:  # its one strategy, whatever the mixer
            rows.append([index, index, shape, whole.name, {whole.name: whole.estimate(shape.module, batch, seq_len // sp_size, shape.hidden, dtype.itemsize)}])
            continue
        if shape.mixer:
            auto = get_mixer("auto", topo, shape.module)
            if isinstance(auto, AutoMixer):
                auto = auto.choose(shape.module, batch, seq_len // sp_size, shape.hidden, dtype, profile)
            rows.append([index, index, shape, auto.name, _mixer_estimates(shape, topo, batch, seq_len, dtype, profile)])
            continue
        spec = AttnSpec(
            batch=batch, seq_len=seq_len, local_seq_len=seq_len // sp_size, q_heads=shape.q_heads, kv_heads=shape.kv_heads,
            head_dim=shape.head_dim, dtype=dtype, causal=causal, softmax_scale=shape.head_dim**-0.5, layout=layout, window=shape.window,
            cu_seqlens=cu_seqlens,
        )
        chosen, considered = choose_backend(spec, topo, profile)
        rows.append([index, index, shape, chosen.name, considered])
    return rows


def _mixer_estimates(shape: LayerShape, topo, batch: int, seq_len: int, dtype, profile) -> dict:
    """Each mixer strategy's `MixerEstimate` for the layer (with its seconds where the layer's module is
    known), or why it cannot run it."""
    out = {}
    for name in BUILT_IN:
        strategy = MIXERS[name](topo)
        if shape.module is None and name != "allgather":
            out[name] = f"needs the mixer's class ({shape.mixer}): install transformers, which builds it from the config"
        elif why := strategy.check(shape.module):
            out[name] = why
        else:
            e = strategy.estimate(shape.module, batch, seq_len // topo.sp_size, shape.hidden, dtype.itemsize)
            timed = shape.module is not None and name in AUTO_ORDER
            out[name] = dataclasses.replace(e, seconds=mixer_seconds(name, e, shape.module, batch, seq_len // topo.sp_size, dtype, topo, profile)
                                            ) if timed else e
    return out


def split_label(name: str, sp_size: int) -> str:
    """``hybrid U=2 x R=4`` for ``hybrid-u2`` on 8 ranks; other names as they are."""
    match = re.fullmatch(r"hybrid-u(\d+)", name)
    return f"hybrid U={match[1]} x R={sp_size // int(match[1])}" if match else name


def render(rows, *, title: str, sp_size: int) -> None:
    """A rich table: per layer group, every backend's estimate or the reason it was dropped;
    a chosen hybrid with its Ulysses x ring split."""
    import sys

    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_lines=True)
    for column in ("layers", "heads q/kv x dim", "chosen", "backend", "est. fwd+bwd", "fwd bytes/rank", "peak memory/rank", "or why not"):
        table.add_column(column)
    for first, last, shape, chosen, considered in rows:
        layers = f"{first}" if first == last else f"{first}-{last}"
        for i, (name, what) in enumerate(considered.items()):
            window = "" if shape.window is None else f", window {shape.window}"
            kind = f"{shape.mixer} (mixer)" if shape.mixer else f"{shape.q_heads}/{shape.kv_heads} x {shape.head_dim}{window}"
            head = (layers, kind, split_label(chosen, sp_size)) if i == 0 else ("", "", "")
            mark = "[bold green]" + name if name == chosen else name
            if isinstance(what, Estimate):
                work = f" (slowest rank x{what.work_imbalance:.2f} work)" if what.work_imbalance > 1.005 else ""
                kernel = f" (kernel at {what.kernel_efficiency:.0%})" if what.kernel_efficiency < 0.995 else ""
                why = "" if name == chosen else _slower(what, considered[chosen], chosen)
                table.add_row(*head, mark, f"{what.seconds * 1e3:.2f} ms{work}{kernel}", _size(what.comm_bytes), _size(what.peak_bytes), why)
            elif isinstance(what, MixerEstimate):
                timed = "" if what.seconds is None else f"{what.seconds * 1e3:.2f} ms: "
                best = considered.get(chosen)
                why = (f"+{what.seconds / best.seconds - 1:.1%} on {chosen}" if name != chosen and what.seconds is not None
                       and isinstance(best, MixerEstimate) and best.seconds else "")
                table.add_row(*head, mark, f"{timed}{what.compute:.3g} x the mixer's compute", _size(what.comm_bytes), "", why)
            else:
                table.add_row(*head, mark, "", "", "", what)
    Console(width=None if sys.stdout.isatty() else 150).print(table)


def _slower(what: Estimate, best, chosen: str) -> str:
    """Why an estimate lost to the chosen backend's: by how much, and the kernel rates where they differ."""
    if not isinstance(best, Estimate):  # a mixer layer's choice
        return ""
    why = f"{what.seconds / best.seconds - 1:+.1%} on {chosen}"
    if abs(what.kernel_efficiency - best.kernel_efficiency) >= 0.005:
        why += f"; kernel at {what.kernel_efficiency:.0%} of its rate against {best.kernel_efficiency:.0%}"
    return why


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
