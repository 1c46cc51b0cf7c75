"""TRL's SFT, DPO and GRPO trainers under sequence parallelism (``pip install ulysses-sp[trl]``).

Each trainer is the TRL trainer combined with `SequenceParallelTrainer`
(its topology, SP attention, sampling by DP group and gradient reduction), and each config the TRL
config with the SP fields of `SequenceParallelTrainingArguments`.

- **SFT** trains a causal LM: the batches are cut with `ulysses_sp.shard_batch` and the loss
  is the SP trainer's token-weighted mean over SP x DP x accumulation. TRL's collators decide the
  targets (completion-only and assistant-only loss are labels of -100), and packed rows
  (``packing=True`` or ``padding_free=True``: position ids restarting at 0) default to the balanced layout.
- **DPO and GRPO** compute their losses from per-token log-probabilities, which TRL asks of the
  model as ``model(..., labels=..., fused_lm_head=True)`` (`trl.trainer.utils.add_fused_lm_head`).
  Under SP that forward (`sequence_parallel_fused_head`) takes the whole batch on every rank of
  the group, runs the model on this rank's shard (tiled over the vocabulary by TRL's fused head, so
  no logits), and gathers each per-token field (``B x S`` numbers, not ``B x S x vocab``) back into
  whole rows. So TRL's own loss code (sums per sequence, ``ld_alpha``, IPO's lengths, GRPO's ratios,
  clipping, KL and normalisations) runs unchanged, on every rank of the group, on exactly what one
  process would hold. The gather's backward sends each rank the gradient of its own tokens; the
  loss is scaled so the reduced gradient is the data-parallel average one process of each DP group
  would give. Rows with left padding (GRPO's prompts) keep their positions; the padding before them
  is a document of its own, so no token sees it.
- **GRPO** generates on whole sequences: SP is removed around ``generate`` and the completions of
  the SP group's first rank are sent to the others, so the group trains on identical completions
  even when their sampling would differ. The data are split by DP group, not by rank.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from transformers import Trainer

try:
    from trl import DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer
    from trl.trainer.utils import FusedCausalLMOutput, create_model_from_path, nanstd
except ImportError as e:  # pragma: no cover - the trl extra
    raise ImportError("ulysses_sp.integrations.trl needs TRL: pip install 'ulysses-sp[trl]'") from e

from ..data import IGNORE_INDEX, gather_sequence, model_inputs, shard_batch, shard_sequence
from .trainer import SequenceParallelTrainer, SequenceParallelTrainingArguments, _base_model, backend_names
from ..models.coverage import FUSED_HEAD as _FUSED, SHARD_CALL
from ..models.switch import _PREVIOUS, ATTN_IMPLEMENTATION, apply_sequence_parallel, remove_sequence_parallel, switched_model

if TYPE_CHECKING:
    from ..topology import Topology

__all__ = [
    "SequenceParallelSFTConfig", "SequenceParallelSFTTrainer", "SequenceParallelDPOConfig", "SequenceParallelDPOTrainer",
    "SequenceParallelGRPOConfig", "SequenceParallelGRPOTrainer", "sequence_parallel_fused_head",
]

_PER_TOKEN = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


@dataclass
class SequenceParallelSFTConfig(SFTConfig, SequenceParallelTrainingArguments):
    """``trl.SFTConfig`` with the SP fields of `SequenceParallelTrainingArguments` (``sp_size``, ``sp_backend``...)."""


@dataclass
class SequenceParallelDPOConfig(DPOConfig, SequenceParallelTrainingArguments):
    """``trl.DPOConfig`` with the SP fields of `SequenceParallelTrainingArguments`."""


@dataclass
class SequenceParallelGRPOConfig(GRPOConfig, SequenceParallelTrainingArguments):
    """``trl.GRPOConfig`` with the SP fields of `SequenceParallelTrainingArguments`.

    The generation batch is counted over the DP groups
    (``per_device_train_batch_size x DP x steps_per_generation``): the SP ranks of a group share it.

    Raises:
        ValueError: A ``generation_batch_size`` that does not divide by the global batch (rows x
            DP groups), or batches that do not hold whole groups of ``num_generations``.
    """

    def __post_init__(self):
        batch_given = self.generation_batch_size is not None
        super().__post_init__()
        dp, rows = self.world_size // self.sp_size, self.per_device_train_batch_size
        if self.sp_size == 1 or self.world_size % self.sp_size:
            return  # one process per sequence, or a world that the trainer refuses by name
        if batch_given:  # TRL derived steps_per_generation from the world; the groups share their batches
            if self.generation_batch_size % (rows * dp):
                raise ValueError(f"generation_batch_size ({self.generation_batch_size}) must be divisible by the global batch size "
                                 f"({rows} x {dp} DP groups; the {self.sp_size} SP ranks of a group share theirs)")
            self.steps_per_generation = self.generation_batch_size // (rows * dp)
        else:
            self.generation_batch_size = rows * dp * self.steps_per_generation
        if (rows * self.steps_per_generation) % self.num_generations or self.per_device_eval_batch_size % self.num_generations:
            raise ValueError(f"under SP each DP group generates whole groups: per_device_train_batch_size x steps_per_generation "
                             f"({rows} x {self.steps_per_generation}) and per_device_eval_batch_size ({self.per_device_eval_batch_size}) "
                             f"must be divisible by num_generations ({self.num_generations})")


def _from_path(model, args, kwargs: dict, like: torch.nn.Module | None = None):
    """A model given as a hub id or a local directory, loaded by TRL's own rules (``args.model_init_kwargs``,
    float32 unless they give a dtype, no ``device_map`` across processes, the trainer's
    ``quantization_config``) on every rank: SP is applied before TRL's init, which would load it.
    ``like``: the policy, whose dtype and attention a reference model takes (as TRL's default reference)."""
    if not isinstance(model, str):
        return model
    from transformers import set_seed

    init = dict(args.model_init_kwargs or {})
    quantization = kwargs.pop("quantization_config", None) if like is None else kwargs.get("quantization_config")
    if quantization is not None:
        if "quantization_config" in init:
            raise ValueError("quantization_config was given both to the trainer and in args.model_init_kwargs: give it once")
        init["quantization_config"] = quantization
    if args.distributed_state.distributed_type in ("MULTI_GPU", "DEEPSPEED"):
        init["device_map"] = None
    init.setdefault("trust_remote_code", args.trust_remote_code)
    if like is not None:
        init.setdefault("dtype", like.dtype)
        init.setdefault("attn_implementation", like.config._attn_implementation)
    set_seed(args.seed)  # as TRL, before the model is made
    return create_model_from_path(model, **init)


class _GradScale(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale: float):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _row_groups(attention_mask: torch.Tensor | None, b: int) -> dict[int, torch.Tensor]:
    """Rows by their number of leading padding tokens (each group is one forward)."""
    if attention_mask is None:
        return {0: torch.arange(b)}
    lead = (attention_mask.cumsum(1) == 0).sum(1)
    lead = torch.where(lead == attention_mask.shape[1], 0, lead).cpu()  # an all-padding row: no real token to place
    return {int(k): (lead == k).nonzero()[:, 0] for k in lead.unique()}


def _shard_rows(input_ids, labels, attention_mask, position_ids, lead: int, topo) -> dict:
    """shard_batch of rows whose first ``lead`` tokens are padding: the padding is made a document of its
    own (so causal attention keeps every real token from it) and the positions stay those one process
    gives the rows (``arange``), so rotary and absolute embeddings see the same numbers."""
    labels = labels if attention_mask is None else labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention_mask, "position_ids": position_ids}
    if lead == 0:
        return shard_batch({k: v for k, v in batch.items() if v is not None}, topo)
    if position_ids is not None:
        raise ValueError("rows with left padding and position_ids: ulysses_sp places left-padded rows with positions 0..S-1 "
                         "(what the model uses without position_ids); pass one or the other")
    b, s = input_ids.shape
    batch["attention_mask"] = attention_mask.clone()
    batch["attention_mask"][:, :lead] = 1
    batch["position_ids"] = torch.cat([torch.arange(lead), torch.arange(s - lead)]).to(input_ids.device).expand(b, s)
    local = shard_batch(batch, topo)
    whole = torch.arange(local["input_ids"].shape[1] * topo.sp_size, device=input_ids.device).expand(b, -1)
    local["position_ids"] = shard_sequence(whole, topo, cu_seqlens=local["cu_seqlens"].tolist())
    return local


