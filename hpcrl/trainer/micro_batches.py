"""How a train batch's rows become each data-parallel rank's micro-batches.

Fixed (trainer.max_tokens_per_micro_batch 0): the batch is padded with dummy rows to D * M * mb rows
(D data-parallel ranks, M micro-batches of mb <= micro_batch_size rows); DP rank d takes the d-th
contiguous block, cut into M contiguous micro-batches; every micro-batch has the batch's length,
padded to a multiple of tp (sequence parallelism splits it).

By tokens (trainer.max_tokens_per_micro_batch N > 0; verl's use_dynamic_bsz with
ppo_max_token_len_per_gpu, slime's --use-dynamic-batch-size with --max-tokens-per-gpu): the rows
(prompt + response lengths) go to the DP ranks balanced by tokens, ceil(B / D) each (dummy rows
included): longest first, each to the rank with the fewest tokens so far that has room (verl's
balance_batch does the like; a group of long completions no longer lands on one rank, which the
others would wait for). Each rank sorts its rows by length, longest first, and fills micro-batches
in that order, each padded only to its own longest row (a multiple of
tp): a row joins the current micro-batch while rows x that length stays within N tokens and the rows
within micro_batch_size; a longer row than N gets a micro-batch of its own. RL batches mix long and
short responses, and the short rows then no longer compute the long rows' padding. Every trainer
rank computes the same split from the same batch (no communication). The EP all-to-all and the
pipeline run the micro-batches in lock step, so every DP rank gets the same count: ranks with fewer
split their micro-batch of most rows in two until they have as many (every rank has ceil(B / D) rows,
dummy rows included, and no rank more micro-batches than rows, so splitting always gets there). Under
PP the stages then exchange each micro-batch's shape (Megatron's variable_seq_lengths).

The loss of a micro-batch is a sum over its rows divided by counts of the whole batch
(hpcrl/trainer/policy.py `_train_loss`), so how the rows are grouped changes only the order of the
sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MicroBatch:
    """Rows of the padded batch (indices >= the batch's rows are dummy rows) at `seq_len` positions."""

    rows: torch.Tensor
    seq_len: int


@dataclass(frozen=True)
class Split:
    """Each DP rank's micro-batches (the same count on every rank) over a batch padded to `padded_rows`."""

    ranks: list[list[MicroBatch]]
    padded_rows: int

    @property
    def num_micro_batches(self) -> int:
        return len(self.ranks[0])

    @property
    def max_rows(self) -> int:
        return max(len(m.rows) for rank in self.ranks for m in rank)

    @property
    def max_seq_len(self) -> int:
        return max(m.seq_len for rank in self.ranks for m in rank)


def _round_up(n: int, multiple: int) -> int:
    return max(1, math.ceil(n / multiple)) * multiple


def fixed_split(num_rows: int, seq_len: int, dp: int, tp: int, micro_batch_size: int) -> Split:
    """Contiguous micro-batches of equal shape (the module docstring's fixed split)."""
    per_rank = math.ceil(num_rows / dp)
    n_mb = math.ceil(per_rank / micro_batch_size)
    mb = math.ceil(per_rank / n_mb)
    L = _round_up(seq_len, tp)
    ranks = [[MicroBatch(torch.arange((d * n_mb + m) * mb, (d * n_mb + m + 1) * mb), L) for m in range(n_mb)]
             for d in range(dp)]
    return Split(ranks, dp * n_mb * mb)


def balanced_ranks(lengths: list[int], dp: int, per_rank: int) -> list[list[int]]:
    """Row indices of `lengths` for each of `dp` ranks, `per_rank` each: longest first, each row to the
    rank with the fewest tokens so far among those with room (ties: the lower rank). Each rank's rows
    come in the order dealt: longest first (ties: the lower index)."""
    load, members = [0] * dp, [[] for _ in range(dp)]
    for r in sorted(range(len(lengths)), key=lambda r: (-lengths[r], r)):
        d = min((d for d in range(dp) if len(members[d]) < per_rank), key=lambda d: (load[d], d))
        members[d].append(r)
        load[d] += lengths[r]
    return members


def token_split(lengths_B: torch.Tensor, dp: int, tp: int, micro_batch_size: int, max_tokens: int) -> Split:
    """Micro-batches of at most `max_tokens` padded tokens (the module docstring's split by tokens);
    `lengths_B`: each row's prompt + response length."""
    B = int(lengths_B.shape[0])
    per_rank = math.ceil(B / dp)
    padded = dp * per_rank
    lengths = torch.cat([lengths_B, torch.ones(padded - B, dtype=lengths_B.dtype)]).tolist()
    ranks = []
    for rows in balanced_ranks(lengths, dp, per_rank):  # each rank's rows longest first, as dealt
        groups: list[list[int]] = []
        for r in rows:
            if groups and len(groups[-1]) < micro_batch_size and \
                    (len(groups[-1]) + 1) * _round_up(lengths[groups[-1][0]], tp) <= max_tokens:
                groups[-1].append(r)
            else:
                groups.append([r])
        ranks.append(groups)
    count = max(len(groups) for groups in ranks)
    for groups in ranks:
        while len(groups) < count:  # count <= per_rank rows: some group has two rows
            widest = max(range(len(groups)), key=lambda i: (len(groups[i]), -i))
            half = len(groups[widest]) // 2
            groups[widest:widest + 1] = [groups[widest][:half], groups[widest][half:]]
    return Split([[MicroBatch(torch.tensor(g), _round_up(max(lengths[r] for r in g), tp)) for g in groups]
                  for groups in ranks], padded)
