"""Memory of one training step at real shapes: what a rank's device and a node's host hold.

`estimate` splits one rank's peak device memory into terms:

- **params, grads, optimizer, buffers**: the training engine's model states, from the ZeRO
  paper's accounting (Rajbhandari et al., 2020, with K = 12 bytes of fp32 master weights and Adam
  moments per parameter) for DeepSpeed, and from FSDP2's mixed precision (fp32 shards, the
  training dtype gathered per layer) for ``fsdp2``; ``buffers`` are what the engine gathers or
  reduces at once (DeepSpeed's default bucket sizes). With the optimizer offloaded, ZeRO-2/3 keep
  the gradient partition on the host too (DeepSpeed allocates it there). These are formulas: the
  engines are not run.
- **activations** (kept at the end of the forward) and **transient** (the rest of the step's
  peak): the real model code runs one forward and backward on the meta device, rank 0 of the SP
  group with torch's fake process group, under `PeakMemory`,
  which sees every op's allocation. Checkpoints offloaded to the host (``checkpoint="offload"``)
  leave the device there as they do on CUDA, and come back for the backward.

A model whose decoder layers are all alike runs 1 and 2 layers and is extrapolated linearly to
its depth (one step's memory is periodic in the layers); others run whole. ``grads`` on the
device for engines that keep whole gradients (``none``, ZeRO-0/1) are counted as they
accumulate during the backward, so the peak sees them beside the activations.

The host holds, per node, the offloaded checkpoints of its ranks and, with the optimizer
offloaded, its ranks' fp32 master weights, Adam moments and fp32 gradients (16 bytes a parameter).

    sp-bench plan --max-seq-len --model-config config.json --gpus-per-node 8 --engine zero3
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch

from .testing.memory import PeakMemory, _tensors
from .data import shard_batch, sp_cross_entropy
from .decoder_layers import decoder_layers
from .loss import causal_lm_loss
from .meta_scans import meta_scans
from .profile import NVLINK_PROFILE

__all__ = ["ENGINES", "Breakdown", "Engine", "Switches", "World", "estimate", "max_seq_len", "model_states"]

ENGINES = ("none", "zero0", "zero1", "zero2", "zero3", "fsdp2")
"""The training engines whose model states the memory model knows.

``none``: plain torch (parameters, gradients and AdamW's two moments, all in the training
dtype, whole on every rank); ``zero0``..``zero3``: DeepSpeed in bf16/fp16 with fp32 master
weights; ``fsdp2``: ``fully_shard`` with fp32 shards and the training dtype for compute."""

DS_REDUCE_BUCKET = 500_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000
"""DeepSpeed's defaults for ``reduce_bucket_size`` and ``stage3_max_live_parameters`` (elements)."""


@dataclass(frozen=True)
class World:
    """The machines of a run: GPUs per node, nodes and the SP size.

    Attributes:
        gpus_per_node: ranks (GPUs) per node.
        nodes: number of nodes.
        sp_size: ranks sharing one sequence (None: every rank).

    Raises:
        ValueError: no GPU or node, or an SP size that does not divide the ranks.
    """

    gpus_per_node: int = 8
    nodes: int = 1
    sp_size: int | None = None

    @property
    def ranks(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def sp(self) -> int:
        return self.sp_size or self.ranks

    def __post_init__(self):
        if self.gpus_per_node < 1 or self.nodes < 1:
            raise ValueError(f"a world needs at least one GPU and one node, got {self.gpus_per_node} x {self.nodes}")
        if self.ranks % self.sp:
            raise ValueError(f"sp size {self.sp} must divide the {self.ranks} ranks")


@dataclass(frozen=True)
class Engine:
    """The training engine and its memory options.

    Attributes:
        name: one of ``ENGINES``.
        offload_optimizer: optimizer states (and DeepSpeed's fp32 gradients) in host memory,
            DeepSpeed's ``offload_optimizer`` (ZeRO-1/2/3 only).
        reduce_bucket: DeepSpeed's ``reduce_bucket_size`` (elements; ZeRO-2/3).
        max_live_parameters: DeepSpeed's ``stage3_max_live_parameters`` (elements).

    Raises:
        ValueError: an unknown engine, or optimizer offload on an engine without it.
    """

    name: str = "zero3"
    offload_optimizer: bool = False
    reduce_bucket: int = DS_REDUCE_BUCKET
    max_live_parameters: int = DS_MAX_LIVE_PARAMETERS

    def __post_init__(self):
        if self.name not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.name!r}")
        if self.offload_optimizer and self.name in ("none", "zero0", "fsdp2"):
            raise ValueError(f"optimizer offload is DeepSpeed's ZeRO-1/2/3 option, not {self.name}'s")


