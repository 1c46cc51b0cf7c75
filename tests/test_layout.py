import pytest
import torch

from ulysses_sp import layout, pad_to_multiple
from ulysses_sp.blocks import chunk_segments, plan_blocks, sees_any


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("lay", layout.LAYOUTS)
@pytest.mark.quick
def test_shards_partition_the_sequence(lay, p):
    n = 2 * p * 3
    for cu in ((0, n), (0, 1, n - 5, n)):
        held = torch.cat([layout.positions(lay, n, p, r, cu) for r in range(p)])
        assert sorted(held.tolist()) == list(range(n))
        x = torch.arange(n).view(1, n)
        for r in range(p):
            assert torch.equal(layout.shard(x, lay, p, r, cu_seqlens=cu)[0], layout.positions(lay, n, p, r, cu))


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


def _plan_mask(calls, sq, sk):
    """How often a plan computes each local (query, key) pair, reading each call's mask as
    flash-attn does: bottom-right ``causal`` and ``window`` per (varlen) sequence."""
    count = torch.zeros(sq, sk, dtype=torch.long)
    for c in calls:
        left, right = c.window or (-1, -1)
        bounds = c.varlen.bounds() if c.varlen else [(0, c.q1 - c.q0, 0, c.k1 - c.k0)]
        for q0, q1, k0, k1 in bounds:
            i, j = torch.arange(q1 - q0)[:, None], torch.arange(k1 - k0)[None, :]
            diag = i + (k1 - k0) - (q1 - q0)  # the key aligned with query i
            keep = torch.ones(q1 - q0, k1 - k0, dtype=torch.bool)
            if c.causal:
                keep &= j <= diag
            if left >= 0:
                keep &= j >= diag - left
            if right >= 0:
                keep &= j <= diag + right
            count[c.q0 + q0 : c.q0 + q1, c.k0 + k0 : c.k0 + k1] += keep.long()
    return count


def _visible(n, causal, window, cu):
    pos = torch.arange(n)
    visible = torch.ones(n, n, dtype=torch.bool)
    if causal:
        visible &= pos[:, None] >= pos[None, :]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    if cu is not None:
        doc = torch.bucketize(pos, torch.tensor(cu[1:]), right=True)
        visible &= doc[:, None] == doc[None, :]
    return visible


def _work(calls) -> int:
    return int(_plan_mask(calls, 64, 64).sum())


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_zigzag_ring_steps_have_equal_work(p):
    """Under zigzag, every rank does the same causal work at every ring step; contiguous does not."""
    for lay, balanced in (("zigzag", True), ("contiguous", False)):
        table, chunk = layout.chunk_table(lay, p), 2
        segs = [chunk_segments(t, chunk) for t in table]
        per_step = [{_work(plan_blocks(segs[r], segs[(r - s) % p], causal=True)) for r in range(p)} for s in range(1, p)]
        assert all(len(w) == 1 for w in per_step) == balanced, (lay, per_step)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_unmasked_blocks_are_one_call(p):
    """A rank's two zigzag chunks are adjacent locally though not globally: every causal ring
    step but a rank's own block is one unmasked call (as in torch's head-tail ring), and
    without a mask each pair of ranks is one call under every layout."""
    table = layout.chunk_table("zigzag", p)
    segs = [chunk_segments(t, 4) for t in table]
    for r in range(p):
        for s in range(1, p):
            calls = plan_blocks(segs[r], segs[(r - s) % p], causal=True)
            assert len(calls) == 1 and not calls[0].causal, (r, s, calls)
    for lay in layout.LAYOUTS:
        segs = [chunk_segments(t, 4) for t in layout.chunk_table(lay, p, 8 * p)]
        whole = (0, len(segs[0]) * 4)
        for r in range(p):
            for src in range(p):
                calls = plan_blocks(segs[r], segs[src], causal=False)
                assert [(c.q0, c.q1, c.k0, c.k1, c.causal) for c in calls] == [whole + whole + (False,)], (lay, r, src, calls)


@pytest.mark.parametrize("p", [2, 3, 4, 8])
def test_own_zigzag_block_is_one_causal_call(p):
    """A rank's own block (its two chunks' diagonals and the block between them) is one causal
    call on its local rows, as torch's ring makes it. (That merged plans with windows and
    packing stay exact is the next test's.)"""
    table = layout.chunk_table("zigzag", p)
    for r in range(p):
        segs = chunk_segments(table[r], 4)
        calls = plan_blocks(segs, segs, causal=True)
        assert [(c.q0, c.q1, c.k0, c.k1, c.causal, c.window, c.varlen) for c in calls] == [(0, 8, 0, 8, True, None, None)], (r, calls)


