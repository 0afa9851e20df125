"""hpcrl/trainer/micro_batches.py: the fixed split and the split by tokens (trainer.max_tokens_per_micro_batch)."""

from __future__ import annotations

import math

import pytest
import torch

from hpcrl.trainer.micro_batches import fixed_split, token_split


def test_the_fixed_split_is_contiguous_blocks_of_one_shape():
    split = fixed_split(num_rows=10, seq_len=7, dp=2, tp=2, micro_batch_size=2)
    # 5 rows per DP rank -> 3 micro-batches of 2 rows (one dummy row per rank), length 8
    assert split.padded_rows == 12 and split.num_micro_batches == 3
    assert [[m.rows.tolist() for m in rank] for rank in split.ranks] == [[[0, 1], [2, 3], [4, 5]],
                                                                         [[6, 7], [8, 9], [10, 11]]]
    assert {m.seq_len for rank in split.ranks for m in rank} == {8}


def check_token_split(lengths: list[int], dp: int, tp: int, rows_cap: int, budget: int):
    split = token_split(torch.tensor(lengths), dp, tp, rows_cap, budget)
    B, per_rank = len(lengths), math.ceil(len(lengths) / dp)
    every = torch.cat([m.rows for rank in split.ranks for m in rank]).tolist()
    real = [r for r in every if r < B]
    assert sorted(real) == list(range(B))  # each row once
    assert len({len(rank) for rank in split.ranks}) == 1  # one count on every DP rank
    padded = lengths + [1] * (split.padded_rows - B)
    for d, rank in enumerate(split.ranks):
        for m in rank:
            rows = m.rows.tolist()
            assert all(d * per_rank <= r < (d + 1) * per_rank or r == split.padded_rows - 1 for r in rows)
            assert m.seq_len % tp == 0 and m.seq_len == math.ceil(max(padded[r] for r in rows) / tp) * tp
            assert len(rows) <= rows_cap
            assert len(rows) == 1 or len(rows) * m.seq_len <= budget
    return split


def test_the_split_by_tokens_pads_each_micro_batch_to_its_own_longest():
    lengths = [40, 3, 5, 38, 4, 6, 2, 39]
    split = check_token_split(lengths, dp=1, tp=1, rows_cap=64, budget=48)
    # longest first: 40, 39, 38 each alone (two would be 78+ tokens), then 6, 5, 4, 3, 2 in 6 x 6 <= 48
    assert [m.rows.tolist() for m in split.ranks[0]] == [[0], [7], [3], [5, 2, 4, 1, 6]]
    assert [m.seq_len for m in split.ranks[0]] == [40, 39, 38, 6]
    fixed = 8 * 40
    assert sum(len(m.rows) * m.seq_len for m in split.ranks[0]) == 40 + 39 + 38 + 30 < fixed / 2


@pytest.mark.parametrize("dp,tp,rows_cap,budget", [(2, 1, 64, 48), (2, 2, 2, 48), (3, 2, 4, 100), (4, 1, 3, 41)])
def test_the_split_by_tokens_keeps_every_rule(dp: int, tp: int, rows_cap: int, budget: int):
    g = torch.Generator().manual_seed(dp * 100 + budget)
    lengths = [int(x) for x in torch.randint(2, 41, (13,), generator=g)]
    check_token_split(lengths, dp, tp, rows_cap, budget)


def test_ranks_with_fewer_micro_batches_split_theirs():
    # rank 0: three long rows, each alone; rank 1: three short rows in one micro-batch -> split in
    # two (the most rows first), then again
    split = check_token_split([30, 30, 30, 3, 4, 5], dp=2, tp=1, rows_cap=8, budget=40)
    assert [[m.rows.tolist() for m in rank] for rank in split.ranks] == [[[0], [1], [2]], [[5], [4], [3]]]
    assert [m.seq_len for m in split.ranks[1]] == [5, 4, 3]
    # a dummy row (B = 5 over 2 ranks) is split off like any other
    split = check_token_split([30, 30, 30, 3, 4], dp=2, tp=1, rows_cap=8, budget=40)
    assert split.padded_rows == 6 and [m.rows.tolist() for m in split.ranks[1]] == [[4], [3], [5]]