@dataclass(frozen=True)
class Switches:
    """The memory switches of the model's step (all on by default).

    Attributes:
        tiled_loss: the LM head and loss over tiles of tokens (``causal_lm_loss``).
        tiled_mlp: the MLP over tiles of tokens.
        checkpoint: ``none``, ``layers`` or ``offload`` (`ulysses_sp.tiling`).
        tiled_norms: the norms over tiles of tokens.
        head_groups: Ulysses over this many head groups (``ulysses-g{G}``); 1: plain Ulysses.
        backend: the SP attention backend.
        mixer: the mixer strategy of a hybrid's other token mixers (`ulysses_sp.mixers`).
    """

    tiled_loss: bool = True
    tiled_mlp: bool = True
    checkpoint: str = "offload"
    tiled_norms: bool = True
    head_groups: int = 1
    backend: str = "ulysses"
    mixer: str = "auto"

    @property
    def backend_name(self) -> str:
        return self.backend if self.head_groups == 1 else f"{self.backend}-g{self.head_groups}"


@dataclass
class Breakdown:
    """One rank's device bytes at the step's peak, by term, and one node's host bytes.

    Attributes:
        seq_len: tokens per sequence.
        params: parameters.
        grads: gradients.
        optimizer: optimizer states on the device.
        buffers: the engine's buffers (buckets, gathered parameters).
        activations: what the step keeps for the backward at its peak.
        transient: the largest op's working memory at the peak.
        host_checkpoints: offloaded checkpoints in host memory (per node).
        host_optimizer: offloaded optimizer states in host memory (per node).
        peak_at: the op at which the peak falls.
    """

    seq_len: int
    params: int
    grads: int
    optimizer: int
    buffers: int
    activations: int
    transient: int
    host_checkpoints: int
    host_optimizer: int
    peak_at: str = ""

    @property
    def peak(self) -> int:
        return self.params + self.grads + self.optimizer + self.buffers + self.activations + self.transient

    @property
    def host(self) -> int:
        return self.host_checkpoints + self.host_optimizer

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "peak": self.peak, "host": self.host}


def _load_config(config):
    import transformers

    if isinstance(config, transformers.PretrainedConfig):
        return copy.deepcopy(config)
    if isinstance(config, str):
        return transformers.AutoConfig.from_pretrained(config)
    return transformers.AutoConfig.for_model(**config)


def _build(config, layers: int | tuple | None, dtype, seq_len: int):
    """The model on the meta device: with ``layers`` of its layers (a count: the first ones; a tuple: of these ``layer_types``)."""
    import transformers

    config = copy.deepcopy(config)
    if isinstance(layers, tuple):
        config.num_hidden_layers, config.layer_types = len(layers), list(layers)
    elif layers is not None:
        config.num_hidden_layers = layers
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
    config.max_position_embeddings = max(getattr(config, "max_position_embeddings", 0) or 0, seq_len)
    config.use_cache = False
    with torch.device("meta"):
        try:
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
        except ValueError:  # eager only (DeepSeek-V4, Hy4)
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    return model.train()


def _uniform(config) -> bool:
    types = getattr(config, "layer_types", None)
    return not types or len(set(types)) == 1


