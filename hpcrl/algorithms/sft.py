"""Supervised fine-tuning loss and the token entropy metric.

Shape legend: B sequences, T response (answer) positions, V vocabulary.

SFT minimises the cross-entropy of the data's answer tokens given the prompt:

    L = -(1 / N_tok) sum_{i,t} m_it log pi(y_it | x_i, y_i,<t)

i.e. `nll_loss(logp_BT)` aggregated with `token-mean` (the usual choice) or `seq-mean-token-mean`, where
`logp_BT` are the log-probs of the target tokens (the same per-token log-probs the RL losses take) and
the mask covers the answer only, not the prompt. Simplification: no label smoothing.

Entropy H_t = -sum_v p_v log p_v of the policy at each response position: `entropy_from_logits` is the
reference formula; the trainer computes it per tensor-parallel vocab shard, logs it (train/entropy)
and, for the RL algorithms, subtracts algorithm.entropy_coef times its token mean from the loss (the
entropy bonus; not for sft).
"""

from __future__ import annotations

import torch


def nll_loss(logp_BT: torch.Tensor) -> torch.Tensor:
    """Per-token negative log-likelihood of the target tokens; aggregate it with the answer mask."""
    return -logp_BT


def entropy_from_logits(logits_BTV: torch.Tensor) -> torch.Tensor:
    """Per-position entropy of softmax(logits) in nats, [B, T], computed stably via logsumexp."""
    logp_BTV = torch.log_softmax(logits_BTV.float(), dim=-1)
    return -(logp_BTV.exp() * logp_BTV).sum(dim=-1)
