"""Generalized advantage estimation (Schulman et al. 2015, arXiv 1506.02438) over response tokens.

Shape legend: B sequences, T response positions; `mask_BT` is 1 on generated tokens.

Each generated token is an action; the critic's V_t is its value before emitting token t. With
per-token rewards r_t (the outcome reward on the last token, minus any KL penalty: see
`hpcrl.algorithms.reinforce_pp.token_rewards`):

    delta_t = r_t + gamma * V_{t+1} - V_t             V after the last token is 0 (the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1}         A after the last token is 0
    R_t     = A_t + V_t                               the critic's regression target (returns)

lam = 1 gives Monte-Carlo returns minus V (unbiased, high variance); lam = 0 the one-step TD error.
PPO then whitens A over the batch (`hpcrl.algorithms.aggregation.whiten`) but regresses V on the
unwhitened R. Positions with mask 0 inside a response (e.g. tool output) are skipped: the recursion
carries V_{t+1} and A_{t+1} across them, as verl does. Outputs are zero on padding.
"""

from __future__ import annotations

import torch


def gae_advantages(rewards_BT: torch.Tensor, values_BT: torch.Tensor, mask_BT: torch.Tensor,
                   gamma: float = 1.0, lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE advantages and returns (both [B, T], unwhitened), computed without autograd."""
    with torch.no_grad():
        mask = mask_BT.to(values_BT.dtype)
        adv_BT = torch.zeros_like(values_BT)
        next_value_B = torch.zeros_like(values_BT[:, 0])
        next_adv_B = torch.zeros_like(values_BT[:, 0])
        for t in reversed(range(values_BT.shape[1])):
            m_B = mask[:, t]
            delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
            adv_B = delta_B + gamma * lam * next_adv_B
            next_value_B = m_B * values_BT[:, t] + (1.0 - m_B) * next_value_B
            next_adv_B = m_B * adv_B + (1.0 - m_B) * next_adv_B
            adv_BT[:, t] = adv_B * m_B
        returns_BT = (adv_BT + values_BT) * mask
    return adv_BT, returns_BT
