"""Sequence parallelism inside ``transformers.Trainer``: one argument, ``sp_size``.

``SequenceParallelTrainingArguments`` adds the SP fields to ``TrainingArguments`` (so
``HfArgumentParser`` scripts get ``--sp_size 2 --sp_backend auto``), and
``SequenceParallelTrainer`` runs the usual ``train`` / ``evaluate`` / ``predict`` with
every sequence split over the ranks of an SP group.

What the trainer changes, and why:

- **Topology and model.** ``__init__`` validates the arguments against the world and the
  model's heads (a ``ValueError`` on every rank, before any collective), builds the
  DP x SP topology and calls `ulysses_sp.apply_sequence_parallel`.
- **Sampling.** Every SP rank of a DP group must see the same samples, so the train
  sampler is `ulysses_sp.SequenceParallelSampler`, and the ``BatchSamplerShard``
  that ``accelerator.prepare`` wraps around it (which would re-shard by world rank) is
  made a pass-through. Eval batches are assigned whole to DP groups (global batch ``g``
  to group ``g % dp``), so each batch holds what it holds on one process.
- **Loss.** Each micro-batch is cut with `ulysses_sp.shard_batch` (labels shifted
  before sharding, global position ids, packed ``cu_seqlens`` passed as
  ``cu_seq_lens_q``). ``num_items_in_batch`` is the number of valid targets of the whole
  accumulation window over every DP group, counted here on the shards (each token once:
  transformers' own count would see every sample ``sp_size`` times). A micro-batch's
  loss is its tokens' sum over that count, so the accumulated gradient summed over all
  ranks is the one-process gradient of the window's token-weighted mean.
- **Gradient reduction.** DDP, and accelerate's FSDP2 (``fsdp=True``: ``fully_shard`` over the
  world), average over the world, so the backward loss is multiplied by the world size; DeepSpeed gets `SequenceParallelMPU`
  (injected into ``deepspeed.initialize``) and the loss is multiplied by
  `gradient_scale`; DeepSpeed's division by the
  accumulation steps is turned off (``scale_wrt_gas=False``), since the count already spans them.
- **Eval and predict.** ``eval_loss`` is the mean over every target token of the eval
  set, whatever the batch size or DP x SP split (transformers.Trainer averages batch
  means over samples instead, NaN when a batch holds no target; the two agree when
  every batch holds as many targets). Predictions are gathered into global token order
  (``sp_predict_logits="gather"``), reduced to token ids (``"argmax"``), or refused with
  the memory they would take (``"none"``).
"""

from __future__ import annotations

import contextlib
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, IterableDataset, Sampler
from transformers import Trainer, TrainingArguments
from transformers.trainer_pt_utils import nested_concat
from transformers.trainer_utils import EvalLoopOutput, EvalPrediction, denumpify_detensorize

from .. import comm
from ..data import IGNORE_INDEX, SequenceParallelSampler, gather_sequence, model_inputs, shard_batch, sp_cross_entropy, target_counts
from ..kernels import KERNEL_NAMES
from ..loss import causal_lm_loss
from ..registry import get_backend, list_backends
from ..tiling import CHECKPOINT_MODES
from ..layout import LAYOUTS
from ..topology import init_sequence_parallel
from .deepspeed import SequenceParallelMPU, gradient_scale, use_cpu_accelerator_if_needed
from ..models.image_text import decoder_to_switch
from ..models.switch import _attention_layers, _backend_per_layer, apply_sequence_parallel, remove_sequence_parallel, switched_model
from ..mixers import MIXER_CHOICES
from ..models.coverage import find_uncovered
from ..models.verify import verify_sequence_parallel

__all__ = ["SequenceParallelTrainingArguments", "SequenceParallelTrainer", "PREDICT_LOGITS"]

PREDICT_LOGITS = ("gather", "argmax", "none")
"""What ``sp_predict_logits`` takes: what ``predict`` and ``compute_metrics`` get of the logits."""
_TARGETS = "_usp_targets"
"""Key of a sharded micro-batch holding its number of valid targets over the world."""
_HYBRID_U = re.compile(r"hybrid-u(\d+)$")


