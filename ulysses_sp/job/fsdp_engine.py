"""``--engine fsdp2``: what the job uses of a DeepSpeed engine, over a model sharded with FSDP2.

The model is sharded by `ulysses_sp.integrations.fsdp.apply_fsdp2` over every rank with
gradient divide factor 1: the job's loss is counted over the world, so the exact gradient is the
plain sum (``gradient_scale`` is 1). Like DeepSpeed's engine, `FSDP2Engine.step` is called
after every micro-step and steps the optimizer (after clipping) and the scheduler at the last one
of each accumulation window. bf16 trains with bf16 parameters in compute and fp32 reductions and
master weights (``MixedPrecisionPolicy``); fp16, which needs a loss scaler, is DeepSpeed's only.

Checkpoints are ``torch.distributed.checkpoint`` directories (every rank writes its shards) with
rank 0's ``engine_state.pt`` beside them (scheduler, micro-step count, the job's client state: plain
values, read back with ``weights_only=True``; DCP's own ``.metadata`` is a pickle that its loader reads):
the job's crash-safe protocol (written aside, manifest last, renamed) wraps them as it wraps
DeepSpeed's.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

__all__ = ["FSDP2Engine"]

ENGINE_STATE = "engine_state.pt"


class FSDP2Engine:
    def __init__(self, model, topo, *, lr: float, weight_decay: float, warmup_steps: int, steps: int, min_lr_ratio: float,
                 grad_accum: int, clip: float, dtype: str):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        from transformers import get_cosine_with_min_lr_schedule_with_warmup

        from ..integrations.fsdp import apply_fsdp2

        self.architecture = type(model).__name__  # fully_shard renames the class (FSDPLlamaForCausalLM)
        options = {}
        if dtype == "bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        self.module = apply_fsdp2(model, topo, gradient_divide_factor=1, **options)
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        self.lr_scheduler = get_cosine_with_min_lr_schedule_with_warmup(self.optimizer, warmup_steps, steps, min_lr_rate=min_lr_ratio)
        self.grad_accum, self.clip, self.micro_steps = grad_accum, clip, 0
        self.skipped_steps = 0  # no loss scaler: no step is skipped
        self.dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        """What the model computes in (its parameters stay float32, the master weights): what ``--export-hf`` writes."""

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = False) -> None:
        loss.backward()  # the job weights each micro-step itself, as with DeepSpeed's scale_wrt_gas=False

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.grad_accum:
            return
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)  # the norm over every shard
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)

    def get_lr(self) -> list[float]:
        return [group["lr"] for group in self.optimizer.param_groups]

    def train(self) -> None:
        self.module.train()

    def eval(self) -> None:
        self.module.eval()

    def save_checkpoint(self, directory: str, tag: str, client_state: dict, save_latest: bool = False) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        path = os.path.join(directory, tag)
        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
        if dist.get_rank() == 0:
            torch.save({"scheduler": self.lr_scheduler.state_dict(), "micro_steps": self.micro_steps, "client": client_state},
                       os.path.join(path, ENGINE_STATE))

    def load_checkpoint(self, directory: str, tag: str) -> tuple[str | None, dict | None]:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        path = os.path.join(directory, tag)
        if not os.path.isfile(os.path.join(path, ENGINE_STATE)):
            return None, None
        model_state, optimizer_state = get_state_dict(self.module, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        extra = torch.load(os.path.join(path, ENGINE_STATE), weights_only=True)  # numbers and lists: nothing to unpickle
        self.lr_scheduler.load_state_dict(extra["scheduler"])
        self.micro_steps = extra["micro_steps"]
        return path, extra["client"]

    def full_state_dict(self) -> dict | None:
        """The whole model's state on rank 0's CPU (None elsewhere), its floating tensors in the
        dtype the model computes in, as DeepSpeed's bf16 module holds them. Collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank():
            return None
        return {k: v.to(self.dtype) if v.is_floating_point() else v for k, v in state.items()}

    def destroy(self) -> None:
        pass
