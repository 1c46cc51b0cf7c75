import pytest
import torch

from ulysses_sp import layout, pad_to_multiple
from ulysses_sp.blocks import plan_blocks


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("lay", layout.LAYOUTS)
def test_shards_partition_the_sequence(lay, p):
    n = 2 * p * 3
    held = torch.cat([layout.positions(lay, n, p, r) for r in range(p)])
    assert sorted(held.tolist()) == list(range(n))
    x = torch.arange(n).view(1, n)
    for r in range(p):
        assert torch.equal(layout.shard(x, lay, p, r)[0], layout.positions(lay, n, p, r))


def test_zigzag_pairs_chunks_for_balance():
    assert layout.chunk_table("zigzag", 4) == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert layout.positions("zigzag", 8, 2, 0).tolist() == [0, 1, 6, 7]
    assert layout.positions("contiguous", 8, 2, 1).tolist() == [4, 5, 6, 7]


def test_not_divisible_names_the_padding_helper():
    with pytest.raises(ValueError, match=r"multiple of 8 .*pad_to_multiple\(x, 8"):
        layout.shard(torch.zeros(1, 12), "zigzag", 4, 0)
    with pytest.raises(ValueError, match="layout must be one of"):
        layout.chunk_table("diagonal", 2)


def test_pad_to_multiple():
    labels = torch.arange(5).view(1, 5)
    padded = pad_to_multiple(labels, 4, dim=1, value=-100)
    assert padded.tolist() == [[0, 1, 2, 3, 4, -100, -100, -100]]
    assert pad_to_multiple(labels, 5) is labels
    assert pad_to_multiple(torch.zeros(6, 2), 4, dim=0).shape == (8, 2)
    with pytest.raises(ValueError):
        pad_to_multiple(labels, 0)


def _work(runs):
    """Kernel work in chunk-pairs: a full run of n chunks is n, a causal diagonal half."""
    return sum(0.5 if diagonal else j1 - j0 for _, j0, j1, diagonal in runs)


def test_block_runs_skip_hidden_chunks_and_merge_visible_ones():
    # query chunk 2 against keys 0..3: one run of the two earlier chunks, the diagonal, nothing after
    assert layout.block_runs([2], [0, 1, 2, 3], causal=True) == [(0, 0, 2, False), (0, 2, 3, True)]
    assert layout.block_runs([0], [1, 2], causal=True) == []
    assert layout.block_runs([0, 3], [1, 2], causal=False) == [(0, 0, 2, False), (1, 0, 2, False)]


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zigzag_ring_steps_have_equal_work(p):
    """Under zigzag, every rank does the same causal work at every ring step; contiguous does not."""
    for lay, balanced in (("zigzag", True), ("contiguous", False)):
        table = layout.chunk_table(lay, p)
        per_step = [
            {_work(layout.block_runs(table[r], table[(r - s) % p], causal=True)) for r in range(p)} for s in range(1, p)
        ]
        assert all(len(w) == 1 for w in per_step) == balanced, (lay, per_step)


def _plan_mask(calls, sq, sk):
    """The (query, key) pairs a block plan computes, and how often each (causal masks bottom-right)."""
    count = torch.zeros(sq, sk, dtype=torch.long)
    for c in calls:
        bounds = c.varlen.bounds() if c.varlen else [(0, c.q1 - c.q0, 0, c.k1 - c.k0)]
        for q0, q1, k0, k1 in bounds:
            block = torch.ones(q1 - q0, k1 - k0, dtype=torch.long)
            count[c.q0 + q0 : c.q0 + q1, c.k0 + k0 : c.k0 + k1] += block.tril(k1 - k0 - (q1 - q0)) if c.causal else block
    return count


DOCS_24 = tuple(range(0, 48, 2)) + (48,)


@pytest.mark.parametrize("cu", [None, (0, 16), (0, 1, 2, 7, 8, 9, 16), (0, 3, 11, 16), (0, 15, 16), tuple(range(17))])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lay", layout.LAYOUTS)
def test_block_plans_cover_exactly_the_visible_pairs(lay, causal, cu):
    """For every pair of ranks, the plan's calls cover the document (and causal) mask once."""
    p, n = 4, 16
    pos = torch.arange(n)
    visible = torch.ones(n, n, dtype=torch.bool)
    if causal:
        visible &= pos[:, None] >= pos[None, :]
    if cu is not None:
        doc = torch.bucketize(pos, torch.tensor(cu[1:]), right=True)
        visible &= doc[:, None] == doc[None, :]
    table = layout.chunk_table(lay, p)
    chunk = n // (len(table[0]) * p)
    for r in range(p):
        for src in range(p):
            calls = plan_blocks(table[r], table[src], chunk, causal, cu, batch=2, device="cpu")
            want = visible[layout.positions(lay, n, p, r)][:, layout.positions(lay, n, p, src)]
            count = _plan_mask(calls, len(want), len(want))
            assert torch.equal(count, want.long()), (r, src, calls)
            assert len(calls) <= 2 * len(table[r]), "at most one call per (query chunk, key run)"
            for c in calls:
                if c.varlen is not None:
                    assert c.varlen.cu_q.tolist()[-1] == 2 * (c.q1 - c.q0) and c.varlen.cu_k.tolist()[-1] == 2 * (c.k1 - c.k0)


@pytest.mark.parametrize("docs", [24, 1000])
def test_block_plans_do_not_grow_with_the_documents(docs):
    """Calls per rank pair are bounded by the chunks, whatever the packing."""
    p, n = 4, 8000
    cu = tuple(range(0, n, n // docs)) + (n,) if n % docs else tuple(range(0, n + 1, n // docs))
    table = layout.chunk_table("zigzag", p)
    chunk = n // (2 * p)
    calls = sum(len(plan_blocks(table[r], table[s], chunk, True, cu)) for r in range(p) for s in range(p))
    assert calls <= 4 * p * p