def sequence_parallel_fused_head(model: torch.nn.Module, topo: Topology, grad_scale: Callable[[], float] = lambda: 1.0) -> None:
    """Make TRL's fused LM head sequence parallel while ``model`` is switched by `apply_sequence_parallel`.

    TRL's DPO and GRPO ask the model for per-token fields with ``model(..., labels=...,
    fused_lm_head=True)`` (``trl.trainer.utils.add_fused_lm_head``, already added to ``model``).
    Afterwards every rank of the SP group passes the whole batch and gets every per-token field of
    the whole rows, computed on its shard and gathered (differentiable). A forward without
    ``fused_lm_head`` raises ``RuntimeError`` while switched (the model would take the whole rows
    for a shard); after `remove_sequence_parallel` every call is the model's own. Calling it again
    only updates ``topo`` and ``grad_scale``.

    Args:
        model: The switched model, with TRL's fused head added.
        topo: The topology from `init_sequence_parallel`.
        grad_scale: Called at each training forward: the factor for the gradient that reaches this
            rank's tokens (what undoes the gradient reduction's averaging).
    """
    if _FUSED in model.__dict__:
        model.__dict__[_FUSED] = (topo, grad_scale)
        return
    inner = model.forward
    model.__dict__[_FUSED] = (topo, grad_scale)

    def forward(*args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs):
        if kwargs.pop(SHARD_CALL, False):  # this rank's shard, from _sp_fused through the model's hooks
            return inner(*args, fused_lm_head=True, shift_labels=shift_labels, **kwargs)
        if switched_model(model) is None:
            for key, value in (("fused_lm_head", fused_lm_head), ("labels", labels), ("shift_labels", shift_labels),
                               ("num_items_in_batch", num_items_in_batch)):
                if value is not None and value is not False:
                    kwargs[key] = value
            return inner(*args, **kwargs)
        if not fused_lm_head:
            raise RuntimeError("the model is sequence parallel: under a TRL trainer only fused_lm_head=True forwards split the rows; "
                               "call remove_sequence_parallel() first to run it on whole sequences")
        topo_, scale = model.__dict__[_FUSED]
        return _sp_fused(model, topo_, scale, args, kwargs, labels, shift_labels, num_items_in_batch)

    model.forward = forward


