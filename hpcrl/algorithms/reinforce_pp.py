"""REINFORCE++: token-level rewards with a KL penalty, returns-to-go, and batch whitening.

Shape legend: B sequences, T response positions; `mask_BT` is 1 on generated tokens.

REINFORCE++ (Hu et al., arXiv 2501.03262, section 3) builds a per-token reward from the scalar outcome
reward r(x, y) on the final token and a KL penalty on every token, then uses the return as advantage
and normalises it over the whole batch:

    r_t = 1[t = last] * r(x, y) - beta * KL_t,         KL_t = log pi_old(y_t) - log pi_ref(y_t)  (k1)
    G_t = sum_{s >= t} gamma^(s - t) r_s                 (gamma = 1 as in OpenRLHF and verl)
    A_t = (G_t - mean(G)) / sqrt(var(G) + eps)           mean/var over every valid token of the batch

`token_rewards` is also PPO's reward with `kl_ctrl` (KL in the reward rather than in the loss). It
takes KL_t from its caller: hpcrl's reinforce_pp and ppo dataflows pass the engine's log-probs (mu)
in place of pi_old, which they have before the update (docs/algorithms.md, REINFORCE++).
Simplifications: positions with mask 0 inside a response (e.g. tool output) are skipped by the
recursion, carrying the return across them; the std is unbiased (verl), OpenRLHF's is biased.
"""

from __future__ import annotations

import torch

from hpcrl.algorithms.aggregation import whiten


def last_token_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """Index of each sequence's last valid token (0 for an empty sequence)."""
    positions_BT = torch.arange(mask_BT.shape[1], device=mask_BT.device).expand_as(mask_BT)
    return (positions_BT * (mask_BT > 0)).argmax(dim=1)


def token_rewards(scores_B: torch.Tensor, mask_BT: torch.Tensor, kl_BT: torch.Tensor | None = None,
                  kl_coef: float = 0.0) -> torch.Tensor:
    """Per-token rewards: the sequence's score on its last valid token, minus `kl_coef * kl_BT` on
    every valid token. `kl_BT` is a per-token KL estimate (e.g. `kl_estimate(old, ref, "k1")`)."""
    mask = mask_BT.to(scores_B.dtype)
    rewards_BT = torch.zeros_like(mask)
    rewards_BT.scatter_(1, last_token_index(mask_BT).unsqueeze(1), scores_B.unsqueeze(1))
    rewards_BT = rewards_BT * mask
    if kl_BT is not None and kl_coef != 0.0:
        rewards_BT = rewards_BT - kl_coef * kl_BT.to(rewards_BT.dtype) * mask
    return rewards_BT


def returns_to_go(rewards_BT: torch.Tensor, mask_BT: torch.Tensor, gamma: float = 1.0) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} over valid tokens (0 after the end), zero on padding."""
    mask = mask_BT.to(rewards_BT.dtype)
    if gamma == 1.0:  # a reverse cumulative sum: the same additions in the same order, in 4 ops
        return (rewards_BT * mask).flip(1).cumsum(1).flip(1) * mask
    returns_BT = torch.zeros_like(rewards_BT)
    running_B = torch.zeros_like(rewards_BT[:, 0])
    for t in reversed(range(rewards_BT.shape[1])):
        m_B = mask[:, t]
        running_B = m_B * (rewards_BT[:, t] + gamma * running_B) + (1.0 - m_B) * running_B
        returns_BT[:, t] = running_B * m_B
    return returns_BT


def reinforce_pp_advantages(scores_B: torch.Tensor, mask_BT: torch.Tensor,
                            kl_BT: torch.Tensor | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                            eps: float = 1e-8) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ advantages and returns, both [B, T]. Call on the whole batch: the whitening
    statistics are the batch's (over all valid tokens), not a micro-batch's."""
    returns_BT = returns_to_go(token_rewards(scores_B, mask_BT, kl_BT, kl_coef), mask_BT, gamma)
    return whiten(returns_BT, mask_BT, eps=eps), returns_BT
