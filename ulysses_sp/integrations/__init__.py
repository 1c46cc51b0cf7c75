"""The training frameworks: DeepSpeed, FSDP2, transformers' `Trainer` and TRL's trainers. Each
imports its framework lazily; the Hugging Face model support they build on is `ulysses_sp.models`."""