@dataclass
class SequenceParallelTrainingArguments(TrainingArguments):
    """``transformers.TrainingArguments`` with the fields of sequence parallelism.

    Every field is also a command-line flag under ``HfArgumentParser`` (``--sp_size 2``). The
    fields are checked here, before anything else starts (`SequenceParallelTrainer` checks them
    against the world and the model).

    Attributes:
        sp_size: Ranks that share one sequence; the rest of the world is data parallel.
        sp_backend: The SP attention backend: ``auto``, a registered name, ``hybrid-u{U}``, or
            comma-separated names, one per attention layer.
        sp_kernel: The local attention kernel: ``auto``, ``flash_attn``, ``torch`` or ``math``.
        sp_mixer: The strategy for hybrid models' other token mixers (Gated DeltaNet, Mamba2,
            short convolutions): ``auto``, ``halo``, ``ulysses``, ``allgather``, ``state`` (Gated DeltaNet, Kimi Delta Attention, Mamba2); ``none`` refuses them.
        sp_layout: The tokens of each sequence across the SP ranks: ``zigzag``, ``contiguous``,
            ``balanced``, or ``auto``: ``balanced`` when the training rows are packed
            (``DataCollatorWithFlattening``, or ``position_ids`` restarting at 0), else ``zigzag``.
        ulysses_degree: The hybrid backend's Ulysses degree (default: ``sp_size``).
        sp_profile: A profile JSON from ``sp-bench calibrate``, for ``auto``.
        tiled_loss: Compute the LM head and the loss over tiles of tokens (`causal_lm_loss`): no
            ``[tokens, vocab]`` logits in training.
        tiled_mlp: Run each decoder MLP over tiles of tokens, recomputed in the backward.
        tiled_norms: Run the decoder layers' norms and the final one over tiles of tokens.
        sp_checkpoint: Per-layer activation checkpointing: ``none``, ``layers``, or ``offload``
            (checkpoints in pinned host memory).
        sp_verify: Before training, check on a small float64 copy of the model's architecture
            that SP gives the one-process loss and gradients (`verify_sequence_parallel`);
            raises on a mismatch.
        sp_predict_logits: What ``predict`` and ``compute_metrics`` get: ``gather`` (full logits,
            batch x seq x vocab per rank), ``argmax`` (token ids only), or ``none`` (refused,
            naming the memory it would take).

    Raises:
        ValueError: A field out of its range (the message names it), or ``sp_checkpoint`` with
            ``gradient_checkpointing``.
    """

    sp_size: int = field(default=1, metadata={"help": "Ranks that share one sequence; the rest of the world is data parallel."})
    sp_backend: str = field(
        default="auto",
        metadata={"help": f"SP attention backend: auto, one of {', '.join(list_backends())}, hybrid-u{{U}}, "
                          "or comma-separated names, one per attention layer."},
    )
    sp_kernel: str = field(default="auto", metadata={"help": f"Local attention kernel: {', '.join(KERNEL_NAMES)}."})
    sp_mixer: str = field(default="auto", metadata={"help": "Strategy for hybrid models' other token mixers (Gated DeltaNet, Mamba2, "
                                                           f"short convolutions): {', '.join(MIXER_CHOICES)}; none refuses them."})
    sp_layout: str = field(default="auto", metadata={"help": "Tokens of each sequence across the SP ranks: zigzag, contiguous, "
                                                             "balanced (packed documents placed so every rank does the same causal "
                                                             "attention work), or auto: balanced when the training rows are packed "
                                                             "(DataCollatorWithFlattening, or position_ids restarting at 0), else zigzag."})
    ulysses_degree: int | None = field(default=None, metadata={"help": "What the hybrid backend means (default: sp_size)."})
    sp_profile: str | None = field(default=None, metadata={"help": "A profile JSON from sp-bench calibrate, for auto."})
    tiled_loss: bool = field(default=False, metadata={"help": "LM head + loss over tiles of tokens: no [tokens, vocab] logits in training."})
    tiled_mlp: bool = field(default=False, metadata={"help": "Each decoder MLP over tiles of tokens, recomputed in the backward."})
    tiled_norms: bool = field(default=False, metadata={"help": "The decoder layers' norms and the final one over tiles of tokens, recomputed in the backward."})
    sp_checkpoint: str = field(
        default="none",
        metadata={"help": "Per-layer activation checkpointing: none, layers, or offload (checkpoints in pinned host memory)."},
    )
    sp_verify: bool = field(
        default=False,
        metadata={"help": "Before training, check on a small fp64 copy of the model's architecture that SP gives the one-process "
                          "loss and gradients (ulysses_sp.verify_sequence_parallel); raises on a mismatch."},
    )
    sp_predict_logits: str = field(
        default="gather",
        metadata={"help": "predict()/metrics: gather full logits (batch x seq x vocab per rank), argmax (token ids only), "
                          "or none (refuse, naming the memory)."},
    )

    def __post_init__(self):
        use_cpu_accelerator_if_needed()  # before TrainingArguments imports deepspeed for deepspeed=...
        validate_sp_arguments(self)
        super().__post_init__()


