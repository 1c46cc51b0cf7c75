"""The default task's generator (ulysses_sp/tasks.py): where the held-out keys lie relative to the
shards, the training rows' documents and their schedule, and the shard-cut control
(ulysses_sp/testing/shard_cut.py)."""

import pytest
import torch

from ulysses_sp import layout
from ulysses_sp.tasks import KEY_LENGTH, MIN_DOC, cross_shard_depths, doc_length_cap, passkey_batch, passkey_eval_batch

SYMBOLS = range(0x80, 0x80 + 10 * KEY_LENGTH)


@pytest.mark.parametrize("lay", ["zigzag", "balanced", "contiguous"])
@pytest.mark.parametrize("sp_size", [2, 3, 4])
def test_every_held_out_key_lies_on_other_ranks_than_its_answer(sp_size, lay):
    """16 prompts per case: the key's symbols (found in the bytes, not taken from the generator)
    lie on ranks that hold none of the answer's tokens, at depths spread over the row."""
    seq = 1536 if sp_size == 3 else 1024
    owner = layout.owners(lay, seq, sp_size, (0, seq))
    depths = set()
    for index in range(16):
        b = passkey_eval_batch(seq, seed=0, index=index, sp_size=sp_size, layout=lay)
        ids = b["input_ids"][0]
        key_at = [i for i in range(seq - KEY_LENGTH) if int(ids[i]) in SYMBOLS]
        assert len(key_at) == KEY_LENGTH and ids[key_at].tolist() == ids[-KEY_LENGTH:].tolist()
        assert not set(owner[key_at].tolist()) & set(owner[-KEY_LENGTH:].tolist()), (index, key_at)
        assert (b["labels"][0] != -100).nonzero().flatten().tolist() == list(range(seq - KEY_LENGTH, seq))
        depths.add(key_at[0])
    assert len(depths) >= 12 and max(depths) - min(depths) > seq // 4, sorted(depths)


@pytest.mark.quick
def test_without_sp_the_key_may_lie_anywhere():
    overhead = len(" key: ") + KEY_LENGTH + len(" key?\xff") + KEY_LENGTH
    assert cross_shard_depths(256, 1, "zigzag") == list(range(256 - overhead + 1))
    near = cross_shard_depths(256, 2, "zigzag")
    assert 0 not in near and len(near) < 256 // 2, "zigzag at P=2: rank 0 holds the first and last quarters, the answer's"


def test_training_rows_pack_short_documents_first_then_whole_rows():
    """Documents of MIN_DOC tokens for the first 20% of the steps, as long as the row from 50%;
    each ends with its question and answer, the only targets."""
    steps, seq = 100, 1024
    assert [doc_length_cap(seq, s, steps) for s in (0, 19, 20, 35, 49, 50, 99)] == [MIN_DOC, MIN_DOC, MIN_DOC, 181, 912, seq, seq]
    for step, most in ((0, MIN_DOC), (35, 181), (90, seq)):
        b = passkey_batch(seq, seed=1, step=step, dp_rank=0, steps=steps)
        ids, labels, pos = b["input_ids"][0], b["labels"][0], b["position_ids"][0]
        starts = (pos == 0).nonzero().flatten().tolist() + [seq]
        lengths = [b - a for a, b in zip(starts, starts[1:])]
        assert all(n >= MIN_DOC for n in lengths) and all(n <= most for n in lengths[:-1]), lengths
        targets = (labels != -100).nonzero().flatten().tolist()
        assert targets == [e - KEY_LENGTH + k for e in starts[1:] for k in range(KEY_LENGTH)]
        assert torch.equal(labels[labels != -100], ids[labels != -100])
        for start, end in zip(starts, starts[1:]):  # the answer repeats the key hidden earlier in the document
            key = [int(t) for t in ids[start : end - KEY_LENGTH] if int(t) in SYMBOLS]
            assert key == ids[end - KEY_LENGTH : end].tolist()
    assert not torch.equal(passkey_batch(seq, seed=1, step=3, dp_rank=0, steps=steps)["input_ids"],
                           passkey_batch(seq, seed=1, step=3, dp_rank=1, steps=steps)["input_ids"])


@pytest.mark.parametrize("sp_size,lay", [(2, "zigzag"), (4, "balanced")])
def test_the_shard_cut_equals_each_rank_running_its_own_tokens_alone(sp_size, lay):
    """The control's mask, on the embedded model: every rank's logits equal that rank's tokens
    run alone (their global positions kept), so nothing reaches across a shard boundary."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    from ulysses_sp.job.run import default_model_config
    from ulysses_sp.testing.shard_cut import shard_cut_mask

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(default_model_config()).eval()
    seq = 64
    ids = torch.randint(0, 256, (1, seq))
    with torch.no_grad():
        cut = model(input_ids=ids, attention_mask=shard_cut_mask(seq, sp_size, lay)[None, None]).logits[0]
        whole = model(input_ids=ids).logits[0]
        for rank in range(sp_size):
            mine = layout.positions(lay, seq, sp_size, rank, cu_seqlens=(0, seq))
            causal = torch.ones(len(mine), len(mine), dtype=torch.bool).tril()[None, None]  # else a jump in positions reads as a new document
            alone = model(input_ids=ids[:, mine], position_ids=mine[None], attention_mask=causal).logits[0]
            assert (cut[mine] - alone).abs().max() < 1e-5, rank
    assert (cut - whole).abs().max() > 0.1, "the cut must change what crosses the shards"
