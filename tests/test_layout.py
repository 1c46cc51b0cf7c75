import pytest
import torch

from ulysses_sp import layout, pad_to_multiple


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