def backend_names(sp_backend: str) -> str | list[str]:
    """``"a,b"`` -> ``["a", "b"]`` (one per layer); a single name stays a string."""
    return [n.strip() for n in sp_backend.split(",")] if "," in sp_backend else sp_backend.strip()


def validate_sp_arguments(args) -> None:
    """Checks that need neither the model nor the world (``ValueError`` naming the constraint)."""
    if not isinstance(args.sp_size, int) or args.sp_size < 1:
        raise ValueError(f"sp_size must be a positive integer, got {args.sp_size!r}")
    if args.ulysses_degree is not None and (args.ulysses_degree < 1 or args.sp_size % args.ulysses_degree):
        raise ValueError(f"ulysses_degree ({args.ulysses_degree}) must divide sp_size ({args.sp_size})")
    names = backend_names(args.sp_backend)
    for name in [names] if isinstance(names, str) else names:
        if name != "auto":
            get_backend(name)  # ValueError listing the known backends
    if args.sp_kernel not in KERNEL_NAMES:
        raise ValueError(f"sp_kernel must be one of {', '.join(KERNEL_NAMES)}, got {args.sp_kernel!r}")
    if args.sp_layout not in ("auto", *LAYOUTS):
        raise ValueError(f"sp_layout must be auto or one of {', '.join(LAYOUTS)}, got {args.sp_layout!r}")
    if args.sp_mixer not in MIXER_CHOICES:
        raise ValueError(f"sp_mixer must be one of {', '.join(MIXER_CHOICES)}, got {args.sp_mixer!r}")
    if args.sp_checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"sp_checkpoint must be one of {', '.join(CHECKPOINT_MODES)}, got {args.sp_checkpoint!r}")
    if args.sp_predict_logits not in PREDICT_LOGITS:
        raise ValueError(f"sp_predict_logits must be one of {', '.join(PREDICT_LOGITS)}, got {args.sp_predict_logits!r}")
    if args.sp_checkpoint != "none" and args.gradient_checkpointing:
        raise ValueError("sp_checkpoint and gradient_checkpointing both checkpoint the layers: choose one")


def _base_model(model):
    """The transformers model under a PEFT wrapper (SP is applied to it, not to the wrapper)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _head_problems(model, names, sp_size: int, ulysses_degree: int | None) -> list[str]:
    """Named backends that scatter heads, checked against the model's head counts."""
    config = getattr(model, "config", None)
    hq = getattr(config, "num_attention_heads", None)
    if hq is None:
        return []
    hkv = getattr(config, "num_key_value_heads", None) or hq
    problems = []
    for name in sorted(set([names] if isinstance(names, str) else names)):
        match = _HYBRID_U.match(name)
        degree = {"ulysses": sp_size, "hybrid": ulysses_degree or sp_size}.get(name, int(match.group(1)) if match else None)
        if degree is None or degree == 1:
            continue
        if match and sp_size % degree:
            problems.append(f"{name}: Ulysses degree {degree} must divide sp_size ({sp_size})")
            continue
        problem = comm.head_scatter_problem(hq, hkv, degree)
        if problem:
            problems.append(f"backend {name!r} needs {problem}; use sp_backend='auto' (or ring, allgather) for this model")
    return problems