def _sp_fused(model, topo, grad_scale, args, kwargs, labels, shift_labels, num_items_in_batch):
    if args:
        raise ValueError("pass the model's inputs by keyword under SP (input_ids=..., attention_mask=...)")
    if shift_labels is not None or labels is None:
        raise ValueError("the SP fused head takes whole-row labels (it shifts and shards them itself), not shift_labels")
    if kwargs.get("output_router_logits"):
        raise ValueError("the MoE load-balancing loss is not exact under SP (each rank would see its tokens' routing only): "
                         "set router_aux_loss_coef=0")
    input_ids = kwargs.pop("input_ids")
    mask, position_ids = kwargs.pop("attention_mask", None), kwargs.pop("position_ids", None)
    kwargs.pop("use_cache", None)
    if kwargs:
        raise ValueError(f"ulysses_sp's TRL trainers take text batches (input_ids, attention_mask, position_ids); got {sorted(kwargs)}")
    b, s = input_ids.shape
    groups = _row_groups(mask, b)
    parts, order = [], []
    for lead, rows in groups.items():
        rows = rows.to(input_ids.device)
        pick = (lambda t: None if t is None else t.index_select(0, rows) if t.shape[0] == b else t) if len(groups) > 1 else (lambda t: t)
        local = _shard_rows(pick(input_ids), pick(labels), pick(mask), pick(position_ids), lead, topo)
        out = model(**model_inputs(local), shift_labels=local["shift_labels"], fused_lm_head=True, use_cache=False, **{SHARD_CALL: True})
        cu = local.get("cu_seqlens")
        fields = {}
        for name in _PER_TOKEN:
            value = getattr(out, name, None)
            if value is None:
                continue
            flag = value.dtype == torch.bool
            full = gather_sequence(value.to(torch.uint8) if flag else value, topo, cu_seqlens=cu)[:, : s - 1]
            fields[name] = full.bool() if flag else full
        parts.append(fields)
        order.append(rows)
    if len(parts) == 1:
        fields = parts[0]
    else:
        inverse = torch.argsort(torch.cat(order))
        fields = {name: torch.cat([p[name] for p in parts]).index_select(0, inverse) for name in parts[0]}
    scale = grad_scale() if torch.is_grad_enabled() else 1.0
    if scale != 1.0:
        for name in ("log_probs", "entropy"):
            if name in fields and fields[name].requires_grad:
                fields[name] = _GradScale.apply(fields[name], scale)
    count = fields["label_mask"].sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    return FusedCausalLMOutput(loss=-fields["log_probs"].sum() / count, **fields)


