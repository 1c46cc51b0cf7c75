"""The main job: train a Hugging Face causal LM with sequence parallelism under DeepSpeed
(or, with ``--engine fsdp2``, under FSDP2: ``job.fsdp_engine``).

``train.py`` at the repository root calls `main`. Runs under the ``deepspeed``
launcher or ``torchrun``; on a machine without CUDA it uses DeepSpeed's CPU accelerator and
gloo. With no ``--model`` / ``--data`` it trains the embedded default: a small Llama-style
model (random init, config below) on byte-level passkey retrieval (``ulysses_sp.tasks``),
and reports how many held-out keys it retrieves. On GPUs each rank binds
``cuda:LOCAL_RANK`` and trains in bf16 by default (DeepSpeed's mixed precision, fp32 master
weights); on CPU in fp32.

One optimizer step is ``accumulation`` micro-steps. The loss of micro-step j is
``sp_cross_entropy(..., count_group=WORLD)`` (its tokens' sum over its global count n_j)
weighted by ``n_j / N``, N the step's global count (one all-reduce before the micro-steps),
so the summed gradient is that of the token-weighted mean over the whole step: the same
update as one big batch. ``gradient_scale`` undoes the engine's averaging.
"""

from __future__ import annotations

import datetime
import math
import os
import resource
import shutil
import sys
import time
import uuid

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import comm
from ..layout import work_imbalance
from ..data import IGNORE_INDEX, gather_sequence, model_inputs, shard_batch, sp_cross_entropy, target_counts
from ..devices import bind_device, check_one_rank_per_device, local_world_size, move_batch
from ..integrations.deepspeed import SequenceParallelMPU, gradient_scale, use_cpu_accelerator_if_needed
from ..loss import causal_lm_loss
from ..tasks import KEY_LENGTH, PAD_ID, VOCAB_SIZE
from ..tiling import compile_layers
from ..topology import init_sequence_parallel
from . import checkpoint, completion_corpus, corpus, image_corpus
from .config import TrainConfig, check_launch, job_layout, memory_options
from .errors import JobError
from .ds_config import load_ds_config, resolve_ds_config
from .export import export_hf
from .metrics import MetricsFile, count_params, flops_per_token, peak_tflops

__all__ = ["Job", "train", "default_model_config"]


def default_model_config():
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1 << 16, pad_token_id=PAD_ID,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},  # Llama 3's long-context scale: far keys stay findable
        bos_token_id=None, eos_token_id=None, tie_word_embeddings=False, use_cache=False,
    )


