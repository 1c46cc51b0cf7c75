"""A tiny model directory and JSON-lines corpus, made offline: what ``--model DIR --data FILE``
expects from a downloaded model, for tests and for trying the job without a download.

    python -m ulysses_sp.testing.tiny_checkpoint OUT   # OUT/model, OUT/train.jsonl, OUT/eval.jsonl

The tokenizer is word-level (trained here, saved with ``save_pretrained``); the documents
follow a learnable pattern (each word mostly followed by the next), so the loss falls within
a few steps.
"""

from __future__ import annotations

import json
import os
import random
import sys

import torch

__all__ = ["WORDS", "write_tiny_llama", "write_corpus"]

WORDS = [f"w{i}" for i in range(40)]


def write_tiny_llama(path: str, seed: int = 0) -> None:
    """A 2-layer Llama (4 heads, 2 KV heads) with random weights, and its tokenizer, in ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]").save_pretrained(path)
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, max_position_embeddings=1 << 14, tie_word_embeddings=False,
                         pad_token_id=1, eos_token_id=2, bos_token_id=None)
    LlamaForCausalLM(config).save_pretrained(path)


def write_corpus(path: str, documents: int, seed: int = 0) -> None:
    """``documents`` JSON lines ``{"text": ...}`` of 8 to 70 words."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(documents):
            i = rng.randrange(len(WORDS))
            words = [WORDS[(i + k + (rng.random() < 0.1)) % len(WORDS)] for k in range(rng.randrange(8, 70))]
            f.write(json.dumps({"text": " ".join(words)}) + "\n")


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else "tiny"
    write_tiny_llama(os.path.join(out, "model"))
    write_corpus(os.path.join(out, "train.jsonl"), 400, seed=0)
    write_corpus(os.path.join(out, "eval.jsonl"), 40, seed=1)
    print(f"wrote {out}/model, {out}/train.jsonl, {out}/eval.jsonl")
