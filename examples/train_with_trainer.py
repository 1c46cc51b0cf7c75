"""Fine-tune a causal LM with ``transformers.Trainer`` and sequence parallelism: one extra flag.

A tiny Llama (or Qwen2) is built in code and trained on a generated task (arithmetic token
sequences with noise), so the script runs on a fresh machine with no downloads. The same
script runs under every launcher (2 CPU ranks shown; on GPUs drop ``--use_cpu`` and
``DS_ACCELERATOR=cpu``; accelerate's own ``--cpu`` starts several processes only through mpirun,
so ``--multi_gpu``, torch's launcher, starts the CPU ranks here):

    torchrun --nproc_per_node 2 examples/train_with_trainer.py --sp_size 2 --use_cpu
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \\
        examples/train_with_trainer.py --sp_size 2 --use_cpu
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 examples/train_with_trainer.py --sp_size 2 --use_cpu \\
        --deepspeed examples/ds_zero2.json

Every ``TrainingArguments`` flag works, plus ``--sp_size``, ``--sp_backend`` (auto, a name, or one
per layer), ``--sp_kernel``, ``--ulysses_degree``, ``--tiled_loss``, ``--tiled_mlp``, ``--sp_checkpoint``
and ``--sp_predict_logits``; see ``python examples/train_with_trainer.py --help``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from transformers import HfArgumentParser

from ulysses_sp.integrations.trainer import SequenceParallelTrainer, SequenceParallelTrainingArguments


@dataclass
class ScriptArguments:
    family: str = field(default="llama", metadata={"help": "llama or qwen2 (tiny, randomly initialised)"})
    heads: int = field(default=4, metadata={"help": "query heads (3 shows sp_backend=auto avoiding Ulysses at sp_size 2)"})
    seq_len: int = field(default=256, metadata={"help": "tokens per sample"})
    train_samples: int = 64
    eval_samples: int = 8
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters on q_proj and v_proj only (needs peft)"})
    results: str | None = field(default=None, metadata={"help": "write the loss per step and eval_loss here (JSON, rank 0)"})


class ArithmeticSequences(torch.utils.data.Dataset):
    """Token t+1 = token t + stride (mod vocab), stride 1-3, 10% of tokens replaced by noise."""

    def __init__(self, n: int, seq_len: int, vocab: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        self.items = []
        for _ in range(n):
            start, stride = torch.randint(0, vocab, (2,), generator=g).tolist()
            ids = (start + (stride % 3 + 1) * torch.arange(seq_len)) % vocab
            ids = torch.where(torch.rand(seq_len, generator=g) < 0.1, torch.randint(0, vocab, (seq_len,), generator=g), ids)
            self.items.append({"input_ids": ids, "labels": ids.clone()})

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def tiny_model(script: ScriptArguments):
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[script.family]
    config = config_class(
        vocab_size=64, hidden_size=8 * script.heads * 2, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=script.heads, num_key_value_heads=script.heads if script.heads % 2 else script.heads // 2,
        head_dim=16, max_position_embeddings=4096, attention_dropout=0.0, use_cache=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    if script.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=["q_proj", "v_proj"]))
    return model


def main(argv=None):
    script, args = HfArgumentParser((ScriptArguments, SequenceParallelTrainingArguments)).parse_args_into_dataclasses(argv)
    model = tiny_model(script)
    train = ArithmeticSequences(script.train_samples, script.seq_len, 64, seed=0)
    evaluation = ArithmeticSequences(script.eval_samples, script.seq_len, 64, seed=1)
    trainer = SequenceParallelTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation)
    trainer.train()
    metrics = trainer.evaluate()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.remove_sequence_parallel()  # whole sequences again: generate() works
    prompt = evaluation[0]["input_ids"][:8][None].to(args.device)
    generated = trainer.model.generate(input_ids=prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)[0].tolist()
    topo = trainer.topo
    if topo.rank == 0:
        print(f"world {topo.world_size} = dp {topo.dp_size} x sp {topo.sp_size}; eval_loss {metrics['eval_loss']:.4f}; "
              f"generated {generated[8:]} after {generated[:8]}", flush=True)
        if script.results:
            with open(script.results, "w") as f:
                json.dump({"losses": losses, "eval_loss": metrics["eval_loss"], "world": topo.world_size, "sp_size": topo.sp_size,
                           "deepspeed": bool(args.deepspeed), "generated": generated}, f)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
