"""Preference optimisation with TRL's DPOTrainer and sequence parallelism, on CPU at tiny sizes:

    torchrun --nproc_per_node 2 examples/trl_dpo.py --sp_size 2 --use_cpu --output_dir /tmp/trl-dpo

The chosen reply continues the prompt's pattern, the rejected one does not. The reference model is a
second copy, run under SP too; every ``DPOConfig`` flag works (``--loss_type ipo``, ``--ld_alpha``, ...).
"""

import random

import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from trl_common import tiny_model_dir, words
from ulysses_sp.integrations.trl import SequenceParallelDPOConfig, SequenceParallelDPOTrainer

args = HfArgumentParser(SequenceParallelDPOConfig).parse_args_into_dataclasses()[0]
rng = random.Random(0)
rows = []
for _ in range(128):
    prompt = words(rng, rng.randint(4, 60))
    last = int(prompt.split()[-1][1:])
    chosen = " ".join(f"w{(last + 3 * (i + 1)) % 40}" for i in range(rng.randint(4, 100)))
    rows.append({"prompt": prompt, "chosen": " " + chosen, "rejected": " " + words(rng, rng.randint(4, 100))})
path = tiny_model_dir()
trainer = SequenceParallelDPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), ref_model=AutoModelForCausalLM.from_pretrained(path),
                                     args=args, train_dataset=Dataset.from_list(rows), processing_class=AutoTokenizer.from_pretrained(path))
trainer.train()
if dist.get_rank() == 0:
    print("reward margins:", [round(h["rewards/margins"], 4) for h in trainer.state.log_history if "rewards/margins" in h])