class _FusedHeadTrainer(SequenceParallelTrainer):
    """What DPO and GRPO share: TRL's own loss, training step and evaluation on whole batches, the SP
    split inside the fused head, and the loss scaled so the reduced gradient is the average over DP
    groups of each group's one-process gradient."""

    get_batch_samples = Trainer.get_batch_samples
    evaluation_loop = Trainer.evaluation_loop

    def _eval_loader(self, dataset, description: str):
        """Eval batches go whole to DP groups; transformers' evaluation loop (TRL's metrics) would count the
        padding batches a group runs when the batches do not split evenly, so that is refused."""
        loader = super()._eval_loader(dataset, description)
        batches = loader.batch_sampler.batches
        if self.topo.dp_size > 1 and batches % self.topo.dp_size:
            raise ValueError(f"{description}: {batches} batches of {self.args.eval_batch_size} do not split evenly over {self.topo.dp_size} "
                             "DP groups; TRL's evaluation would count a repeated batch. Pick an eval set or per_device_eval_batch_size "
                             "that does")
        return loader

    def _token_grad_scale(self) -> float:
        """Every rank of an SP group computes the same loss from the gathered fields, and the gather's
        backward sums their gradients (``sp_size`` x each token's); the reduction then sums over SP
        and averages over DP only when this factor undoes what it averages beyond that."""
        return self._gradient_scale(self.model_wrapped) / (self.topo.world_size)

    @staticmethod
    def _check_router_loss(args, model) -> None:
        """Before any collective: TRL adds the MoE load-balancing loss when the model has router logits."""
        if model is not None and args.sp_size > 1 and hasattr(_base_model(model).config.get_text_config(), "output_router_logits") \
                and getattr(args, "router_aux_loss_coef", 0) != 0:
            raise ValueError("the MoE load-balancing loss is not exact under SP (each rank sees its own tokens' routing): "
                             "set router_aux_loss_coef=0")

    def _switch_reference_and_heads(self) -> None:
        """After the TRL trainer's init (which adds its fused heads and makes the reference model): the
        reference model switched like the policy, and both fused heads made sequence parallel."""
        ref = getattr(self.ref_model, "module", self.ref_model)
        if ref is not None:
            if ref.config._attn_implementation == ATTN_IMPLEMENTATION:  # TRL made it like the policy, which SP had switched
                ref.set_attn_implementation(switched_model(self._sp_model).__dict__[_PREVIOUS][0])
            a = self._sp_args
            apply_sequence_parallel(ref, self.topo, backend=backend_names(a.sp_backend), kernel=a.sp_kernel, mixer=a.sp_mixer)
        for model in (self._sp_model, ref):
            if model is not None:
                sequence_parallel_fused_head(model, self.topo, self._token_grad_scale)
        self._tp_size = self.topo.sp_size  # TRL's count of ranks given the same batch (its token counts divide by it)


