"""Input-token log-probs of the reference engine: SGLang 0.5.23's `logprob_start_len` answer.

A /generate request with `return_logprob` and `logprob_start_len` L >= 0 gets, besides its output,
meta_info["input_token_logprobs"]: for a sequence s of n input tokens, one entry per position
L .. n - 1, the first one's log-prob None (SGLang computes the rows L .. n - 1 of the prefill, each
scoring the token after it, then shifts them by one and drops the last: logprob_result_processor.py
`[None] + input_token_logprobs[:-1]`), entry j > 0 being log p(s[L + j] | s[:L + j]). L == n gives
no entry. So the log-probs of a response r after a prompt p need L = len(p) - 1
(dev/notes_input_logprobs.md has the derivation with file:line references).

`input_token_logprobs` computes those values with one prefill forward over the batch of ragged
sequences (left padded, explicit positions, as the engine's generation prefill), through the engine's
own forward with every position's hidden states kept (`ReferenceModel.hidden_states`: DirectForward's
`every_position` for a Qwen3-MoE model, else transformers' `model.model`), then the engine's LM head (`lm_head_logits`: the model's dtype, or float32 with
`fp32_lm_head`, as its generation) over the rows asked for only, and a float32 log-softmax of the raw
logits, in chunks of `CHUNK_ROWS` rows (SGLang's SGLANG_LOGPROB_CHUNK_SIZE) so the logits never
exceed CHUNK_ROWS x vocab. No temperature: SGLang's input log-probs are those of the unscaled
logits whatever the request's temperature (its output log-probs are divided by it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hpcrl.rollout.direct_forward import lm_head_logits
from hpcrl.rollout.engine import ReferenceModel

__all__ = ["CHUNK_ROWS", "input_token_logprobs"]

CHUNK_ROWS = 2048
"""Logit rows per LM-head chunk (SGLang's SGLANG_LOGPROB_CHUNK_SIZE default)."""


@torch.inference_mode()
def input_token_logprobs(engine: ReferenceModel, sequences: Sequence[Sequence[int]],
                         starts: Sequence[int]) -> list[list[float | None]]:
    """SGLang's input_token_logprobs values of each sequence from its start L (0 <= L <= len):
    [None, log p(s[L+1] | s[:L+1]), ..., log p(s[n-1] | s[:n-1])] (n - L entries), [] when L == n.

    The values are float32 log_softmax(logits)[token] at temperature 1. Sequences are checked as
    the engine checks prompts (non-empty, ids in [0, vocab)); ValueError names a bad sequence or start.
    Only sequences with L <= n - 2 take part in the forward (the others need no logits).
    """
    if len(sequences) != len(starts):
        raise ValueError(f"{len(sequences)} sequences but {len(starts)} starts")
    seqs = [_checked(engine, i, s) for i, s in enumerate(sequences)]
    for i, (s, start) in enumerate(zip(seqs, starts)):
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start <= len(s):
            raise ValueError(f"starts[{i}]={start!r} must be an integer in [0, {len(s)}] (the sequence's "
                             "length)")
    out: list[list[float | None]] = [[] if start == len(s) else [None] for s, start in zip(seqs, starts)]
    todo = [i for i, (s, start) in enumerate(zip(seqs, starts)) if start <= len(s) - 2]
    if not todo:
        return out
    values = _scored([seqs[i] for i in todo], [starts[i] for i in todo], engine)
    for i, vals in zip(todo, values):
        out[i] += vals
    return out


def _checked(engine: ReferenceModel, i: int, seq: Sequence[int]) -> list[int]:
    ids = list(seq) if isinstance(seq, (list, tuple)) else None
    if not ids:
        raise ValueError(f"sequences[{i}] must be a non-empty list of token ids")
    if not all(type(t) is int for t in ids) or min(ids) < 0 or max(ids) >= engine.vocab_size:
        bad = next(t for t in ids if type(t) is not int or not 0 <= t < engine.vocab_size)
        raise ValueError(f"sequences[{i}] holds {bad!r}; token ids must be integers in "
                         f"[0, {engine.vocab_size})")
    return ids


def _scored(seqs: list[list[int]], starts: list[int], engine: ReferenceModel) -> list[list[float]]:
    """log p(s[p] | s[:p]) for p in start + 1 .. n - 1 of each sequence (every one has such a p)."""
    dev = engine.device
    # The last token is only ever a target: the forward runs over s[:-1] (T = n - 1 columns).
    inputs = [s[:-1] for s in seqs]
    lengths = [len(x) for x in inputs]
    T, B = max(lengths), len(inputs)
    tokens_BT = torch.tensor([[engine.pad_token_id] * (T - n) + x for x, n in zip(inputs, lengths)])
    mask_BT = (torch.arange(T)[None, :] >= (T - torch.tensor(lengths))[:, None]).long()
    pos_BT = (mask_BT.cumsum(-1) - 1).clamp(min=0)
    padded = min(lengths) != T  # without padding the plain causal path needs no mask
    mask = mask_BT.to(dev) if padded else None
    hidden_BTH = engine.hidden_states(tokens_BT.to(dev), mask, pos_BT.to(dev))
    # Rows: sequence b's columns for positions start .. n - 2 (left padded: position p at T - len + p).
    rows_b, cols, targets = [], [], []
    for b, (s, start, n) in enumerate(zip(seqs, starts, lengths)):
        rows_b += [b] * (n - start)
        cols += range(T - n + start, T)
        targets += s[start + 1:]
    rows_N, cols_N = torch.tensor(rows_b, device=dev), torch.tensor(cols, device=dev)
    targets_N = torch.tensor(targets, device=dev)
    weight = engine.model.lm_head.weight
    logprobs_N = torch.empty(len(targets), dtype=torch.float32, device=dev)
    for lo in range(0, len(targets), CHUNK_ROWS):
        hi = min(lo + CHUNK_ROWS, len(targets))
        logits_CV = lm_head_logits(hidden_BTH[rows_N[lo:hi], cols_N[lo:hi]], weight, engine.fp32_lm_head)
        logp_CV = torch.log_softmax(logits_CV.float(), -1)
        logprobs_N[lo:hi] = logp_CV.gather(1, targets_N[lo:hi, None])[:, 0]
    flat = logprobs_N.tolist()
    out, k = [], 0
    for start, n in zip(starts, lengths):
        out.append(flat[k:k + n - start])
        k += n - start
    return out
