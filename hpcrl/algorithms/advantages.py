"""Outcome advantages from one scalar reward per completion: GRPO, Dr. GRPO and RLOO.

Shape legend: N = num_groups * group_size completions laid out group after group (the G completions
of one prompt are contiguous), G completions per group, B sequences, T response positions.

Per group of G completions of one prompt with rewards r_1..r_G:

    GRPO     (DeepSeekMath, arXiv 2402.03300):   A_i = (r_i - mean(r)) / (std(r) + eps)
    Dr. GRPO (arXiv 2503.20783, section 3.2):    A_i =  r_i - mean(r)
    RLOO     (Ahmadian et al., arXiv 2402.14740): A_i =  r_i - (1 / (G - 1)) sum_{j != i} r_j
                                                     =  G / (G - 1) * (r_i - mean(r))

Every token of completion i gets A_i (outcome supervision); `per_token` broadcasts. Simplifications:
std is the unbiased estimator (as TRL and verl); GRPO's process-supervision variant is not offered.
"""

from __future__ import annotations

import torch


def group_advantages(rewards_N: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages of N = num_groups * group_size rewards laid out group after group."""
    r_GS = rewards_N.reshape(-1, group_size).to(torch.float64)
    centred_GS = r_GS - r_GS.mean(dim=1, keepdim=True)
    if norm_by_std:
        std_G1 = r_GS.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(r_GS[:, :1])
        centred_GS = centred_GS / (std_G1 + eps)
    return centred_GS.reshape(-1).to(rewards_N.dtype)


def dr_grpo_advantages(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """Dr. GRPO's advantages: the group-centred rewards without the division by the group's std
    (which over-weights questions that are too easy or too hard). Pair with the
    `seq-mean-token-sum-norm` aggregation to also remove the 1/|o_i| length bias."""
    return group_advantages(rewards_N, group_size, norm_by_std=False)


def rloo_advantages(rewards_N: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE leave-one-out: each completion's baseline is the mean reward of the *other* G - 1
    completions of its prompt, so the baseline is independent of the sample it scores."""
    if group_size < 2:
        raise ValueError(f"RLOO needs at least 2 samples per prompt for a leave-one-out baseline, "
                         f"got group_size={group_size}")
    r_GS = rewards_N.reshape(-1, group_size).to(torch.float64)
    loo_baseline_GS = (r_GS.sum(dim=1, keepdim=True) - r_GS) / (group_size - 1)
    return (r_GS - loo_baseline_GS).reshape(-1).to(rewards_N.dtype)


def per_token(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Broadcast one advantage per sequence to its response tokens (zero on padding)."""
    return adv_B.unsqueeze(1) * mask_BT.to(adv_B.dtype)