class SequenceParallelSFTTrainer(SequenceParallelTrainer, SFTTrainer):
    """``trl.SFTTrainer`` with every sequence split over the SP group.

    The loss is the token-weighted NLL (``loss_type="nll"``) of `SequenceParallelTrainer`; TRL's
    collators decide the targets (completion-only and assistant-only loss). TRL's ``entropy`` and
    ``mean_token_accuracy`` are logged over every rank's tokens (not with ``tiled_loss``, which
    builds no logits). Packed rows
    (``packing=True``, ``padding_free=True``) use the balanced layout under ``sp_layout="auto"``.

    Args:
        model: A model, or a hub id or directory loaded as TRL loads it (``model_init_kwargs``).
        args: The SFT config with the SP fields.
        **kwargs: ``trl.SFTTrainer``'s other arguments.

    Raises:
        ValueError: Another ``loss_type``, another kind of arguments, or what
            `SequenceParallelTrainer` refuses.
    """

    def __init__(self, model: torch.nn.Module | str | None = None, args: SequenceParallelSFTConfig | None = None, **kwargs: Any):
        if isinstance(args, SequenceParallelSFTConfig):
            if args.loss_type != "nll":
                raise ValueError(f"SequenceParallelSFTTrainer computes the token-weighted NLL; loss_type={args.loss_type!r} is not supported")
            if args.sp_layout == "auto" and (args.packing or args.padding_free):
                args.sp_layout = "balanced"
            model = _from_path(model, args, kwargs)
        elif args is not None:
            raise ValueError("SequenceParallelSFTTrainer needs args=SequenceParallelSFTConfig(...)")
        super().__init__(model=model, args=args, **kwargs)

    def _token_metrics(self, logits: torch.Tensor, shift_labels: torch.Tensor) -> None:
        """TRL's ``entropy`` and ``mean_token_accuracy`` of the micro-batch: sums over the target tokens of
        every rank (each holds other tokens: its shard of its DP group's rows), as TRL gathers them."""
        with torch.no_grad():
            mask = shift_labels != IGNORE_INDEX
            log_p = torch.log_softmax(logits.float(), dim=-1)
            entropy = -(log_p.exp() * log_p).sum(-1)
            sums = torch.stack([mask.sum(), entropy[mask].sum(), (logits.argmax(-1) == shift_labels)[mask].sum()]).double()
            dist.all_reduce(sums)
        count, entropy_sum, correct = sums.tolist()
        metrics = self._metrics["train" if self.model.training else "eval"]
        metrics["entropy"].append(entropy_sum / count if count else 0.0)
        metrics["mean_token_accuracy"].append(correct / count if count else 0.0)


class SequenceParallelDPOTrainer(_FusedHeadTrainer, DPOTrainer):
    """``trl.DPOTrainer`` with every sequence split over the SP group.

    TRL's own loss code runs unchanged on every rank, on the per-token fields of the whole rows
    (`sequence_parallel_fused_head`). Chosen and rejected rows of a pair are in the same batch, so
    in the same SP group. The reference model (``ref_model``, or the adapter-free model under
    PEFT) runs under SP too.

    Args:
        model: A model, or a hub id or directory loaded as TRL loads it (``model_init_kwargs``).
        ref_model: The reference model, a hub id or directory (loaded like the policy, in its dtype),
            or None (TRL's default).
        args: The DPO config with the SP fields.
        **kwargs: ``trl.DPOTrainer``'s other arguments.

    Raises:
        ValueError: Another kind of arguments, ``precompute_ref_log_probs`` under SP, a MoE
            load-balancing loss (``router_aux_loss_coef`` must be 0), or what
            `SequenceParallelTrainer` refuses.
    """

    compute_loss = DPOTrainer.compute_loss
    training_step = DPOTrainer.training_step
    prediction_step = DPOTrainer.prediction_step

    def __init__(self, model: torch.nn.Module | str | None = None, ref_model: torch.nn.Module | str | None = None,
                 args: SequenceParallelDPOConfig | None = None, **kwargs: Any):
        if not isinstance(args, SequenceParallelDPOConfig):
            raise ValueError("SequenceParallelDPOTrainer needs args=SequenceParallelDPOConfig(...)")
        if args.precompute_ref_log_probs and args.sp_size > 1:
            raise ValueError("precompute_ref_log_probs is not supported under SP (its pass splits the data by rank): "
                             "the reference model runs under SP in each step instead")
        model = _from_path(model, args, kwargs)
        ref_model = _from_path(ref_model, args, kwargs, like=model)
        self._check_router_loss(args, model)
        super().__init__(model=model, ref_model=ref_model, args=args, **kwargs)
        self._switch_reference_and_heads()


