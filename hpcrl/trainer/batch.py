"""The trainer's batch: right-padded prompt+response token rows and the response log-prob alignment.

Row b of `tokens_BL` is `prompt_b + response_b` followed by pad id 0 up to L = max_b(P_b + R_b),
with P_b = `prompt_lens_B[b]` >= 1 and R_b = `response_lens_B[b]` >= 0. Response log-probs are a
[B, T] tensor with T = max_b R_b (at least 1) whose column t of row b is the log-prob of response
token t, i.e. of `tokens_BL[b, P_b + t]`, under the distribution the model predicts at position
P_b + t - 1:

    logp_BT[b, t] = log_softmax(logits_BLV[b, P_b + t - 1] / temperature)[tokens_BL[b, P_b + t]]

for t < R_b; columns t >= R_b are padding (`response_mask_BT()` is False there, values are 0).
This is the layout of `old_logp_BT`, `ref_logp_BT` and the output of `compute_logprobs`, and it
matches what an engine returns as per-token output log-probs of each completion.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PAD_ID = 0


@dataclass(frozen=True)
class TrainBatch:
    """B right-padded prompt+response rows (see the module docstring for the alignment)."""

    tokens_BL: torch.Tensor
    prompt_lens_B: torch.Tensor
    response_lens_B: torch.Tensor

    def __post_init__(self) -> None:
        t, p, r = self.tokens_BL, self.prompt_lens_B, self.response_lens_B
        if t.dtype != torch.int64 or t.dim() != 2:
            raise ValueError(f"tokens_BL must be a 2-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
        B, L = t.shape
        for name, v in (("prompt_lens_B", p), ("response_lens_B", r)):
            if v.dtype != torch.int64 or tuple(v.shape) != (B,):
                raise ValueError(f"{name} must be int64 of shape ({B},), got {v.dtype} {tuple(v.shape)}")
        if B == 0:
            raise ValueError("TrainBatch needs at least one row")
        if int(p.min()) < 1:
            raise ValueError(f"prompt_lens_B must be >= 1 (the first response token needs a context), "
                             f"got min {int(p.min())}")
        if int(r.min()) < 0 or int((p + r).max()) > L:
            raise ValueError(f"prompt_lens_B + response_lens_B must lie in [1, L={L}] and response_lens_B "
                             f">= 0; got max {int((p + r).max())}, min response {int(r.min())}")

    @property
    def batch_size(self) -> int:
        return int(self.tokens_BL.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.tokens_BL.shape[1])

    @property
    def response_width(self) -> int:
        """T: columns of the [B, T] log-prob tensors (max response length, at least 1)."""
        return max(1, int(self.response_lens_B.max()))

    def response_mask_BT(self) -> torch.Tensor:
        """Bool [B, T], True where column t is a real response token (t < R_b)."""
        return torch.arange(self.response_width).unsqueeze(0) < self.response_lens_B.unsqueeze(1)

    def num_response_tokens(self) -> int:
        return int(self.response_lens_B.sum())

    def logit_positions_BT(self) -> torch.Tensor:
        """Int64 [B, T]: the position P_b + t - 1 whose logits predict response token t (clamped
        into [0, L) on padding columns)."""
        pos = self.prompt_lens_B.unsqueeze(1) - 1 + torch.arange(self.response_width).unsqueeze(0)
        return pos.clamp(max=self.seq_len - 1)

    def response_tokens_BT(self) -> torch.Tensor:
        """Int64 [B, T]: response token t of row b (pad id on padding columns)."""
        idx = (self.logit_positions_BT() + 1).clamp(max=self.seq_len - 1)
        return torch.where(self.response_mask_BT(), self.tokens_BL.gather(1, idx), PAD_ID)

    def padding_mask_BL(self) -> torch.Tensor:
        """Bool [B, L], True on pad positions (after prompt + response)."""
        ends_B1 = (self.prompt_lens_B + self.response_lens_B).unsqueeze(1)
        return torch.arange(self.seq_len).unsqueeze(0) >= ends_B1

    def rows(self, start: int, stop: int) -> TrainBatch:
        """Rows [start, stop) (same L, so log-prob columns keep their meaning)."""
        return TrainBatch(self.tokens_BL[start:stop], self.prompt_lens_B[start:stop],
                          self.response_lens_B[start:stop])

    @staticmethod
    def from_lists(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> TrainBatch:
        """Build a batch from per-row prompt ids and response ids (equal-length lists)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses; "
                             "pass one response per prompt")
        rows = [[*p, *r] for p, r in zip(prompts, responses)]
        L = max(map(len, rows), default=0)
        # one tensor from padded lists: a tensor per row costs ~20 us each
        tokens = torch.tensor([row + [PAD_ID] * (L - len(row)) for row in rows] or [[]], dtype=torch.int64)
        return TrainBatch(tokens[: len(rows)], torch.tensor([len(p) for p in prompts], dtype=torch.int64),
                          torch.tensor([len(r) for r in responses], dtype=torch.int64))

    def mini_batches(self, size: int) -> list[tuple[slice, TrainBatch]]:
        """The contiguous blocks of `size` rows (0: the whole batch), in order, each with its rows and
        its own sub-batch (whose T is its own longest response: cut a [B, T] tensor of this batch with
        `[rows, :sub.response_width]`). ValueError when `size` does not divide the batch."""
        B = self.batch_size
        size = size or B
        if B % size:
            raise ValueError(f"mini_batch_size={size} does not divide the batch of {B} rows")
        blocks = (slice(start, start + size) for start in range(0, B, size))
        return [(rows, TrainBatch(self.tokens_BL[rows], self.prompt_lens_B[rows], self.response_lens_B[rows]))
                for rows in blocks]

    def padded(self, num_rows: int, seq_len: int) -> TrainBatch:
        """This batch with dummy rows (prompt = one pad token, empty response) appended up to
        `num_rows` and pad columns up to `seq_len`; real rows' log-prob columns are unchanged."""
        B, L = self.tokens_BL.shape
        assert num_rows >= B and seq_len >= L, (num_rows, seq_len, B, L)
        tokens = torch.full((num_rows, seq_len), PAD_ID, dtype=torch.int64)
        tokens[:B, :L] = self.tokens_BL
        extra = num_rows - B
        return TrainBatch(tokens, torch.cat([self.prompt_lens_B, torch.ones(extra, dtype=torch.int64)]),
                          torch.cat([self.response_lens_B, torch.zeros(extra, dtype=torch.int64)]))