def _check_model_and_world(args, model) -> None:
    """Everything that can be checked on each rank before the first collective."""
    world = dist.get_world_size()
    if world % args.sp_size:
        raise ValueError(f"sp_size ({args.sp_size}) must divide the world size ({world}): world = data parallel x sp_size")
    base = _base_model(model)
    base = decoder_to_switch(base) or base  # an image-text model: its text decoder (others are refused by name here)
    layers = _attention_layers(base)
    if not layers and (args.sp_mixer == "none" or not any(f.kind == "mixer" for f in find_uncovered(base))):
        raise ValueError(f"{type(base).__name__} has no attention layers with a layer_idx and no token mixer; ulysses_sp cannot switch it")
    names = backend_names(args.sp_backend)
    _backend_per_layer(names, layers)  # a per-layer list of the wrong length raises here
    problems = _head_problems(base, names, args.sp_size, args.ulysses_degree)
    if problems:
        raise ValueError("; ".join(problems))


def _ensure_process_group() -> None:
    """One process without a launcher still needs a (one-rank) group for the topology."""
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)


@contextlib.contextmanager
def _deepspeed_with_mpu(mpu):
    """Hand our mpu to ``deepspeed.initialize`` when accelerate calls it (accelerate has no
    argument for an external mpu). accelerate's train_batch_size (micro x accumulation x world)
    agrees with it: the mpu's data-parallel group, over which ZeRO reduces, is the world."""
    if mpu is None:
        yield
        return
    import deepspeed

    original = deepspeed.initialize

    def initialize(*args, **kwargs):
        if kwargs.get("mpu") is None:
            kwargs["mpu"] = mpu
        return original(*args, **kwargs)

    deepspeed.initialize = initialize
    try:
        yield
    finally:
        deepspeed.initialize = original


def _auto_layout(dataset, collator) -> str:
    """``sp_layout="auto"``: balanced for packed training rows, zigzag otherwise (one document per
    row, where zigzag already balances the causal work with fewer, larger kernel calls). Packed:
    transformers' flattening collator, or a first example whose ``position_ids`` restart at 0.
    The same answer on every rank (the same dataset and collator), with no collective."""
    from transformers import DataCollatorWithFlattening

    if isinstance(collator, DataCollatorWithFlattening):
        return "balanced"
    if dataset is None or isinstance(dataset, IterableDataset) or len(dataset) == 0:
        return "zigzag"
    example = dataset[0]
    position_ids = example.get("position_ids") if isinstance(example, dict) else None
    return "balanced" if position_ids is not None and bool((torch.as_tensor(position_ids)[..., 1:] == 0).any()) else "zigzag"


class DataParallelBatches(Sampler):
    """Eval batches: global batch ``g`` (samples ``[g*B, (g+1)*B)``, as on one process) goes whole
    to DP group ``g % dp``. Groups with fewer batches repeat batch 0 so every rank runs the same
    number of forwards (ZeRO-3 gathers parameters collectively); ``plan()`` says which are real."""

    def __init__(self, n: int, batch_size: int, dp_rank: int, dp_size: int):
        self.n, self.batch_size, self.dp_rank, self.dp_size = n, batch_size, dp_rank, dp_size
        self.batches = math.ceil(n / batch_size)

    def plan(self) -> list[tuple[int | None, int]]:
        """(global batch index or None for padding, number of samples) per local batch."""
        out = []
        for i in range(math.ceil(self.batches / self.dp_size)):
            g = self.dp_rank + i * self.dp_size
            out.append((g, min(self.n, (g + 1) * self.batch_size) - g * self.batch_size) if g < self.batches else (None, 0))
        return out

    def __iter__(self):
        for g, _ in self.plan():
            start = 0 if g is None else g * self.batch_size
            yield list(range(start, min(self.n, start + self.batch_size)))

    def __len__(self) -> int:
        return math.ceil(self.batches / self.dp_size)