class SequenceParallelGRPOTrainer(_FusedHeadTrainer, GRPOTrainer):
    """``trl.GRPOTrainer`` with the training forward split over the SP group.

    Completions are generated on whole sequences (SP removed around ``generate``), and those of
    the SP group's first rank are used by the whole group, so it trains on identical completions.
    The data are split by DP group, not by rank.

    Args:
        model: A model, or a hub id or directory loaded as TRL loads it (``model_init_kwargs``);
            loaded ``from_pretrained`` when ``beta != 0`` (TRL loads the reference model from its path).
        reward_funcs: TRL's reward functions or models.
        args: The GRPO config with the SP fields.
        **kwargs: ``trl.GRPOTrainer``'s other arguments.

    Raises:
        ValueError: Another kind of arguments; under SP, ``use_vllm``, a ``scale_rewards`` other
            than ``group`` or ``none``, a ``multi_objective_aggregation`` other than
            ``sum_then_normalize``, or a MoE load-balancing loss; or what
            `SequenceParallelTrainer` refuses.
    """

    compute_loss = GRPOTrainer.compute_loss
    training_step = GRPOTrainer.training_step
    prediction_step = GRPOTrainer.prediction_step
    _get_train_sampler = GRPOTrainer._get_train_sampler

    def __init__(self, model: torch.nn.Module | str | None = None, reward_funcs: Any = None, args: SequenceParallelGRPOConfig | None = None,
                 **kwargs: Any):
        if not isinstance(args, SequenceParallelGRPOConfig):
            raise ValueError("SequenceParallelGRPOTrainer needs args=SequenceParallelGRPOConfig(...)")
        refused = {
            "use_vllm": args.use_vllm,
            f"scale_rewards={args.scale_rewards!r} (only 'group' and 'none': batch statistics would count each sample once per SP rank)":
                args.scale_rewards not in ("group", "none", False),
            f"multi_objective_aggregation={args.multi_objective_aggregation!r}": args.multi_objective_aggregation != "sum_then_normalize",
        }
        refused = [name for name, on in refused.items() if on and args.sp_size > 1]
        if refused:
            raise ValueError(f"SequenceParallelGRPOTrainer under SP does not support: {', '.join(refused)}")
        model = _from_path(model, args, kwargs)
        self._check_router_loss(args, model)
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, **kwargs)
        self._switch_reference_and_heads()

    def get_train_dataloader(self):
        return self._by_dp_group(GRPOTrainer.get_train_dataloader(self))

    def get_eval_dataloader(self, eval_dataset=None):
        return self._by_dp_group(GRPOTrainer.get_eval_dataloader(self, eval_dataset))

    def _by_dp_group(self, loader):
        """accelerate splits the batches by world rank; the SP ranks of a group share theirs."""
        shard = getattr(loader, "batch_sampler", None)
        if type(shard).__name__ == "BatchSamplerShard":
            shard.num_processes, shard.process_index = self.topo.dp_size, self.topo.dp_rank
        return loader

    def _generate_single_turn(self, *args, **kwargs):
        """Generation on whole sequences (SP removed around it); the group's first rank's completions for all
        (the reference model's forward that follows runs under SP on them)."""
        with self._whole_sequences():
            got = super()._generate_single_turn(*args, **kwargs)
        return self._from_first_sp_rank(got)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every rank, kept for `_generate_and_score_completions`."""
        self._gathered_rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        return self._gathered_rewards

    def _generate_and_score_completions(self, inputs):
        """TRL's, with the logged reward spreads (``reward_std``, ``rewards/*/std``) over each sample once: the
        rewards TRL gathers hold each sample once per SP rank (the means are unchanged by that, the spreads not)."""
        out = super()._generate_and_score_completions(inputs)
        if self.topo.sp_size > 1:
            gathered = self._gathered_rewards
            once = gathered.view(self.topo.world_size, -1, gathered.shape[1])[:: self.topo.sp_size].flatten(0, 1)  # SP groups: consecutive ranks
            metrics = self._metrics["train" if self.model.training else "eval"]
            for i, name in enumerate(self.reward_func_names):
                metrics[f"rewards/{name}/std"][-1] = nanstd(once[:, i]).item()
            rewards = (once * self.reward_weights.to(once.device)).nansum(dim=1)
            rewards[torch.isnan(once).all(dim=1)] = torch.nan  # unscorable rows, as TRL leaves them out
            metrics["reward_std"][-1] = nanstd(rewards).item()
        return out

    def _prepare_inputs(self, generation_batch):
        """The micro-batch of the group's first rank on every rank of the group: TRL shuffles each
        generation batch with the global RNG, whose state the ranks need not share."""
        return self._from_first_sp_rank(super()._prepare_inputs(generation_batch))

    def _from_first_sp_rank(self, value):
        if self.topo.sp_size == 1:
            return value
        held = [value]
        dist.broadcast_object_list(held, src=dist.get_global_rank(self.topo.sp_group, 0), group=self.topo.sp_group)
        return held[0]

    @contextlib.contextmanager
    def _whole_sequences(self):
        remove_sequence_parallel(self._sp_model)
        try:
            yield
        finally:
            self.apply_sequence_parallel()