CUS = [None, (0, 16), (0, 1, 2, 7, 8, 9, 16), (0, 3, 11, 16), (0, 15, 16), tuple(range(17))]
MASKS = [(False, None), (True, None), (True, 1), (True, 3), (True, 5), (True, 9)]


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("causal,window", MASKS)
@pytest.mark.parametrize("lay", layout.LAYOUTS)
def test_block_plans_cover_exactly_the_visible_pairs(lay, causal, window, cu):
    """For every pair of ranks, the plan's calls cover the document, causal and window mask once."""
    p, n = 4, 16
    visible = _visible(n, causal, window, cu)
    table = layout.chunk_table(lay, p, n, cu)
    chunk = n // (len(table[0]) * p)
    for r in range(p):
        for src in range(p):
            calls = plan_blocks(chunk_segments(table[r], chunk), chunk_segments(table[src], chunk), causal=causal, window=window,
                                cu_seqlens=cu, batch=2, device="cpu")
            want = visible[layout.positions(lay, n, p, r, cu or (0, n))][:, layout.positions(lay, n, p, src, cu or (0, n))]
            count = _plan_mask(calls, len(want), len(want))
            assert torch.equal(count, want.long()), (r, src, calls)
            assert len(calls) <= 2 * len(table[r]), "at most one call per (query chunk, key run)"
            for c in calls:
                if c.varlen is not None:
                    assert c.varlen.cu_q.tolist()[-1] == 2 * (c.q1 - c.q0) and c.varlen.cu_k.tolist()[-1] == 2 * (c.k1 - c.k0)
                assert c.window is None or min(c.window) >= -1
            assert sees_any(chunk_segments(table[r], chunk), chunk_segments(table[src], chunk), causal=causal, window=window,
                            cu_seqlens=cu) == bool(want.any())


@pytest.mark.parametrize("cu", CUS)
@pytest.mark.parametrize("window", [None, 2, 6])
def test_block_plans_over_arbitrary_segments(window, cu):
    """Keys in scattered segments (halo tails, placeholders, runs merged across chunks):
    one call per query run and key run, the exact mask."""
    n = 16
    visible = _visible(n, True, window, cu)
    q_segs = ((8, 4), (4, 4))
    k_segs = ((2, 2), (None, 3), (4, 2), (6, 2), (12, 2), (0, 2))
    calls = plan_blocks(q_segs, k_segs, causal=True, window=window, cu_seqlens=cu)
    q_pos = torch.cat([torch.arange(a, a + m) for a, m in q_segs])
    k_pos = torch.cat([torch.arange(a, a + m) if a is not None else torch.full((m,), -1) for a, m in k_segs])
    want = visible[q_pos][:, k_pos.clamp(min=0)] & (k_pos >= 0)
    assert torch.equal(_plan_mask(calls, len(q_pos), len(k_pos)), want.long()), calls
    assert len(calls) <= 2 * 4