class SequenceParallelTrainer(Trainer):
    """``transformers.Trainer`` with every sequence split over the ranks of an SP group.

    The model is switched to SP attention here (`apply_sequence_parallel`) and stays so for
    ``train``, ``evaluate`` and ``predict``; call `remove_sequence_parallel` to ``generate``.
    Inputs are causal-LM batches (``input_ids``, ``labels``, optionally ``position_ids``
    restarting at 0 for packed documents and a right-padding ``attention_mask``). The train
    sampler gives every rank of an SP group the same samples; the loss is the token-weighted
    mean over the whole accumulation window and every DP group, and the gradient reduction
    (DDP, FSDP2 or DeepSpeed) is scaled so the applied gradient is the one-process gradient.
    ``eval_loss`` is the mean over every target token of the eval set.

    Args:
        model: A transformers model (or a PEFT model around one); ``model_init`` is not
            supported, SP being applied once, here.
        args: The training arguments with the SP fields.
        **kwargs: ``transformers.Trainer``'s other arguments (``train_dataset``,
            ``data_collator``, ``compute_metrics``...).

    Raises:
        ValueError: Before any collective, on every rank: arguments that are not
            `SequenceParallelTrainingArguments`, no model, what the SP trainer cannot do
            (``compute_loss_func``, label smoothing, accelerate's ``parallelism_config``,
            FSDP1, a sampling strategy other than random or sequential, several GPUs in one
            process), an ``sp_size`` that does not divide the world, a model without attention
            layers or token mixers, or backends the model's heads do not allow.
        SequenceParallelMismatch: With ``sp_verify``, SP does not give the one-process loss
            and gradients.
    """

    def __init__(self, model: torch.nn.Module | None = None, args: SequenceParallelTrainingArguments | None = None, **kwargs: Any):
        if not isinstance(args, SequenceParallelTrainingArguments):
            raise ValueError("SequenceParallelTrainer needs args=SequenceParallelTrainingArguments(...)")
        if model is None:
            raise ValueError("SequenceParallelTrainer needs a model (model_init is not supported: SP is applied once, at init)")
        unsupported = {
            "compute_loss_func": kwargs.get("compute_loss_func") is not None,
            "label_smoothing_factor": args.label_smoothing_factor != 0,
            "parallelism_config (accelerate's own SP/CP)": getattr(args, "parallelism_config", None) is not None,
            "FSDP1 (fsdp_config version 1; FSDP2, the default, is)": bool(args.fsdp) and int((args.fsdp_config or {}).get("version", 2)) == 1,
            f"train_sampling_strategy={args.train_sampling_strategy!r}": args.train_sampling_strategy not in ("random", "sequential"),
        }
        refused = [name for name, on in unsupported.items() if on]
        if refused:
            raise ValueError(f"SequenceParallelTrainer computes the SP loss and sampling itself; not supported: {', '.join(refused)}")
        args._setup_devices  # the process group of torchrun / accelerate / deepspeed launchers
        if args.n_gpu > 1:
            raise ValueError(f"{args.n_gpu} GPUs in one process (torch DataParallel) cannot run SP: launch one process per GPU")
        _ensure_process_group()
        _check_model_and_world(args, model)
        self._sp_args = args
        layout = args.sp_layout if args.sp_layout != "auto" else _auto_layout(kwargs.get("train_dataset"), kwargs.get("data_collator"))
        self.topo = init_sequence_parallel(args.sp_size, ulysses_degree=args.ulysses_degree, layout=layout, profile=args.sp_profile)
        self._sp_model = _base_model(model)
        if args.sp_verify:
            self.verify_report = verify_sequence_parallel(self._sp_model, self.topo, backend=backend_names(args.sp_backend), mixer=args.sp_mixer)
            if self.topo.rank == 0:
                print(f"ulysses-sp verify: {self.verify_report}", flush=True)
        self.apply_sequence_parallel()
        self._mpu = SequenceParallelMPU(self.topo) if args.deepspeed else None  # collective: every rank, here
        super().__init__(model=model, args=args, **kwargs)

    # ---- the model's SP state ----

    def apply_sequence_parallel(self) -> torch.nn.Module:
        """(Re)switch the model to SP attention with the arguments' backend, kernel and memory options.

        Returns:
            The switched model.
        """
        a = self._sp_args
        return apply_sequence_parallel(
            self._sp_model, self.topo, backend=backend_names(a.sp_backend), kernel=a.sp_kernel,
            tiled_mlp=a.tiled_mlp, checkpoint=a.sp_checkpoint, mixer=a.sp_mixer, tiled_norms=a.tiled_norms,
        )

    def remove_sequence_parallel(self) -> torch.nn.Module:
        """Back to the model's previous attention on whole sequences (e.g. to ``generate``).

        Returns:
            The model, no longer switched.
        """
        return remove_sequence_parallel(self._sp_model)

    def _save(self, output_dir=None, state_dict=None):
        """Saved configs keep the user's ``use_cache`` (SP turns it off while switched on)."""
        switched = switched_model(self._sp_model)
        config = getattr(switched, "config", None)
        if config is None:
            return super()._save(output_dir, state_dict)
        current, config.use_cache = config.use_cache, switched.__dict__["_ulysses_sp_previous"][1]
        try:
            return super()._save(output_dir, state_dict)
        finally:
            config.use_cache = current

    def _require_sp(self) -> None:
        if switched_model(self._sp_model) is None:
            raise RuntimeError("the model is no longer sequence parallel (remove_sequence_parallel was called): "
                               "call trainer.apply_sequence_parallel() before training or evaluating again")

    # ---- data ----

    def get_total_train_batch_size(self, args) -> int:
        return args.train_batch_size * args.gradient_accumulation_steps * self.topo.dp_size

    def _get_train_sampler(self, train_dataset=None):
        dataset = train_dataset if train_dataset is not None else self.train_dataset
        if dataset is None or isinstance(dataset, IterableDataset):
            return None
        return SequenceParallelSampler(
            dataset, self.topo, shuffle=self.args.train_sampling_strategy != "sequential",
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed, drop_last=self.args.dataloader_drop_last,
        )

    def get_train_dataloader(self) -> DataLoader:
        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError("SequenceParallelTrainer needs a map-style train dataset (with __len__): an iterable one would be "
                             "split by world rank, and the SP ranks of a group must read the same samples")
        loader = super().get_train_dataloader()
        shard = getattr(loader, "batch_sampler", None)
        if type(shard).__name__ == "BatchSamplerShard":  # accelerate's world-rank split: our sampler already splits by DP group
            shard.num_processes, shard.process_index, shard.even_batches = 1, 0, False
        sampler = getattr(getattr(shard, "batch_sampler", shard), "sampler", None)
        if not isinstance(sampler, SequenceParallelSampler):
            raise ValueError(f"the train dataloader must sample with SequenceParallelSampler, got {type(sampler).__name__} "
                             "(accelerate's dispatch_batches is not supported)")
        return loader

    def _eval_loader(self, dataset, description: str) -> DataLoader:
        if dataset is None or isinstance(dataset, IterableDataset):
            raise ValueError(f"{description}: SequenceParallelTrainer needs a map-style dataset (with __len__)")
        collator = self.data_collator
        try:
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description=description)
            else:
                collator = self._get_collator_with_removed_columns(collator, description=description)
        except ImportError:
            collator = self._get_collator_with_removed_columns(collator, description=description)
        batches = DataParallelBatches(len(dataset), self.args.eval_batch_size, self.topo.dp_rank, self.topo.dp_size)
        return DataLoader(dataset, batch_sampler=batches, collate_fn=collator, num_workers=self.args.dataloader_num_workers,
                          pin_memory=self.args.dataloader_pin_memory)

    def get_eval_dataloader(self, eval_dataset=None) -> DataLoader:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else eval_dataset if eval_dataset is not None else self.eval_dataset
        return self._eval_loader(dataset, "Evaluation")

    def get_test_dataloader(self, test_dataset) -> DataLoader:
        return self._eval_loader(test_dataset, "test")

    def _shard(self, inputs) -> dict:
        """This rank's part of a causal-LM batch (``shard_batch``; an image-text model's images and
        videos go whole to every rank); the mask is not passed on (right padding under causal
        attention changes nothing; its targets are dropped)."""
        if "input_ids" not in inputs:
            raise ValueError(f"SequenceParallelTrainer needs input_ids in every batch, got keys {sorted(inputs)}")
        return shard_batch({k: v for k, v in inputs.items() if v is not None}, self.topo)  # images and videos too

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The accumulation window's micro-batches, sharded, and ``num_items_in_batch``: its valid
        targets over every DP group, each counted once (one all-reduce per window)."""
        batches = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        if not batches:
            return batches, None
        local = [self._shard(b) for b in batches]
        if any("shift_labels" not in b for b in local):
            raise ValueError("SequenceParallelTrainer trains causal LMs: every training batch needs labels")
        counts = target_counts(local, dist.group.WORLD, device)
        for b, n in zip(local, counts):
            b[_TARGETS] = n
        return local, counts.sum()

    # ---- loss and backward ----

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The token-weighted loss of the window: this micro-batch's targets over every rank,
        divided by ``num_items_in_batch`` (the window's count; None: this micro-batch's own).
        The value is the same on every rank; the gradient reaches this rank's tokens only."""
        self._require_sp()
        if _TARGETS in inputs:
            local = inputs
        else:
            local = self._shard(inputs)
            local[_TARGETS] = target_counts([local], dist.group.WORLD, self.args.device)[0]
        outputs = None
        if self.args.tiled_loss and not return_outputs:
            loss = causal_lm_loss(model, local, self.topo, count_group=dist.group.WORLD)
        else:
            outputs = model(**model_inputs(local))
            loss = sp_cross_entropy(outputs.logits, local["shift_labels"], self.topo, count_group=dist.group.WORLD)
            self._token_metrics(outputs.logits, local["shift_labels"])
        if num_items_in_batch is not None:
            loss = loss * (local[_TARGETS].clamp(min=1) / torch.as_tensor(num_items_in_batch).clamp(min=1)).to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    def _token_metrics(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> None:
        """Per-token metrics of this rank's shard of the micro-batch (the TRL SFT trainer logs some)."""

    def _gradient_scale(self, model) -> float:
        """What undoes the reduction's averaging, so the applied gradient is the plain sum over ranks."""
        if self.is_deepspeed_enabled:
            return gradient_scale(self.model_wrapped, self.topo)
        model = getattr(model, "_orig_mod", model)  # torch_compile=True: accelerate compiles the DDP module
        if isinstance(model, FSDPModule):  # FSDP2 averages over its mesh: accelerate's, without a parallelism_config, is the world
            return float(self.topo.world_size)
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if self.args.fsdp:  # shown once: the warnings module's default filter
                warnings.warn("fsdp was given but accelerate prepared DDP (it enables FSDP on GPUs only): the model is not sharded; "
                              "the gradients are exact either way", stacklevel=2)
            return float(dist.get_world_size(model.process_group))
        if self.topo.world_size > 1:
            raise RuntimeError(f"{self.topo.world_size} ranks but the model is neither DDP nor DeepSpeed: nothing would reduce the gradients")
        return 1.0

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if num_items_in_batch is None:
            loss = loss / self.current_gradient_accumulation_steps
        kwargs = {"scale_wrt_gas": False} if self.is_deepspeed_enabled else {}  # the count already spans the window
        self.accelerator.backward(loss * self._gradient_scale(model), **kwargs)
        return loss.detach()

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        self._require_sp()
        with _deepspeed_with_mpu(self._mpu):
            return super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)

    # ---- evaluation and prediction ----

    def _eval_model(self):
        """The model as transformers' evaluation_loop prepares it (DeepSpeed ZeRO-3 inference without training)."""
        from transformers.integrations.deepspeed import deepspeed_init

        with _deepspeed_with_mpu(self._mpu):
            if self.is_deepspeed_enabled and self.deepspeed is None:
                deepspeed_init(self, num_training_steps=0, inference=True)
            model = self._wrap_model(self.model, training=False)
            if len(self.accelerator._models) == 0 and model is self.model:
                model = self.accelerator.prepare(model) if self.is_deepspeed_enabled else self.accelerator.prepare_model(model, evaluation_mode=True)
                if model is not self.model:
                    self.model_wrapped = model
                if self.is_deepspeed_enabled:
                    self.deepspeed = self.model_wrapped
        return model

    def _no_logits_error(self, inputs, vocab: int) -> ValueError:
        b, s = inputs["input_ids"].shape
        gib = b * s * vocab * 4 / 2**30
        return ValueError(
            f"predictions need every token's logits gathered on every rank: batch x seq x vocab x 4 bytes = {b} x {s} x {vocab} x 4 "
            f"= {gib:.3g} GiB per batch (fp32), and the whole dataset's on the CPU; sp_predict_logits='none' refuses that. "
            "Set sp_predict_logits='gather' (full logits) or 'argmax' (token ids only, seq x 8 bytes per sample), "
            "or evaluate without compute_metrics (loss only)"
        )

    def evaluation_loop(self, dataloader, description, prediction_loss_only=None, ignore_keys=None, metric_key_prefix="eval"):
        """``eval_loss`` as on one process; predictions in global token order, each sample once."""
        self._require_sp()
        args = self.args
        prediction_loss_only = prediction_loss_only if prediction_loss_only is not None else args.prediction_loss_only
        plan_of = getattr(dataloader.batch_sampler, "plan", None)
        if plan_of is None:
            raise ValueError("SequenceParallelTrainer evaluates with its own dataloaders (get_eval_dataloader / get_test_dataloader)")
        model = self._eval_model()
        model.eval()
        self.callback_handler.eval_dataloader = dataloader
        vocab = self._sp_model.config.get_text_config().vocab_size
        loss_sum = weight = 0.0
        preds, label_ids = {}, {}
        with torch.no_grad():
            for step, ((g, _), inputs) in enumerate(zip(plan_of(), dataloader)):
                if step == 0 and not prediction_loss_only and args.sp_predict_logits == "none":
                    raise self._no_logits_error(inputs, vocab)
                inputs = self._prepare_inputs(inputs)
                local = self._shard(inputs)
                has_labels = "shift_labels" in local
                logits = loss = None
                if prediction_loss_only and has_labels and args.tiled_loss:
                    loss = causal_lm_loss(model, local, self.topo)
                else:
                    logits = model(**model_inputs(local)).logits
                    if has_labels:
                        loss = sp_cross_entropy(logits, local["shift_labels"], self.topo)
                if loss is not None and g is not None:  # the group's mean times this rank's targets: summed, the group's sum
                    targets = (local["shift_labels"] != IGNORE_INDEX).sum().item()
                    loss_sum += loss.item() * targets
                    weight += targets
                if not prediction_loss_only:
                    seq = inputs["input_ids"].shape[1]
                    cu = local.get("cu_seqlens")
                    if args.sp_predict_logits == "argmax":
                        full = gather_sequence(logits.argmax(-1), self.topo, cu_seqlens=cu)[:, :seq]
                    else:
                        full = gather_sequence(logits, self.topo, cu_seqlens=cu)[:, :seq]
                    labels = inputs.get("labels")
                    if self.preprocess_logits_for_metrics is not None:
                        full = self.preprocess_logits_for_metrics(full, labels)
                    if g is not None:
                        preds[g] = full.cpu()
                        if labels is not None:
                            label_ids[g] = labels.cpu()
                self.control = self.callback_handler.on_prediction_step(args, self.state, self.control)

        totals = comm.all_reduce_sum(torch.tensor([loss_sum, weight], dtype=torch.float64, device=args.device), dist.group.WORLD)
        predictions = labels_out = None
        if not prediction_loss_only:
            predictions, labels_out = self._collect(preds), self._collect(label_ids)
        metrics = {}
        if self.compute_metrics is not None and predictions is not None and labels_out is not None:
            metrics = self.compute_metrics(EvalPrediction(predictions=predictions, label_ids=labels_out))
        metrics = denumpify_detensorize(metrics)
        if totals[1] > 0:
            metrics["loss"] = (totals[0] / totals[1]).item()
        metrics = {k if k.startswith(f"{metric_key_prefix}_") else f"{metric_key_prefix}_{k}": v for k, v in metrics.items()}
        return EvalLoopOutput(predictions=predictions, label_ids=labels_out, metrics=metrics, num_samples=len(dataloader.dataset))

    def _collect(self, by_batch: dict):
        """Every DP group's batches in global order, concatenated (sequences padded with -100, as
        transformers does), as numpy; None when no batch had any."""
        parts = [by_batch]
        if self.topo.dp_size > 1:
            parts = [None] * self.topo.dp_size
            dist.all_gather_object(parts, by_batch, group=self.topo.dp_group)
        merged = {g: t for part in parts for g, t in part.items()}
        if not merged:
            return None
        out = None
        for g in sorted(merged):
            out = merged[g] if out is None else nested_concat(out, merged[g], padding_index=-100)
        return out.numpy() if out.dtype != torch.bfloat16 else out.float().numpy()
