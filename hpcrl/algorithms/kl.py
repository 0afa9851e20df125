"""KL estimators between the policy and a reference, and the adaptive KL coefficient.

Shape legend: B sequences, T response positions.

With log_ratio = logp - ref_logp on tokens sampled from the policy pi (J. Schulman, "Approximating KL
divergence", 2020):

    k1 = log_ratio                               unbiased, high variance, can be negative
    k2 = log_ratio^2 / 2                         biased, low variance
    k3 = exp(-log_ratio) + log_ratio - 1         unbiased, low variance, >= 0 (GRPO's choice)

KL enters an algorithm in one of two places: as a loss term (GRPO: `kl_coef * aggregate(k3)`) or
folded into the per-token reward before the advantage (PPO's `kl_ctrl`, REINFORCE++; see
`hpcrl.algorithms.reinforce_pp.token_rewards`). Simplification: unlike verl, no clamp of k3 to
[-10, 10]; the trainer keeps log-probs finite, and positions outside the mask are left out before the
exp (`kl_estimate`'s `mask_BT`).
"""

from __future__ import annotations

import torch

from hpcrl.algorithms import KL_ESTIMATORS


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: str,
                mask_BT: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi; 0, with no gradient, where `mask_BT`
    is 0. The log-probs there are not the samples' (padding: the forward's log p(pad | pad), which a
    low temperature can push below -88, where k3's exp overflows float32 and inf * 0 is NaN)."""
    log_ratio = logp_BT - ref_logp_BT
    if mask_BT is not None:
        log_ratio = torch.where(mask_BT.bool(), log_ratio, torch.zeros((), dtype=log_ratio.dtype))
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = -log_ratio
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"kl_estimator={estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def adaptive_kl_coef(kl_coef: float, observed_kl: float, target_kl: float, horizon: float,
                     num_steps: int) -> float:
    """The next KL coefficient of the adaptive controller (Ziegler et al. 2019, arXiv 1909.08593):

        e = clip(observed_kl / target_kl - 1, -0.2, 0.2);   beta <- beta * (1 + e * num_steps / horizon)

    `num_steps` is the number of samples (or steps) the observation covers, as in the paper and verl.
    A fixed controller is simply a constant `kl_coef`.
    """
    if target_kl <= 0 or horizon <= 0:
        raise ValueError(f"adaptive KL needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
    error = min(max(observed_kl / target_kl - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * num_steps / horizon)