def model_states(config, world: World, engine: Engine, dtype=torch.bfloat16) -> dict:
    """The model's states in memory: per rank on the device, per node in host memory.

    Computed by formula from the parameter count of the full model built on the meta device
    (DeepSpeed and FSDP2 cannot run on meta tensors).

    Args:
        config (PretrainedConfig | str | dict): a transformers config, a config.json path or a dict.
        world: the GPUs, nodes and SP size.
        engine: the engine and its memory options.
        dtype (torch.dtype): the training dtype.

    Returns:
        Bytes by term: ``params``, ``grads``, ``optimizer``, ``buffers`` (per rank),
        ``host_optimizer`` (per node) and ``optimizer_step`` (the optimizer step's working memory).
    """
    config = _load_config(config)
    model = _build(config, None, dtype, 1)
    n = sum(p.numel() for p in model.parameters())
    layers = decoder_layers(model)
    largest = max([sum(p.numel() for p in layer.parameters()) for layer in layers[:1]]
                  + [m.weight.numel() for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None])
    b, w = torch.tensor([], dtype=dtype).element_size(), world.ranks
    host = 0
    step = 0
    if engine.name == "none":
        params, grads, opt, buffers = n * b, n * b, 2 * n * b, 0
        step = _optimizer_step(config, dtype)
    elif engine.name == "fsdp2":  # fp32 shards; the current and the prefetched layer gathered, one layer's fp32 grads reduced
        params, grads, opt = 4 * n // w, 4 * n // w, 8 * n // w
        buffers = 2 * largest * b + 4 * largest
    else:
        stage = int(engine.name[-1])
        k = 12 if b < 4 else 8  # fp32 master weights (in mixed precision) and Adam's two moments
        params = b * n // w if stage == 3 else b * n
        grads = b * n // w if stage >= 2 else b * n
        if engine.offload_optimizer:  # the optimizer's states and an fp32 gradient partition on the host
            opt, host = 0, ((k + 4) * n // w) * world.gpus_per_node
            if stage >= 2:
                grads = 0  # reduced through the bucket straight into the host partition
        else:
            opt = k * n // w if stage >= 1 else k * n
        # DeepSpeed's defaults: a reduce bucket of 5e8 elements (ZeRO-2/3), and under ZeRO-3 the module being
        # computed with the next one prefetched, at most stage3_max_live_parameters = 1e9 of them
        buffers = (min(2 * largest, engine.max_live_parameters) * b if stage == 3 else 0) + (engine.reduce_bucket * b if stage >= 2 else 0)
    return {"params": params, "grads": grads, "optimizer": opt, "buffers": buffers, "host_optimizer": host, "optimizer_step": step,
            "n_params": n, "largest_module_params": largest}


class _HostStore:
    """Stands in for an `OffloadStore` on the meta device as it behaves on
    CUDA: a packed tensor leaves the device (only its shape is kept) and the backward gets a new one."""

    def __init__(self):
        self.live = self.peak = 0

    def pack(self, t):
        nbytes = t.numel() * t.element_size()
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return t.shape, t.dtype, nbytes

    def unpack(self, packed):
        shape, dtype, nbytes = packed
        self.live -= nbytes
        return torch.empty(shape, dtype=dtype, device="meta")


def _meta_key(value):
    """A hashable signature of an op's argument: a tensor's metadata, a value, or a nested one."""
    if isinstance(value, torch.Tensor):
        if value.device.type != "meta":
            raise TypeError("not a meta tensor")
        return (value.shape, value.stride(), value.dtype, value.storage_offset(), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_meta_key(v) for v in value))
    if isinstance(value, dict):
        return tuple((k, _meta_key(v)) for k, v in value.items())
    hash(value)
    return value


@dataclass(frozen=True)
class _Made:
    """A cached op output's shape, stride and dtype."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype


def _same_kind(value, items: list):
    """``items`` in ``value``'s sequence type (list, tuple, namedtuple, torch.return_types)."""
    if type(value) in (list, tuple):
        return type(value)(items)
    return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)


def _recorded(value):
    if isinstance(value, torch.Tensor):
        return _Made(tuple(value.shape), value.stride(), value.dtype)
    if isinstance(value, (list, tuple)):
        return _same_kind(value, [_recorded(v) for v in value])
    return value


