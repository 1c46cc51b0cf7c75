"""Sequence-level log-probabilities under SP (ulysses_sp/rl.py), inside the pool's ranks; assertions
in tests/test_rl.py. Random fp64 logits of a whole batch are the one process; each rank takes its
shard of them as a leaf, so the SP gradients gathered must equal the one-process gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ulysses_sp as usp
from ulysses_sp import rl
from ulysses_sp.topology import Topology

from .cases import Env, case, generator

V, BETA = 50, 0.5
DOCS = (5, 20, 11)
"""A packed row's documents: the first (tokens 0-4) lies within the first chunk, so at P=2 and 3 the
other ranks hold none of its targets."""


def _batch(packed: bool) -> dict:
    g = generator("rl/batch")
    s = sum(DOCS)
    ids = torch.randint(0, V, (2, s), generator=g)
    labels = ids.clone()
    labels[:, 6:9] = -100  # a prompt: no targets there
    batch = {"input_ids": ids, "labels": labels}
    if packed:
        batch["position_ids"] = torch.cat([torch.arange(n) for n in DOCS])[None].expand(2, s)
    return batch


def _losses(sums, counts, token_mean) -> dict:
    """A DPO-style sigmoid loss over consecutive pairs of sequences, its length-normalised variant, and a token mean."""
    return {"dpo": -F.logsigmoid(BETA * (sums[0::2] - sums[1::2])).mean(),
            "normalised": -F.logsigmoid(BETA * ((sums / counts.clamp(min=1))[0::2] - (sums / counts.clamp(min=1))[1::2])).mean(),
            "token_mean": token_mean}


@case("rl/sequences", (2, 3))
def sequences(env: Env) -> dict:
    out = {}
    for layout, packed in (("zigzag", True), ("balanced", True), ("contiguous", True), ("zigzag", False)):
        topo = env.topo(layout=layout)
        batch = _batch(packed)
        full = torch.randn(2, sum(DOCS), V, generator=generator("rl/logits"), dtype=torch.float64)
        # one process: log_softmax of the whole rows
        whole = usp.shard_batch(batch, Topology.for_planning(1, layout=layout))
        ref_logits = full.clone().requires_grad_()
        labels = whole["shift_labels"]
        ref_lp = torch.log_softmax(ref_logits, -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * (labels != -100)
        ids, n = rl.sequence_ids({**whole, "input_ids": batch["input_ids"]}, Topology.for_planning(1, layout=layout))
        ref_sums = torch.zeros(n, dtype=torch.float64).index_add(0, ids.flatten(), ref_lp.flatten())
        ref_counts = torch.zeros(n, dtype=torch.float64).index_add(0, ids.flatten(), (labels != -100).double().flatten())
        ref_mean = ref_lp.sum() / (labels != -100).sum()
        ref = {k: v.detach() for k, v in _losses(ref_sums, ref_counts, ref_mean).items()}
        # SP: this rank's shard of the same logits
        local = usp.shard_batch(batch, topo)
        cu = local.get("cu_seqlens")
        cu = None if cu is None else cu.tolist()
        errors = {}
        for name in ref:
            ref_logits.grad = None
            _losses(ref_sums, ref_counts, ref_mean)[name].backward(retain_graph=True)
            mine = usp.shard_sequence(full, topo, cu_seqlens=cu).requires_grad_()
            sums, counts = rl.sequence_logprobs(mine, local, topo, chunk_tokens=4)
            token_lp = rl.token_logprobs(mine, local["shift_labels"], chunk_tokens=4)
            loss = _losses(sums, counts, rl.token_mean(token_lp, local["shift_labels"] != -100, topo))[name]
            loss.backward()
            grad = usp.gather_sequence(mine.grad, topo, cu_seqlens=cu)
            errors[name] = (abs(loss.item() - ref[name].item()), (grad - ref_logits.grad).abs().max().item())
        first = (local["shift_labels"] != -100) & (rl.sequence_ids(local, topo)[0] == 0)  # row 0's first sequence
        held = [t[0] for t in usp.comm.all_gather_ints([int(first.sum())], topo.sp_group, "cpu")]
        # the bug guarded against: each rank's own part of each sequence, not the group's sum
        own = torch.zeros(n, dtype=torch.float64).index_add(0, rl.sequence_ids(local, topo)[0].flatten(), token_lp.detach().flatten())
        out[f"{layout}-{'packed' if packed else 'unpacked'}"] = {
            "sums": (sums.detach() - ref_sums.detach()).abs().max().item(), "counts": counts.tolist() == ref_counts.tolist(),
            "errors": errors, "first_doc_targets_per_rank": held,
            "per_rank_mean_moves": abs(-F.logsigmoid(BETA * (own[0::2] - own[1::2])).mean().item() - ref["dpo"].item())}
    return out


@case("rl/memory", (1,))
def memory(env: Env) -> dict:
    """Peak bytes (PeakMemory) beyond the logits of token_logprobs with chunks of 16 tokens, after
    its forward and after its backward, against the plain log_softmax and gather, on 512 tokens x
    1000 classes in fp64."""
    from ulysses_sp.testing.memory import PeakMemory

    out = {}
    for name, fn in (("tiled", lambda logits, labels: rl.token_logprobs(logits, labels, chunk_tokens=16)),
                     ("plain", lambda logits, labels: torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0])):
        g = generator("rl/memory")
        with PeakMemory() as memory:  # the logits made inside, so that views of them count as nothing new
            logits = torch.randn(1, 512, 1000, generator=g, dtype=torch.float64, requires_grad=True)
            labels = torch.randint(0, 1000, (1, 512), generator=g)
            base = memory.live
            lp = fn(logits, labels)
            forward = memory.peak - base
            lp.sum().backward()
        out[name] = (forward, memory.peak - base)
    return out
