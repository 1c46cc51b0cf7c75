"""Supervised fine-tuning with TRL's SFTTrainer and sequence parallelism, on CPU at tiny sizes:

    torchrun --nproc_per_node 2 examples/trl_sft.py --sp_size 2 --use_cpu --output_dir /tmp/trl-sft

Prompt-completion pairs, the loss on the completions only, packed into rows of 512 tokens without
padding (``--packing``; the balanced layout then places each row's documents). Every ``SFTConfig``
flag works, plus the SP ones (``--sp_backend``, ``--tiled_loss``, ...).
"""

import random

import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from trl_common import tiny_model_dir, words
from ulysses_sp.integrations.trl import SequenceParallelSFTConfig, SequenceParallelSFTTrainer

args = HfArgumentParser(SequenceParallelSFTConfig).parse_args_into_dataclasses()[0]
if args.max_length == 1024:  # TRL's default: the tiny model's rows are shorter
    args.max_length = 512
rng = random.Random(0)
data = Dataset.from_list([{"prompt": words(rng, rng.randint(4, 60)), "completion": " " + words(rng, rng.randint(4, 120))}
                          for _ in range(256)])
path = tiny_model_dir()
trainer = SequenceParallelSFTTrainer(model=AutoModelForCausalLM.from_pretrained(path), args=args, train_dataset=data,
                                     processing_class=AutoTokenizer.from_pretrained(path))
trainer.train()
if dist.get_rank() == 0:
    print("losses:", [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])