def _remade(value):
    if isinstance(value, _Made):
        return torch.empty_strided(value.shape, value.stride, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return _same_kind(value, [_remade(v) for v in value])
    return value


def _cacheable(func) -> bool:
    schema = func._schema
    return not schema.is_mutable and all(r.alias_info is None for r in schema.returns)


class MetaPeakMemory(PeakMemory):
    """`PeakMemory` for meta tensors that runs each functional op
    once per input signature (shapes, strides, dtypes, other arguments) and afterwards makes its
    outputs directly: many of the meta device's kernels are Python references, and a tiled step
    repeats the same ops thousands of times (Llama-8B at 655k tokens a rank: 2.2x faster, the
    same bytes). Ops that mutate or return views always run."""

    def __init__(self, outputs: dict | None = None):
        super().__init__()
        self._outputs = {} if outputs is None else outputs  # shareable between runs of the same shapes
        self._plain: dict = {}

    def _call(self, func, args, kwargs):
        plain = self._plain.get(func)
        if plain is None:
            plain = self._plain[func] = _cacheable(func)
        if not plain:
            return func(*args, **kwargs)
        try:
            key = (func, _meta_key(args), _meta_key(kwargs))
        except TypeError:  # a tensor off the meta device, or an argument without a value to compare
            return func(*args, **kwargs)
        made = self._outputs.get(key)
        if made is None:
            out = func(*args, **kwargs)
            if all(t.device.type == "meta" for t in _tensors(out)):  # a factory op's host tensor (positions, indices) is not remade on meta
                self._outputs[key] = _recorded(out)
            return out
        return _remade(made)


def _step(config, layers: int | tuple | None, seq_len: int, sp: int, switches: Switches, dtype, keep_grads: bool, outputs: dict | None = None) -> dict:
    """Rank 0's bytes during one forward and backward on the meta device: kept at the end of the
    forward, at the peak, the gradients at that peak, and the host's offloaded checkpoints."""
    import transformers.masking_utils

    from .models.switch import apply_sequence_parallel
    from .testing.memory import _topology
    from .tiling import offload_store

    topo = _topology(sp, None)
    topo = dataclasses.replace(topo, profile=topo.profile or NVLINK_PROFILE)  # what auto weighs the mixer strategies with: GPUs'
    model = _build(config, layers, dtype, seq_len)
    apply_sequence_parallel(model, topo, backend=switches.backend_name, tiled_mlp=switches.tiled_mlp, checkpoint=switches.checkpoint,
                            tiled_norms=switches.tiled_norms, mixer=switches.mixer)
    host = _HostStore()
    store = offload_store(model)
    if store is not None:
        store.pack, store.unpack = host.pack, host.unpack
    ids = torch.zeros(1, seq_len, dtype=torch.long)
    local = shard_batch({"input_ids": ids, "labels": ids}, dataclasses.replace(topo, device=torch.device("cpu")))
    batch = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in local.items()}
    grads = {"live": 0}
    at_peak = {"grads": 0}

    class Memory(MetaPeakMemory):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.peak
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if self.peak > before:
                at_peak["grads"] = grads["live"]
            return out

    memory = Memory(outputs)

    held: set[int] = set()

    def drop(p):  # a gradient the engine keeps whole stays counted (once: tiles accumulate into it); a sharded one is reduced and freed
        nbytes = p.grad.numel() * p.grad.element_size()
        p.grad = None
        if keep_grads and id(p) not in held:
            held.add(id(p))
            grads["live"] += nbytes
            memory.live += nbytes
            if memory.live > memory.peak:
                memory.peak, at_peak["grads"] = memory.live, grads["live"]

    hooks = [p.register_post_accumulate_grad_hook(drop) for p in model.parameters() if p.requires_grad]
    # transformers looks for packed documents by reading position ids back (.item()), which
    # meta tensors cannot do; one document per row here
    find = transformers.masking_utils.find_packed_sequence_indices
    transformers.masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        with memory, meta_scans():
            if switches.tiled_loss:
                loss = causal_lm_loss(model, batch, topo)
            else:
                logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
                loss = sp_cross_entropy(logits, batch["shift_labels"], topo)
                del logits
            kept = memory.live
            loss.backward()
    finally:
        transformers.masking_utils.find_packed_sequence_indices = find
        for h in hooks:
            h.remove()
    return {"kept": kept, "peak": memory.peak, "grads": at_peak["grads"], "host": host.peak}


