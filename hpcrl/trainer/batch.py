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

With routing replay (rollout.routing_replay) a batch also carries the engines' MoE routes:
`routes_BLNK[b, s, j]` are the K experts MoE layer j (the j-th MoE layer of the model) sent token
`tokens_BL[b, s]` to, for s < P_b + R_b - 1 (every position that was a forward input of the engine;
the last sampled token never was). Every other position (that last token, padding, dummy rows) holds
`filler_routes` (K distinct valid ids: Megatron's alltoall dispatcher needs K experts per row).
Stored compactly (uint8 up to 256 experts, int16 beyond); cast to int64 per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

PAD_ID = 0


@dataclass(frozen=True)
class TrainBatch:
    """B right-padded prompt+response rows (see the module docstring for the alignment)."""

    tokens_BL: torch.Tensor
    prompt_lens_B: torch.Tensor
    response_lens_B: torch.Tensor
    routes_BLNK: torch.Tensor | None = None

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
        if self.routes_BLNK is not None and (self.routes_BLNK.dim() != 4 or self.routes_BLNK.shape[:2] != (B, L)):
            raise ValueError(f"routes_BLNK must be [B={B}, L={L}, moe layers, top_k], got "
                             f"{tuple(self.routes_BLNK.shape)}")

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
                          self.response_lens_B[start:stop], _cut(self.routes_BLNK, slice(start, stop)))

    @staticmethod
    def from_lists(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                   routes: Sequence[Any] | None = None) -> TrainBatch:
        """Build a batch from per-row prompt ids and response ids (equal-length lists) and, for routing
        replay, per-row routes: arrays [P + R - 1, moe layers, top_k] (numpy or torch, any int dtype)."""
        if len(prompts) != len(responses):
            raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses; "
                             "pass one response per prompt")
        rows = [[*p, *r] for p, r in zip(prompts, responses)]
        L = max(map(len, rows), default=0)
        # one tensor from padded lists: a tensor per row costs ~20 us each
        tokens = torch.tensor([row + [PAD_ID] * (L - len(row)) for row in rows] or [[]], dtype=torch.int64)
        return TrainBatch(tokens[: len(rows)], torch.tensor([len(p) for p in prompts], dtype=torch.int64),
                          torch.tensor([len(r) for r in responses], dtype=torch.int64),
                          None if routes is None else _routes_BLNK(routes, [len(row) for row in rows], L))

    def mini_batches(self, size: int) -> list[tuple[slice, TrainBatch]]:
        """The contiguous blocks of `size` rows (0: the whole batch), in order, each with its rows and
        its own sub-batch (whose T is its own longest response: cut a [B, T] tensor of this batch with
        `[rows, :sub.response_width]`). ValueError when `size` does not divide the batch."""
        B = self.batch_size
        size = size or B
        if B % size:
            raise ValueError(f"mini_batch_size={size} does not divide the batch of {B} rows")
        blocks = (slice(start, start + size) for start in range(0, B, size))
        return [(rows, TrainBatch(self.tokens_BL[rows], self.prompt_lens_B[rows], self.response_lens_B[rows],
                                  _cut(self.routes_BLNK, rows)))
                for rows in blocks]

    def padded(self, num_rows: int, seq_len: int) -> TrainBatch:
        """This batch with dummy rows (prompt = one pad token, empty response) appended up to
        `num_rows` and pad columns up to `seq_len`; real rows' log-prob columns are unchanged."""
        B, L = self.tokens_BL.shape
        assert num_rows >= B and seq_len >= L, (num_rows, seq_len, B, L)
        tokens = torch.full((num_rows, seq_len), PAD_ID, dtype=torch.int64)
        tokens[:B, :L] = self.tokens_BL
        extra = num_rows - B
        routes = None
        if self.routes_BLNK is not None:
            _, _, N, K = self.routes_BLNK.shape
            routes = filler_routes(K, self.routes_BLNK.dtype).expand(num_rows, seq_len, N, K).clone()
            routes[:B, :L] = self.routes_BLNK
        return TrainBatch(tokens, torch.cat([self.prompt_lens_B, torch.ones(extra, dtype=torch.int64)]),
                          torch.cat([self.response_lens_B, torch.zeros(extra, dtype=torch.int64)]), routes)


def route_dtype(num_experts: int) -> torch.dtype:
    """The compact dtype of expert ids: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 32768:
        return torch.int16
    raise ValueError(f"{num_experts} experts: routes are stored as int16 at most (32768)")


def filler_routes(top_k: int, dtype: torch.dtype) -> torch.Tensor:
    """The route of a position no engine route exists for: experts 0..K-1 (distinct, valid)."""
    return torch.arange(top_k).to(dtype)


def _cut(routes: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if routes is None else routes[rows]


def _routes_BLNK(routes: Sequence[Any], lengths: list[int], L: int) -> torch.Tensor:
    """[B, L, N, K] from per-row [P + R - 1, N, K] arrays, filler elsewhere; ValueError naming the row
    whose route count or shape does not match its tokens."""
    if len(routes) != len(lengths):
        raise ValueError(f"{len(routes)} route arrays for {len(lengths)} rows; pass one per row")
    arrays = [torch.as_tensor(r) for r in routes]
    shapes = {tuple(a.shape[1:]) for a in arrays}
    if len(shapes) != 1 or len(next(iter(shapes))) != 2:
        raise ValueError(f"route arrays must be [tokens, moe layers, top_k] with one (layers, top_k) for "
                         f"every row, got {sorted(shapes)}")
    N, K = next(iter(shapes))
    top = max((int(a.max()) for a in arrays if a.numel()), default=0)
    dtype = route_dtype(max(top + 1, K))
    out = filler_routes(K, dtype).expand(len(arrays), L, N, K).clone()
    for b, (a, n) in enumerate(zip(arrays, lengths)):
        if a.shape[0] != n - 1:
            raise ValueError(f"row {b}: {a.shape[0]} routes for {n} tokens; the engine routes every token but "
                             f"the last sampled one ({n - 1})")
        out[b, : n - 1] = a.to(dtype)
    return out
