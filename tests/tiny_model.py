"""A tiny causal LM in plain torch whose attention is pluggable: the one-process
reference runs it with plain attention, the SP run with SequenceParallelAttention."""

from __future__ import annotations

import torch
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab=31, dim=24, q_heads=4, kv_heads=2, head_dim=6, max_pos=64, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.q_heads, self.kv_heads, self.head_dim = q_heads, kv_heads, head_dim
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_pos, dim)  # absolute positions: wrong if a rank used local ones
        self.wq = nn.Linear(dim, q_heads * head_dim)
        self.wk = nn.Linear(dim, kv_heads * head_dim)
        self.wv = nn.Linear(dim, kv_heads * head_dim)
        self.wo = nn.Linear(q_heads * head_dim, dim)
        self.head = nn.Linear(dim, vocab)
        self.double()

    def forward(self, input_ids, position_ids, attention):
        x = self.embed(input_ids) + self.pos(position_ids)
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.q_heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        x = x + self.wo(attention(q, k, v).reshape(b, s, -1))
        return self.head(x)


def make_batch(kind: str, seed: int = 0) -> dict:
    """A 45-token causal-LM batch: ``padded`` (right padding), ``packed`` (documents,
    HF position ids restarting at 0, first label of each document ignored) or
    ``mostly-padding`` (10 real tokens: at 4 zigzag ranks some hold padding only)."""
    g = torch.Generator().manual_seed(seed)
    s = 45
    input_ids = torch.randint(1, 31, (1, s), generator=g)
    if kind == "packed":
        lengths = [5, 9, 1, 17, 13]
        position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        labels = input_ids.masked_fill(position_ids == 0, -100)
        return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}
    real = {"padded": 40, "mostly-padding": 10}[kind]
    mask = (torch.arange(s) < real).long().unsqueeze(0)
    return {"input_ids": input_ids.masked_fill(mask == 0, 0), "labels": input_ids.masked_fill(mask == 0, -100), "attention_mask": mask}