def _step_extrapolated(config, seq_len, sp, switches, dtype, keep_grads) -> dict:
    """The step of a deep model from shallow ones. Every layer alike: one and two layers, each
    extra layer adding what the second did. Kinds of layers (``layer_types``): one layer of each
    (in order of first use, the model's last kind last), then, for each kind used more than once,
    that with one more of the kind placed last and placed before the last; each extra layer of a
    kind adds what its first extra one did, the larger of the two placements (the layers' working
    memories differ, and where the peak falls moves with them)."""
    depth = config.num_hidden_layers
    types = tuple(getattr(config, "layer_types", None) or ())
    kinds = tuple(k for k in dict.fromkeys(types) if k != types[-1]) + types[-1:] if len(types) == depth else ()
    if depth <= 2 or (not kinds and not _uniform(config)) or len(kinds) + 1 >= depth:
        return _step(config, None, seq_len, sp, switches, dtype, keep_grads)
    outputs: dict = {}  # the later runs repeat the first one's ops
    if len(kinds) <= 1:
        one, two = (_step(config, k, seq_len, sp, switches, dtype, keep_grads, outputs) for k in (1, 2))
        return {key: one[key] + (depth - 1) * (two[key] - one[key]) for key in one}
    base = _step(config, kinds, seq_len, sp, switches, dtype, keep_grads, outputs)
    total = dict(base)
    for kind in kinds:
        if (count := types.count(kind)) > 1:
            runs = [_step(config, shape, seq_len, sp, switches, dtype, keep_grads, outputs) for shape in ((*kinds, kind), (*kinds[:-1], kind, kinds[-1]))]
            total = {key: total[key] + (count - 1) * max(run[key] - base[key] for run in runs) for key in total}
    return total