def cpu_threads(local_world: int) -> int:
    """A CPU rank's threads: its share of the machine's cores, never more than the process was given
    (OMP_NUM_THREADS, torchrun's 1): an OpenMP thread beyond the cores spins waiting for one."""
    return min(torch.get_num_threads(), max(1, (os.cpu_count() or 1) // local_world))


def _has_weights(path: str | None) -> bool:
    return bool(path) and os.path.isdir(path) and any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def build_model(cfg: TrainConfig):
    import transformers

    auto = transformers.AutoModelForImageTextToText if image_corpus.is_image_text(cfg.model) else transformers.AutoModelForCausalLM
    if _has_weights(cfg.model) and not cfg.from_scratch:
        return auto.from_pretrained(cfg.model, local_files_only=True, dtype=torch.float32)
    config = default_model_config() if cfg.model is None else transformers.AutoConfig.from_pretrained(cfg.model, local_files_only=True)
    torch.manual_seed(cfg.seed)
    return auto.from_config(config).float()


def packing_problem(cfg: TrainConfig, model) -> str | None:
    """Why ``model`` cannot train on the rows ``cfg`` makes (packed: the passkey task's, --data with --packing, --task
    dpo's pairs), or None."""
    from ..models.token_mixers import packing_refused

    refused = packing_refused(model)
    if refused is None or (cfg.data and not cfg.packing and cfg.task != "dpo"):
        return None
    if cfg.task == "dpo":
        return f"{refused}; --task dpo puts each pair's two replies in one row, so it cannot train this model"
    if cfg.data is None:
        return f"{refused}; the passkey task packs its documents, so train it on --data with --no-packing"
    return f"{refused}: add --no-packing"


def _peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # peak resident set (Linux: KiB)


def _size(path: str) -> int:
    """Bytes of a file, or of every file under a directory."""
    if not os.path.isdir(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def _find_checkpoint(cfg: TrainConfig) -> tuple[tuple[str, str, dict | None] | None, list[str]]:
    """Rank 0: ((directory, tag, manifest) to resume from, or None to start fresh; lines to print).
    ``--resume latest`` or a ``--save`` directory: its newest complete and intact checkpoint; a
    checkpoint's own directory: that one, refused if torn (one without a manifest, from another
    tool, is loaded unverified, with a warning)."""
    if cfg.resume is None:
        return None, []
    directory = cfg.save if cfg.resume == "latest" else cfg.resume
    if cfg.resume == "latest" or os.path.exists(os.path.join(directory, checkpoint.LATEST)) or not any(
            f.endswith("model_states.pt") for f in os.listdir(directory)):
        tag, manifest, skipped = checkpoint.find_resumable(directory)
        notes = [f"--resume: skipped checkpoint {line}" for line in skipped]
        if tag is None:
            if cfg.resume != "latest":
                raise JobError(f"--resume {cfg.resume}: no complete checkpoint there" + (f" ({'; '.join(skipped)})" if skipped else ""))
            legacy = [line.split(":")[0] for line in skipped if "no manifest" in line and "named by latest" not in line]
            hint = f" (one without a manifest loads unverified when named: --resume {os.path.join(directory, legacy[0])})" if legacy else ""
            return None, notes + [f"--resume latest: no complete checkpoint in {cfg.save} yet; starting at step 0{hint}"]
        return (directory, tag, manifest), notes + [f"--resume: checkpoint {tag} (step {manifest['step']}) in {directory}"]
    directory, tag = os.path.split(os.path.abspath(cfg.resume))
    manifest, why = checkpoint.inspect(directory, tag)
    if manifest is not None:
        return (directory, tag, manifest), [f"--resume: checkpoint {tag} (step {manifest['step']}) in {directory}"]
    if not why.startswith("no manifest"):
        raise JobError(f"--resume {cfg.resume}: the checkpoint is not intact: {why}")
    return (directory, tag, None), [f"--resume {cfg.resume}: no manifest, so neither its files nor its settings can be checked; loading it as it is "
                               "(the engine's loader unpickles its files: resume only checkpoints you trust)"]


def key_scores(logits_local: torch.Tensor, answers_local: torch.Tensor, topo) -> torch.Tensor:
    """This rank's share of (prompts retrieved, key digits right, key digits, key loss sum) for a
    batch whose ``answers_local`` holds the key's targets (the rest ignored); summed over the world
    they are the totals. A prompt is retrieved when the argmax is right at every key position
    across its SP group. Collective over the SP group."""
    answer = answers_local != IGNORE_INDEX
    right = (logits_local.argmax(-1) == answers_local) & answer
    has_key, misses = comm.all_reduce_sum(torch.stack([answer.sum(dim=1), (answer & ~right).sum(dim=1)]).double(), topo.sp_group)
    retrieved = ((misses == 0) & (has_key > 0)).sum() if topo.sp_rank == 0 else torch.zeros((), device=answer.device)  # once per group
    loss = F.cross_entropy(logits_local[answer].float(), answers_local[answer], reduction="sum")
    return torch.stack([retrieved.double(), right.sum().double(), answer.sum().double(), loss.double()]).cpu()


class Job:
    """One training run: set up in the constructor (checks first, then process groups, model,
    engine), then `fit`, `evaluate`, `export`, `close`."""

    def __init__(self, cfg: TrainConfig):
        fsdp2 = cfg.engine == "fsdp2"
        if not fsdp2:
            use_cpu_accelerator_if_needed()

        from ..models.switch import apply_sequence_parallel
        from ..models.token_mixers import check_supported, mixer_layers
        from ..models.verify import SequenceParallelMismatch, verify_sequence_parallel

        self.cfg = cfg
        on_gpu = torch.cuda.is_available()
        # every check that needs no process group, so a mistake fails at once, the same on every rank
        world = int(os.environ.get("WORLD_SIZE", "1"))
        sp_size = check_launch(cfg, world)
        self.ds = resolve_ds_config(cfg, load_ds_config(cfg.deepspeed), dp_size=world // sp_size, sp_size=sp_size, on_gpu=on_gpu,
                                    pretrained=_has_weights(cfg.model) and not cfg.from_scratch)
        if cfg.compile and not fsdp2 and self.ds.zero_stage == 3:
            raise JobError("--compile with ZeRO-3: its parameter hooks run inside every layer, where torch.compile cannot trace them; "
                           "use --zero-stage 2 or --engine fsdp2")
        if not fsdp2 and self.ds.zero_stage == 3 and image_corpus.is_image_text(cfg.model):
            raise JobError(f"an image-text --model with ZeRO-3: each image is encoded on one rank, while ZeRO-3 gathers a module's weights "
                           "on every rank at each of its calls; use ZeRO stage 1 or 2 (--zero-stage, or zero_optimization.stage in --deepspeed)")
        self.processor = image_corpus.load_processor(cfg.model) if image_corpus.is_image_text(cfg.model) else None
        self.tokenizer = self.processor.tokenizer if self.processor is not None else corpus.load_tokenizer(cfg)
        if cfg.model and os.path.isdir(cfg.model) and not _has_weights(cfg.model) and not cfg.from_scratch:
            raise JobError(f"--model {cfg.model}: no weight files (*.safetensors, *.bin) there; to train this architecture from "
                           "random weights, add --from-scratch")
        first = int(os.environ.get("RANK", "0")) == 0
        self.train_rows, self.eval_rows = (self._rows(path, first) if path else None for path in (cfg.data, cfg.eval_data))

        self.device = bind_device()  # cuda:LOCAL_RANK before NCCL starts; CPU without CUDA
        timeout = datetime.timedelta(seconds=cfg.dist_timeout)
        if fsdp2:
            if not dist.is_initialized():
                dist.init_process_group("nccl" if on_gpu else "gloo", timeout=timeout)
        else:
            import deepspeed

            deepspeed.init_distributed(dist_backend="nccl" if on_gpu else "gloo", timeout=timeout)
        check_one_rank_per_device(dist.group.WORLD, self.device)
        if not on_gpu:
            torch.set_num_threads(cpu_threads(local_world_size(default=dist.get_world_size())))
        self.layout = job_layout(cfg)
        self.topo = topo = init_sequence_parallel(sp_size, ulysses_degree=cfg.ulysses_degree, layout=self.layout, profile=cfg.profile,
                                                  timeout=cfg.dist_timeout)
        self.rank0 = topo.rank == 0
        self.io_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=cfg.io_timeout))
        """Waits while rank 0 writes files (checkpoints, export): their own timeout, on CPU whatever the device."""
        dist.barrier(group=self.io_group)  # every rank's end of its connections is up before one may refuse the job and drop them
        self.resume_state = {"seq_len": cfg.seq_len, "packing": cfg.packing, "data": cfg.data and os.path.abspath(cfg.data),
                             "data_bytes": cfg.data and _size(cfg.data),
                             "data_mtime": cfg.data and int(os.path.getmtime(cfg.data)), "seed": cfg.seed, "micro_batch": self.ds.micro_batch,
                             "grad_accum": self.ds.grad_accum, "sp_size": topo.sp_size, "dp_size": topo.dp_size, "steps": cfg.steps,
                             "lr": self.ds.lr, "warmup_steps": self.ds.warmup_steps, "min_lr_ratio": cfg.min_lr_ratio, "engine": cfg.engine}
        """What decides the data and the schedule: a resume with any of it changed is refused."""
        self.run = uuid.uuid4().hex  # rank 0's names the checkpoints of this run (kept across resumes)
        resume = self._checkpoint_to_resume() if cfg.resume is not None or cfg.save else None  # checked before the model is built
        self.batches = (corpus.TrainBatches(self.train_rows, topo, self.ds.micro_batch, cfg.seed) if self.train_rows is not None
                        else corpus.passkey_train_batches(cfg, topo, self.ds.micro_batch, self.ds.grad_accum))

        model = build_model(cfg)
        try:  # before anything reads the config: a model SP does not cover stops here, on every rank
            check_supported(model, topo, cfg.sp_mixer)
        except ValueError as e:
            raise JobError(str(e)) from None
        if problem := packing_problem(cfg, model):
            raise JobError(problem)
        text_config = model.config.get_text_config()
        if self.tokenizer is not None and len(self.tokenizer) > text_config.vocab_size:
            raise JobError(f"the tokenizer has {len(self.tokenizer)} tokens, the model's vocabulary {text_config.vocab_size}; use the model's own tokenizer")
        self.pad_id = corpus.pad_id(self.tokenizer)
        self.flops_per_token = flops_per_token(text_config, count_params(model), cfg.seq_len)
        self.memory, self.memory_why = memory_options(cfg, text_config, topo.sp_size, on_gpu)
        if cfg.task == "dpo":
            if self.ds.micro_batch != 1:
                raise JobError(f"--task dpo trains one packed row per micro-batch (its pairs' log-probabilities are summed per document); "
                               f"the micro batch is {self.ds.micro_batch}: set train_micro_batch_size_per_gpu to 1 and pack more pairs per row "
                               "(--seq-len) or accumulate (--gradient-accumulation-steps)")
            self.memory["tiled_loss"], self.memory_why["tiled_loss"] = False, "--task dpo reads log-probabilities from the logits"
        backend = cfg.sp_backend.split(",") if "," in cfg.sp_backend else cfg.sp_backend
        self.verify_report = None
        try:
            if cfg.verify:
                self.verify_report = verify_sequence_parallel(model.config, topo, backend=backend, mixer=cfg.sp_mixer)
                if self.rank0:
                    print(f"verify: {self.verify_report}", flush=True)
            model = apply_sequence_parallel(model, topo, backend=backend, kernel=cfg.sp_kernel, tiled_mlp=self.memory["tiled_mlp"],
                                            checkpoint=self.memory["checkpoint"], mixer=cfg.sp_mixer, tiled_norms=self.memory["tiled_norms"])
        except (ValueError, SequenceParallelMismatch) as e:  # the same on every rank: uncovered layers, or SP not exact
            raise JobError(str(e)) from None
        model.train()
        if cfg.compile:  # hybrid models' mixers run eagerly between compiled graphs
            compile_layers(model, fullgraph=not mixer_layers(model))
        self.start, self.resumed, self.last_checkpoint = 0, None, None
        if fsdp2:
            from .fsdp_engine import FSDP2Engine

            self.engine = FSDP2Engine(model, topo, lr=self.ds.lr, weight_decay=cfg.weight_decay, warmup_steps=self.ds.warmup_steps,
                                      steps=cfg.steps, min_lr_ratio=cfg.min_lr_ratio, grad_accum=self.ds.grad_accum,
                                      clip=float(self.ds.config.get("gradient_clipping", 0.0)), dtype=self.ds.dtype)
            self.scale = 1.0  # reduce-scatters sum (divide factor 1): the loss is counted over the world
        else:
            self._deepspeed_engine(model)
        self.reference = self._reference_logps() if cfg.task == "dpo" else None  # the initial model's, also when resuming
        if resume is not None:
            self._load(*resume[:2])
        self.metrics = MetricsFile(cfg.metrics_file, self.rank0, keep_through=self.start if self.resumed else None)
        self.peak = peak_tflops(self.device, self.ds.dtype, cfg.peak_tflops)

    def _rows(self, path: str, progress: bool):
        say = (lambda line: print(line, flush=True)) if progress else None
        if self.cfg.task != "lm":
            return completion_corpus.CompletionRows(path, self.tokenizer, self.cfg.seq_len, corpus.pad_id(self.tokenizer),
                                                    packing=self.cfg.packing, task=self.cfg.task, say=say)
        if self.processor is None:
            return corpus.build_rows(path, self.tokenizer, self.cfg, progress=progress)
        return image_corpus.ImageRows(path, self.processor, self.cfg.seq_len, corpus.pad_id(self.tokenizer), packing=self.cfg.packing, say=say)

    def _deepspeed_engine(self, model) -> None:
        import deepspeed

        cfg, topo = self.cfg, self.topo
        extra = {}
        if not self.ds.ds_optimizer:
            extra["optimizer"] = torch.optim.AdamW(model.parameters(), lr=self.ds.lr, weight_decay=cfg.weight_decay)
        if not self.ds.ds_scheduler:
            from transformers import get_cosine_with_min_lr_schedule_with_warmup

            extra["lr_scheduler"] = lambda optimizer: get_cosine_with_min_lr_schedule_with_warmup(
                optimizer, self.ds.warmup_steps, cfg.steps, min_lr_rate=cfg.min_lr_ratio)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters() if self.ds.ds_optimizer else None,
                                               config=self.ds.config, mpu=SequenceParallelMPU(topo), **extra)
        self.scale = gradient_scale(self.engine, topo)  # undoes the averaging of this ZeRO stage

    # -- losses ------------------------------------------------------------------------------

    def _local(self, batch: dict) -> dict:
        return move_batch(shard_batch(batch, self.topo, pad_token_id=self.pad_id), self.topo.device)  # shard on CPU, move this rank's part

    def _logits(self, local: dict) -> torch.Tensor:
        return self.engine(**model_inputs(local)).logits

    def _loss(self, local: dict) -> torch.Tensor:
        """Its tokens' loss sum over their count in the whole world (the same on every rank)."""
        if self.memory["tiled_loss"]:
            return causal_lm_loss(self.engine, local, self.topo, count_group=dist.group.WORLD)
        return sp_cross_entropy(self._logits(local), local["shift_labels"], self.topo, count_group=dist.group.WORLD)

    def _weights(self, locals_: list[dict]) -> tuple[torch.Tensor, int]:
        """``n_j / N`` per micro-batch (global valid targets), and N."""
        counts = target_counts(locals_, dist.group.WORLD, self.topo.device).cpu()
        total = float(counts.sum())
        return counts / max(total, 1.0), int(total)

    def _pair_logps(self, batch: dict, local: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) summed log-probabilities of the row's pairs ``[pairs]``, the same on every rank
        of the SP group; differentiable to this rank's tokens (`ulysses_sp.rl.sequence_logprobs`)."""
        from .. import rl

        logps, _ = rl.sequence_logprobs(self._logits(local), local, self.topo)
        docs = int(batch["documents"][0])
        return logps[0:docs:2], logps[1:docs:2]

    def _reference_logps(self) -> list[torch.Tensor]:
        """``--task dpo``: every train row's (chosen, rejected) log-probabilities under the model as built (the
        reference), before any step or resume: one forward per row, on every DP group."""
        rows, out, start = self.train_rows, [], time.perf_counter()
        self.engine.eval()  # as a reference model runs: no dropout
        with torch.no_grad():
            for i in range(len(rows)):
                batch = rows.batch([i])
                out.append(torch.stack(self._pair_logps(batch, self._local(batch))).cpu())
                if self.rank0 and (i + 1) % max(1, len(rows) // 10) == 0:
                    print(f"reference log-probabilities: {i + 1}/{len(rows)} rows ({time.perf_counter() - start:.0f} s)", flush=True)
        self.engine.train()
        return out

    def _dpo_step(self, step: int) -> float:
        """DPO's sigmoid loss, the mean over every pair of the step's micro-batches and DP groups."""
        accum = self.ds.grad_accum
        drawn = [self.batches.indices(step * accum + j) for j in range(accum)]
        pairs = torch.tensor([self.train_rows.documents(d[0]) / 2 for d in drawn], dtype=torch.float64)
        total = float(comm.all_reduce_sum(pairs.sum().to(self.topo.device), self.topo.dp_group)) if self.topo.dp_size > 1 else float(pairs.sum())
        value = 0.0
        for d in drawn:
            batch = self.train_rows.batch(d)
            chosen, rejected = self._pair_logps(batch, self._local(batch))
            ref = self.reference[d[0]].to(chosen.device, chosen.dtype)
            loss = -F.logsigmoid(self.cfg.beta * ((chosen - ref[0]) - (rejected - ref[1]))).sum() / total
            self.engine.backward(loss * self.scale, scale_wrt_gas=False)
            self.engine.step()
            value += loss.item()
        if self.topo.dp_size > 1:
            value = float(comm.all_reduce_sum(torch.tensor(value, dtype=torch.float64, device=self.topo.device), self.topo.dp_group))
        self.work_imbalance = None
        return self._from_rank0(value)

    # -- training ----------------------------------------------------------------------------

    def step(self, step: int) -> float:
        """One optimizer step (``step`` counts from 0); returns its loss, the same on every rank."""
        if self.cfg.task == "dpo":
            return self._dpo_step(step)
        accum = self.ds.grad_accum
        locals_ = [self._local(self.batches(step * accum + j)) for j in range(accum)]
        weights, targets = self._weights(locals_)
        if targets == 0:  # all padding: an optimizer step would still move the weights (momentum, decay)
            self.work_imbalance = None
            return float("nan")
        length = locals_[0]["input_ids"].shape[1] * self.topo.sp_size
        self.work_imbalance = max(work_imbalance(self.layout, length, self.topo.sp_size, local.get("cu_seqlens")) for local in locals_)
        value = 0.0
        for j, (local, weight) in enumerate(zip(locals_, weights.tolist())):
            loss = self._loss(local)
            bad = comm.all_reduce_sum(torch.isfinite(loss.detach()).logical_not().double().reshape(1), dist.group.WORLD)
            if bad.item():  # the same on every rank: all stop here, before anything steps or saves
                raise JobError(f"step {step + 1}: the loss of micro-batch {j + 1} is not finite on {int(bad.item())} of "
                               f"{self.topo.world_size} ranks; stopped before the optimizer step, so nothing was trained on it "
                               "or saved. Lower --lr, check the data, or train in bf16 or fp32 rather than fp16. The last "
                               f"checkpoint: {self.last_checkpoint or 'none'}" + (" (--resume latest restarts there)" if self.last_checkpoint else ""))
            self.engine.backward(loss * (weight * self.scale), scale_wrt_gas=False)
            self.engine.step()
            value += loss.item() * weight
        return self._from_rank0(value)

    def _from_rank0(self, value: float) -> float:
        """Rank 0's value on every rank: each rank's copy of a global loss differs in the last bits."""
        mine = torch.tensor([value if self.rank0 else 0.0], dtype=torch.float64, device=self.topo.device)
        return float(comm.all_reduce_sum(mine, dist.group.WORLD))

    def fit(self) -> list[float]:
        """Train from ``self.start`` to ``cfg.steps``, evaluating and checkpointing on the way;
        returns the loss of every step run."""
        cfg, topo = self.cfg, self.topo
        if self.rank0:
            data = "passkey task (byte-level)" if cfg.data is None else f"{cfg.data} ({len(self.train_rows)} rows, {'packed' if cfg.packing else 'padded'})"
            print(f"ulysses-sp: world {topo.world_size} = dp {topo.dp_size} x sp {topo.sp_size}, backend {cfg.sp_backend}, "
                  f"kernel {cfg.sp_kernel}, on {topo.device}, seq {cfg.seq_len}, steps {self.start}..{cfg.steps}, data {data}", flush=True)
            print(f"{cfg.engine}: " + self.ds.describe(without=("ZeRO stage",) if cfg.engine == "fsdp2" else ()), flush=True)
            print("memory: " + ", ".join(f"{name} {value} ({self.memory_why[name]})" for name, value in self.memory.items()), flush=True)
        from tqdm import tqdm

        # the bar only on a terminal; logs get the per-step lines alone
        progress = tqdm(total=cfg.steps - self.start, desc="train", unit="step", file=sys.stdout, dynamic_ncols=True,
                        disable=not (self.rank0 and sys.stdout.isatty()))
        say = progress.write if self.rank0 else (lambda line: None)
        tokens_per_step = cfg.seq_len * self.ds.micro_batch * self.ds.grad_accum * topo.dp_size
        losses = []
        for step in range(self.start, cfg.steps):
            t0 = time.perf_counter()
            lr = self.engine.get_lr()[0]
            losses.append(self.step(step))
            seconds = time.perf_counter() - t0
            peaks = [m[0] for m in comm.all_gather_ints((_peak_memory_bytes(topo.device) // 2**20,), dist.group.WORLD, topo.device)]
            if step == self.start:
                from ..models.token_mixers import mixer_layers
                from ..models.switch import chosen_backends

                say(f"layout: {self.layout}" + (" (packed documents placed by work)" if self.layout == "balanced" else ""))
                say("backend per layer: " + ", ".join(f"{i}: {','.join(b)}" for i, b in sorted(chosen_backends(self.engine.module).items())))
                mixers = mixer_layers(self.engine.module)
                if mixers:
                    say(f"token mixers: {len(mixers)} under {', '.join(sorted(set(mixers.values())))} ({', '.join(mixers)})")
            tflops = tokens_per_step * self.flops_per_token / seconds / topo.world_size / 1e12
            mfu = tflops / self.peak if self.peak else None
            loss = "no targets: no optimizer step" if math.isnan(losses[-1]) else f"{losses[-1]:.4f}"
            say(f"step {step + 1:4d}  loss {loss}  lr {lr:.2e}  {tokens_per_step / seconds:8.0f} tokens/s  "
                + (f"MFU {mfu:.1%}  " if mfu is not None else "") + f"peak memory per rank {', '.join(f'{m} MiB' for m in peaks)}")
            self.metrics.write(step=step + 1, loss=losses[-1], lr=lr, tokens_per_s=tokens_per_step / seconds, tflops_per_rank=tflops,
                               mfu=mfu, peak_memory_mib=peaks, tokens=tokens_per_step * (step + 1), work_imbalance=self.work_imbalance,
                               skipped_steps=self.engine.skipped_steps)
            progress.update(1)
            done = step + 1
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.steps:
                self.report_eval(done, say)
            if cfg.save_every and done % cfg.save_every == 0 and done < cfg.steps:
                self.save(done)
        progress.close()
        if self.has_eval:
            self.report_eval(cfg.steps, print if self.rank0 else (lambda line: None))
        if cfg.save and not (self.resumed and self.start == cfg.steps):  # resuming a finished run saves nothing over it
            self.save(cfg.steps)
        return losses

    def _checkpoint_to_resume(self) -> tuple[str, str, dict | None] | None:
        """(directory, tag, manifest) of the checkpoint rank 0 found (``_find_checkpoint``), after
        every rank has checked it can read it and that the settings that decide the data and the
        schedule are those it was trained with (``--steps`` may grow); None to start fresh. A fresh
        run (no ``--resume``) into a ``--save`` that holds checkpoints is refused."""
        found, error = None, None
        if self.rank0:
            try:
                if self.cfg.resume is None and checkpoint.existing(self.cfg.save):
                    raise JobError(f"--save {self.cfg.save} already holds checkpoints ({', '.join(checkpoint.existing(self.cfg.save)[:4])}): "
                                   "continue that run with --resume latest, or give a new --save directory")
                found, notes = _find_checkpoint(self.cfg)
                for line in notes:
                    print(line, flush=True)
            except JobError as e:
                error = str(e)
        found, error = comm.broadcast_object((found, error), src=0, group=self.io_group)
        if error:
            raise JobError(error)
        if found is None:
            return None
        directory, tag, manifest = found
        seen = comm.all_gather_ints((int(os.path.isdir(os.path.join(directory, tag))),), dist.group.WORLD, self.topo.device)
        unseen = [r for r, (ok,) in enumerate(seen) if not ok]
        if unseen:
            raise JobError(f"--resume: ranks {unseen} cannot see {os.path.join(directory, tag)}; checkpoints need a file system every rank shares")
        if manifest is not None:
            changed = checkpoint.resume_mismatches({"engine": "deepspeed", **manifest.get("resume", {})}, self.resume_state)
            if changed:
                raise JobError(f"--resume: checkpoint {tag} was trained with other settings, and continuing would train on other data "
                               f"or another schedule: {'; '.join(changed)}. Resume with the same settings (--steps may grow), or start a new run "
                               "(another --save directory, no --resume).")
            self.run = manifest.get("run", self.run)
        return found

    def _load(self, directory: str, tag: str) -> None:
        """The engine's, the RNG's and the schedule's state from checkpoint ``tag``; every rank must
        have loaded the same step."""
        path, client = self.engine.load_checkpoint(directory, tag)
        if path is None:
            raise JobError(f"--resume: the {self.cfg.engine} engine found no checkpoint {tag} in {directory}")
        checkpoint.load_rng(directory, tag, self.topo.rank)
        sched = self.engine.lr_scheduler
        if not self.ds.ds_scheduler and hasattr(sched, "lr_lambdas"):  # ours, planned for this run's --steps
            # the optimizer's state holds the rate the checkpoint's plan set for the next step: take this plan's
            for group, base, fn in zip(sched.optimizer.param_groups, sched.base_lrs, sched.lr_lambdas):
                group["lr"] = base * fn(sched.last_epoch)
        self.start, self.resumed, self.last_checkpoint = int(client["step"]), tag, os.path.join(directory, tag)
        steps = {s for (s,) in comm.all_gather_ints((self.start,), dist.group.WORLD, self.topo.device)}
        if len(steps) > 1:
            raise JobError(f"--resume: the ranks loaded checkpoints of different steps {sorted(steps)} from {self.last_checkpoint}")

    def save(self, step: int) -> None:
        """Checkpoint step ``step`` in ``--save`` crash-safely (``job.checkpoint``: written aside,
        flushed, a manifest last, renamed, then ``latest``); keeps the newest ``--keep-last``."""
        directory = self.cfg.save
        if self.rank0:  # a crashed save's leftovers, cleared before anyone writes there
            os.makedirs(directory, exist_ok=True)
            shutil.rmtree(os.path.join(directory, checkpoint.partial_tag(step)), ignore_errors=True)
        dist.barrier(group=self.io_group)
        self.engine.save_checkpoint(directory, tag=checkpoint.partial_tag(step), client_state={"step": step}, save_latest=False)
        checkpoint.save_rng(directory, step, self.topo.rank)
        dist.barrier()  # every rank's files are written
        tag = None
        if self.rank0:
            tag = checkpoint.finish(directory, step, {"run": self.run, "resume": self.resume_state})
            for line in checkpoint.rotate(directory, self.cfg.keep_last, self.run, {tag}):
                print(f"warning: {line}", flush=True)
            print(f"checkpoint {tag} written to {directory}", flush=True)
        tag = comm.broadcast_object(tag, src=0, group=self.io_group)  # nobody goes on, or exits, before it is in place
        self.last_checkpoint = os.path.join(directory, tag)

    # -- eval --------------------------------------------------------------------------------

    @property
    def has_eval(self) -> bool:
        return self.eval_rows is not None or self.cfg.data is None

    @torch.no_grad()
    def evaluate(self) -> dict:
        """The exact eval loss over the held-out data (token-weighted over every DP group, the
        same as one process on the same tokens) and, for the passkey task, the share of prompts
        whose key the model retrieves. The same on every rank."""
        if not self.has_eval:
            raise JobError("evaluate: no held-out data; pass --eval-data")
        passkey = self.eval_rows is None
        batches = (corpus.passkey_eval_batches(self.cfg, self.topo) if passkey
                   else corpus.eval_batches(self.eval_rows, self.topo, 1 if self.cfg.packing else self.ds.micro_batch))
        self.engine.eval()
        locals_ = [self._local(b) for b in batches]
        weights, tokens = self._weights(locals_)
        loss, scores = 0.0, torch.zeros(4, dtype=torch.float64)
        for batch, local, weight in zip(batches, locals_, weights.tolist()):
            if passkey:
                logits = self._logits(local)
                loss += sp_cross_entropy(logits, local["shift_labels"], self.topo, count_group=dist.group.WORLD).item() * weight
                answers = self._local({"input_ids": batch["input_ids"], "labels": batch["answer_labels"]})["shift_labels"]
                scores += key_scores(logits, answers, self.topo)
            else:
                loss += self._loss(local).item() * weight
        self.engine.train()
        loss = self._from_rank0(loss)
        result = {"eval_loss": loss, "eval_tokens": tokens}
        if passkey:
            retrieved, right, digits, key_loss = comm.all_reduce_sum(scores.to(self.topo.device), dist.group.WORLD).tolist()
            result.update(passkey_accuracy=retrieved / self.cfg.eval_samples, key_digit_accuracy=right / digits, key_loss=key_loss / digits)
        return result

    def report_eval(self, step: int, say) -> dict:
        result = self.evaluate()
        line = f"eval after step {step}: loss {result['eval_loss']:.4f} over {result['eval_tokens']} tokens"
        if "passkey_accuracy" in result:
            line += (f" (chance {math.log(VOCAB_SIZE):.2f}: any byte equally likely)"
                     f"; passkey retrieved in {result['passkey_accuracy']:.1%} of {self.cfg.eval_samples} held-out prompts (each key on "
                     f"other ranks than its answer; chance {0.1 ** KEY_LENGTH:.3%}), key symbols right {result['key_digit_accuracy']:.1%} "
                     f"(chance 10%) and key loss {result['key_loss']:.2f} (chance {math.log(10):.2f})")
        say(line)
        self.metrics.write(step=step, **result)
        return result

    # -- output ------------------------------------------------------------------------------

    @torch.no_grad()
    def full_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The engine's logits for whole sequences ``[B, S]``, gathered into global order on every rank."""
        self.engine.eval()
        local = self._local({"input_ids": input_ids})
        logits = gather_sequence(self._logits(local), self.topo, cu_seqlens=local.get("cu_seqlens"))[:, : input_ids.shape[1]]
        self.engine.train()
        return logits

    def export(self, path: str) -> None:
        export_hf(self.engine, path, self.processor or self.tokenizer, wait_group=self.io_group)
        if self.rank0:
            print(f"Hugging Face model written to {path}", flush=True)

    def close(self, destroy_process_group: bool = True) -> None:
        self.engine.destroy()
        dist.barrier()  # gloo aborts at exit when a rank tears down while another still talks
        if destroy_process_group:
            dist.destroy_process_group()


def train(cfg: TrainConfig) -> list[float]:
    """Run the job; returns the loss of every step run (on every rank)."""
    job = Job(cfg)
    losses = job.fit()
    if cfg.export_hf:
        job.export(cfg.export_hf)
    job.close()
    return losses

