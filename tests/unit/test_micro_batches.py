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
    assert split.padded_rows == dp * per_rank
    # per_rank rows each, balanced: the ranks' tokens within the longest row of each other (longest
    # first to the least loaded rank with room)
    totals = [sum(padded[r] for m in rank for r in m.rows.tolist()) for rank in split.ranks]
    assert all(sum(len(m.rows) for m in rank) == per_rank for rank in split.ranks)
    assert max(totals) - min(totals) <= max(padded), totals
    for rank in split.ranks:
        for m in rank:
            rows = m.rows.tolist()
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


@pytest.mark.parametrize("dp,tp,rows_cap,budget", [(2, 1, 64, 48), (2, 2, 2, 48), (3, 2, 4, 100), (4, 1, 3, 41),
                                                  (8, 1, 64, 4096)])
@pytest.mark.parametrize("seed", range(4))
def test_the_split_by_tokens_keeps_every_rule(dp: int, tp: int, rows_cap: int, budget: int, seed: int):
    g = torch.Generator().manual_seed(dp * 100 + budget + seed)
    lengths = [int(x) for x in torch.randint(2, 41, (13 + 40 * seed,), generator=g)]
    check_token_split(lengths, dp, tp, rows_cap, budget)


def test_a_group_of_long_rows_is_spread_over_the_ranks():
    """GRPO's groups are contiguous rows of one prompt, often alike in length: rows 0-3 long, 4-7 short
    go two long and two short to each of two ranks (contiguous blocks would give one rank all four)."""
    split = check_token_split([100, 101, 102, 103, 5, 6, 7, 8], dp=2, tp=1, rows_cap=8, budget=1000)
    assert [sorted(r for m in rank for r in m.rows.tolist()) for rank in split.ranks] == [[0, 3, 4, 7],
                                                                                          [1, 2, 5, 6]]


def test_ranks_with_fewer_micro_batches_split_theirs():
    # balanced: rank 0 takes rows 0 (60 tokens) and 2 (3), rank 1 rows 1 (30) and 3 (4). Rank 0 packs
    # 60 | 3 (2 x 60 > 61); rank 1 fits 30 + 4 in one (2 x 30 <= 61), which it splits to have two too
    split = check_token_split([60, 30, 3, 4], dp=2, tp=1, rows_cap=8, budget=61)
    assert [[m.rows.tolist() for m in rank] for rank in split.ranks] == [[[0], [2]], [[1], [3]]]
    assert [[m.seq_len for m in rank] for rank in split.ranks] == [[60, 3], [30, 4]]
    # three rows each: 30 + 30 | 3 on rank 0 (rows 0, 2 | 3), 30 + 5 | 4 on rank 1: two each, no split
    split = check_token_split([30, 30, 30, 3, 4, 5], dp=2, tp=1, rows_cap=8, budget=64)
    assert [[m.rows.tolist() for m in rank] for rank in split.ranks] == [[[0, 2], [3]], [[1, 5], [4]]]
    # B = 5 over 2 ranks: the dummy row 5 (1 token) joins rank 0 and is packed like any other
    split = check_token_split([30, 30, 3, 4, 5], dp=2, tp=1, rows_cap=8, budget=64)
    assert [[m.rows.tolist() for m in rank] for rank in split.ranks] == [[[0, 4], [5]], [[1, 3], [2]]]
    assert split.padded_rows == 6 and split.ranks[0][1].seq_len == 1