def _optimizer_step(config, dtype) -> int:
    """Bytes AdamW's step (foreach, as on CUDA) allocates beyond its states, on the meta device."""
    params = [p for p in _build(config, None, dtype, 1).parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.empty_like(p)
    optimizer = torch.optim.AdamW(params, foreach=True)
    optimizer.step()  # the states
    with PeakMemory() as memory:
        optimizer.step()
    return memory.peak


def estimate(config, seq_len: int, world: World = World(), engine: Engine = Engine(), switches: Switches = Switches(),
             dtype=torch.bfloat16, states: dict | None = None) -> Breakdown:
    """One training step's memory per rank, one sequence per SP group, at the step's peak.

    The peak falls in the backward or in the optimizer's step. Runs the model's step on the meta
    device, in a process with no process group, or the fake one this module makes (one SP size per
    process).

    Args:
        config (PretrainedConfig | str | dict): a causal LM's transformers config, a config.json path or a dict.
        seq_len: tokens per sequence.
        world: the GPUs, nodes and SP size.
        engine: the engine and its memory options.
        switches: the memory switches.
        dtype (torch.dtype): the training dtype.
        states: `model_states` of the same config, world, engine and dtype, when known.

    Returns:
        The terms at the peak.

    Raises:
        ValueError: the sequence does not split over the SP ranks, or the model cannot run
            under SP (the messages of `ulysses_sp.apply_sequence_parallel`).
    """
    config = _load_config(config)
    if seq_len % (2 * world.sp):
        raise ValueError(f"sequence length {seq_len} must be a multiple of 2 x sp size = {2 * world.sp}")
    states = states or model_states(config, world, engine, dtype)
    keep = engine.name in ("none", "zero0", "zero1")
    step = _step_extrapolated(config, seq_len, world.sp, switches, dtype, keep)
    common = dict(seq_len=seq_len, params=states["params"], optimizer=states["optimizer"], buffers=states["buffers"],
                  host_checkpoints=step["host"] * world.gpus_per_node, host_optimizer=states["host_optimizer"])
    update = states["grads"] + states.get("optimizer_step", 0)
    if keep and update > step["peak"]:  # the optimizer's step, after the backward: whole gradients, no activations
        return Breakdown(**common, grads=states["grads"], activations=0, transient=states.get("optimizer_step", 0), peak_at="optimizer step")
    grads = step["grads"] if keep else states["grads"]
    return Breakdown(**common, grads=grads, activations=step["kept"], transient=step["peak"] - step["kept"] - step["grads"],
                     peak_at="forward and backward")


def max_seq_len(config, device_bytes: int, host_bytes: int | None = None, world: World = World(), engine: Engine = Engine(),
                switches: Switches = Switches(), dtype=torch.bfloat16, resolution: int = 0, limit: int = 1 << 28,
                progress=None, states: dict | None = None) -> tuple[int, Breakdown | None]:
    """The longest sequence whose training step fits the device (and host) memory.

    Memory grows with the length as a convex, piecewise linear function (the largest of the
    step's moments, each linear in the tokens): the search tries 64k and 128k tokens per rank,
    then follows the secant through the last two tries, kept inside the lengths known to
    fit and not to fit; it stops when those are ``resolution`` apart, or when the line predicted the
    last try exactly and puts the limit less than ``resolution`` beyond it.

    Args:
        config (PretrainedConfig | str | dict): a causal LM's transformers config, a config.json path or a dict.
        device_bytes: device memory per rank.
        host_bytes: host memory per node (None: not limited).
        world: the GPUs, nodes and SP size.
        engine: the engine and its memory options.
        switches: the memory switches.
        dtype (torch.dtype): the training dtype.
        resolution: how close to the limit, in tokens (0: 1/128 of the answer).
        limit: the longest sequence tried.
        progress (Callable | None): called as ``progress(seq, breakdown)`` after each try.
        states: `model_states` of the same config, world, engine and dtype, when known.

    Returns:
        The length and its `Breakdown`; 0 and None when not even ``2 x sp`` tokens fit.

    Raises:
        ValueError: the model cannot run under SP (see `estimate`).
    """
    config = _load_config(config)
    states = states or model_states(config, world, engine, dtype)
    unit = 2 * world.sp

    def excess(seq: int) -> tuple[float, Breakdown]:
        b = estimate(config, seq, world, engine, switches, dtype, states)
        if progress:
            progress(seq, b)
        over = b.peak / device_bytes - 1
        if host_bytes is not None:
            over = max(over, b.host / host_bytes - 1)
        return over, b

    def snap(seq: float) -> int:
        return max(unit, int(seq) // unit * unit)

    points: list[tuple[int, float]] = []  # (length, excess), in the order tried
    lo, best, hi, predicted = 0, None, None, None
    seq = snap(min(65536 * world.sp, limit))
    while True:
        over, b = excess(seq)
        points.append((seq, over))
        if over <= 0 and seq > lo:
            lo, best = seq, b
        elif over > 0:
            hi = seq if hi is None else min(hi, seq)
        tol = max(resolution, unit, lo // 128 // unit * unit)
        if (hi is not None and hi - lo <= tol) or lo >= limit:
            return lo, best
        if lo == 0:  # nothing fits yet: halve
            if hi <= unit:
                return 0, None
            seq = snap(hi // 2)
            continue
        if len(points) < 2:
            seq = snap(min(2 * seq, limit))
            continue
        (s1, o1), (s2, o2) = points[-2:]  # the secant through the last two tries
        slope = (o2 - o1) / (s2 - s1) if s2 != s1 else 0.0
        if slope > 0:
            guess = s2 - o2 / slope
        else:
            guess = 2 * lo if hi is None else (lo + hi) / 2
        exact = predicted is not None and abs(predicted - over) < 1e-3
        if exact and over <= 0 and guess - lo < tol:  # the line held here, and says a step longer does not fit
            return lo, best
        guess = max(guess, lo + tol)
        if hi is not None:
            guess = min(guess, hi - tol)
        seq = snap(min(guess, limit))
        predicted = o2 + slope * (seq - s2) if slope > 0 else None
