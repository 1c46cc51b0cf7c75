"""Reinforcement learning with TRL's GRPOTrainer and sequence parallelism, on CPU at tiny sizes:

    torchrun --nproc_per_node 2 examples/trl_grpo.py --sp_size 2 --use_cpu --output_dir /tmp/trl-grpo

Completions are generated on whole sequences (SP is removed around ``generate``; the group trains on
its first rank's completions), then the training forward of prompt plus completion runs under SP.
The reward counts the completion's words that continue the pattern. Every ``GRPOConfig`` flag works
(``--loss_type dapo``, ``--beta 0.04`` for a KL to the reference model, ...).
"""

import random

import torch.distributed as dist
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from trl_common import tiny_model_dir, words
from ulysses_sp.integrations.trl import SequenceParallelGRPOConfig, SequenceParallelGRPOTrainer


def pattern_reward(prompts, completions, **kwargs):
    out = []
    for prompt, completion in zip(prompts, completions):
        seq = [int(w[1:]) for w in (prompt + " " + completion).split() if w[1:].isdigit()]
        out.append(float(sum((b - a) % 40 == 3 for a, b in zip(seq, seq[1:]))))
    return out


args = HfArgumentParser(SequenceParallelGRPOConfig).parse_args_into_dataclasses()[0]
rng = random.Random(0)
data = Dataset.from_list([{"prompt": words(rng, rng.randint(4, 40))} for _ in range(64)])
path = tiny_model_dir()
trainer = SequenceParallelGRPOTrainer(model=AutoModelForCausalLM.from_pretrained(path), reward_funcs=pattern_reward, args=args,
                                      train_dataset=data, processing_class=AutoTokenizer.from_pretrained(path))
trainer.train()
if dist.get_rank() == 0:
    print("rewards:", [round(h["reward"], 3) for h in trainer.state.log_history if "reward" in h])
