"""hpcrl/trainer/batch.py: the response log-prob alignment and input validation."""

from __future__ import annotations

import pytest
import torch

from hpcrl.trainer.batch import PAD_ID, TrainBatch


def test_alignment_of_response_columns() -> None:
    batch = TrainBatch.from_lists([[5, 6, 7], [9]], [[10, 11], [12, 13, 14]])
    assert batch.tokens_BL.tolist() == [[5, 6, 7, 10, 11], [9, 12, 13, 14, PAD_ID]]
    assert (batch.batch_size, batch.seq_len, batch.response_width) == (2, 5, 3)
    assert batch.response_mask_BT().tolist() == [[True, True, False], [True, True, True]]
    # column t of row b is token P_b + t, predicted at position P_b + t - 1
    assert batch.response_tokens_BT().tolist() == [[10, 11, PAD_ID], [12, 13, 14]]
    assert batch.logit_positions_BT()[0, :2].tolist() == [2, 3]
    assert batch.logit_positions_BT()[1].tolist() == [0, 1, 2]
    assert batch.padding_mask_BL().tolist() == [[False] * 5, [False] * 4 + [True]]
    assert batch.num_response_tokens() == 5


def test_padding_keeps_real_rows_and_adds_empty_rows() -> None:
    batch = TrainBatch.from_lists([[5, 6], [9]], [[10], []])
    padded = batch.padded(4, 6)
    assert padded.tokens_BL.shape == (4, 6) and padded.response_width == batch.response_width == 1
    assert torch.equal(padded.response_tokens_BT()[:2], batch.response_tokens_BT())
    assert torch.equal(padded.logit_positions_BT()[:2], batch.logit_positions_BT())
    assert padded.response_mask_BT()[2:].sum() == 0 and padded.num_response_tokens() == 1
    assert torch.equal(batch.rows(1, 2).tokens_BL, batch.tokens_BL[1:2])


def test_empty_responses_give_one_masked_column() -> None:
    batch = TrainBatch.from_lists([[1, 2]], [[]])
    assert batch.response_width == 1 and not batch.response_mask_BT().any()


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens_BL=torch.zeros(2, 3, dtype=torch.int32)), "int64"),
    (dict(prompt_lens_B=torch.tensor([0, 1])), "prompt_lens_B must be >= 1"),
    (dict(response_lens_B=torch.tensor([3, 0])), r"lie in \[1, L=3\]"),
    (dict(prompt_lens_B=torch.tensor([1])), r"shape \(2,\)"),
])
def test_bad_batches_raise(kwargs: dict, match: str) -> None:
    base = dict(tokens_BL=torch.ones(2, 3, dtype=torch.int64), prompt_lens_B=torch.tensor([1, 2]),
                response_lens_B=torch.tensor([1, 1]))
    with pytest.raises(ValueError, match=match):
        TrainBatch(**{**base, **kwargs})
    with pytest.raises(ValueError, match="2 prompts but 1 responses"):
        TrainBatch.from_lists([[1], [2]], [[3]])