@pytest.mark.parametrize("docs", [24, 1000])
@pytest.mark.parametrize("window", [None, 300])
def test_block_plans_do_not_grow_with_the_documents(docs, window):
    """Calls per rank pair are bounded by the chunks, whatever the packing."""
    p, n = 4, 8000
    cu = tuple(range(0, n, n // docs)) + (n,) if n % docs else tuple(range(0, n + 1, n // docs))
    table = layout.chunk_table("zigzag", p)
    segs = [chunk_segments(t, n // (2 * p)) for t in table]
    calls = sum(len(plan_blocks(segs[r], segs[s], causal=True, window=window, cu_seqlens=cu)) for r in range(p) for s in range(p))
    assert calls <= 4 * p * p


def _lognormal_documents(seq_len: int, seed: int) -> list[int]:
    import random

    rng, cu = random.Random(seed), [0]
    while cu[-1] < seq_len:
        cu.append(min(seq_len, cu[-1] + max(1, int(rng.lognormvariate(7.6, 1.5)))))  # median e^7.6 ~ 2k tokens
    return cu


@pytest.mark.parametrize("name,seq_len,cu,p,zigzag,balanced", [
    ("16k: a 12k document first, then 512-token ones", 16384, [0, 12288, *range(12800, 16385, 512)], 2, 1.75, 1.001),
    ("the same on 4 ranks", 16384, [0, 12288, *range(12800, 16385, 512)], 4, 1.75, 1.001),
    ("16k: a long document in the middle", 16384, [0, 1024, 2048, 3072, 13312, 14336, 15360, 16384], 4, 1.5, 1.01),
    ("128k, log-normal lengths (median 2k, sigma 1.5)", 131072, _lognormal_documents(131072, 0), 8, 1.5, 1.02),
])
def test_balanced_evens_the_causal_work_of_packed_rows(name, seq_len, cu, p, zigzag, balanced):
    """The slowest rank's attention work over the mean (work: each token's position in its document
    + 1): zigzag's (1.75 for the first rows, as the issue measured), balanced within 1-2%."""
    def ratio(lay):
        return layout.work_imbalance(lay, seq_len, p, cu)

    assert ratio("zigzag") >= zigzag, (name, ratio("zigzag"))
    assert ratio("balanced") <= balanced, (name, ratio("balanced"))


def test_balanced_placement_is_a_deterministic_partition_into_equal_shares():
    cu = (0, 5, 13, 14, 48)
    for p in (1, 2, 3, 4):
        table = layout.chunk_table("balanced", p, 48, cu)
        k = layout.chunks_per_rank("balanced", 48, p)
        assert sorted(c for row in table for c in row) == list(range(k * p)) and {len(row) for row in table} == {k}
        assert table == layout.chunk_table("balanced", p, 48, list(cu)), "a pure function of the documents"
    assert [layout.chunks_per_rank("balanced", s, 4) for s in (64, 48, 40, 8)] == [8, 6, 5, 2]
    assert layout.chunk_table("balanced", 2, 16, None) == layout.chunk_table("balanced", 2, 16, (0, 16))


def test_chunk_work_counts_each_tokens_visible_keys():
    cu = (0, 3, 10, 12)
    per_token = [i - a + 1 for a, b in zip(cu, cu[1:]) for i in range(a, b)]
    assert layout.chunk_work(12, 4, cu) == [sum(per_token[i:i + 3]) for i in range(0, 12, 3)]


@pytest.mark.parametrize("causal,window", [(True, None), (True, 3), (True, 1), (False, None)])
def test_chunk_work_under_a_window_or_without_the_causal_mask(causal, window):
    """Against each query's visible keys counted one by one: min(position + 1, window) causal, the
    document's length without the mask; chunks that cut documents and documents that span chunks."""
    cu = (0, 1, 7, 8, 19, 24)
    seen = [(min(i - a + 1, window or b) if causal else b - a) for a, b in zip(cu, cu[1:]) for i in range(a, b)]
    for chunks in (1, 2, 3, 4, 6, 8, 12, 24):
        c = 24 // chunks
        assert layout.chunk_work(24, chunks, cu, causal=causal, window=window) == [sum(seen[i:i + c]) for i in range(0, 24, c)]


@pytest.mark.parametrize("docs", ["lognormal:2k:1.5", "lognormal:16k:1", "80k,1k", "1kx20,80k,1k"])
@pytest.mark.parametrize("p", [2, 4, 8, 16, 64])
def test_balanced_is_within_5_percent_on_128k_rows(docs, p):
    """The issue's target, on its three kinds of mix (a single long document first and in the
    middle), five seeds each: every row's slowest rank within 5% of the mean under balanced,
    where zigzag's worst is above 1.2 (benchmarks/packed_work.py: 50 rows per mix)"""
    from ulysses_sp.cli.docs import parse_docs

    rows = [parse_docs(docs, 131072, seed) for seed in range(5)]
    assert max(layout.work_imbalance("balanced", 131072, p, cu) for cu in rows) <= 1.05
    assert max(layout.work_imbalance("zigzag", 131072, p, cu) for cu in rows) > 1.2


def test_balanced_needs_the_documents():
    with pytest.raises(ValueError, match="balanced layout places tokens by document: pass cu_seqlens"):
        layout.shard(torch.zeros(1, 16), "balanced", 2, 0)
    with pytest.raises(ValueError, match="cu_seqlens must run from 0 to the sequence length 16"):
        layout.chunk_table("balanced", 2, 16, (0, 8))
