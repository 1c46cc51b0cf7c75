"""Train a Hugging Face causal LM with sequence parallelism under DeepSpeed.

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 train.py --sp-size 2 --sp-backend auto   # CPU, 2 ranks
    torchrun --nproc_per_node 2 train.py --sp-size 2                                    # same, with torchrun
    deepspeed --num_gpus 8 train.py --sp-size 4 --deepspeed ds_config.json --model path/to/model --data data.jsonl

All options: python train.py --help. The logic lives in ulysses_sp.job.
"""

from ulysses_sp.job import main

if __name__ == "__main__":
    main()
