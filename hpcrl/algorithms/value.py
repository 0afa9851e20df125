"""The critic's clipped value loss (PPO2) and its explained-variance metric.

Shape legend: B sequences, T response positions; `mask_BT` is 1 on generated tokens.

With V the critic's current prediction, V_old its prediction at rollout time (the one GAE used) and R
the returns from `hpcrl.algorithms.gae.gae_advantages`:

    V_clip = V_old + clip(V - V_old, -eps_v, eps_v)
    l_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)

This is the value clipping of OpenAI baselines' PPO2 (referred to in Schulman et al. 2017 and studied
in Engstrom et al. 2020, arXiv 2005.12729), as in verl and TRL: the max makes it pessimistic, so a
prediction that moved more than eps_v from V_old gets no gradient when moving further would help.
`clip_eps_value=None` gives the plain 0.5 * (V - R)^2. Aggregate the per-token loss like the policy's.
"""

from __future__ import annotations

import torch

from hpcrl.algorithms.aggregation import masked_var


def value_loss(values_BT: torch.Tensor, old_values_BT: torch.Tensor, returns_BT: torch.Tensor,
               clip_eps_value: float | None = 0.2) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped value loss and per-token metrics (`vf_clip_frac`: the clipped error was the
    larger one, i.e. the token's gradient is cut). Only `values_BT` carries the gradient."""
    returns_BT = returns_BT.to(values_BT.dtype)
    unclipped_BT = (values_BT - returns_BT).square()
    if clip_eps_value is None:
        return 0.5 * unclipped_BT, {"vf_clip_frac": torch.zeros_like(unclipped_BT).detach()}
    v_clip_BT = old_values_BT + (values_BT - old_values_BT).clamp(-clip_eps_value, clip_eps_value)
    clipped_BT = (v_clip_BT - returns_BT).square()
    loss_BT = 0.5 * torch.maximum(unclipped_BT, clipped_BT)
    return loss_BT, {"vf_clip_frac": (clipped_BT > unclipped_BT).to(values_BT.dtype).detach()}


def explained_variance(values_BT: torch.Tensor, returns_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> torch.Tensor:
    """1 - Var(R - V) / Var(R) over the valid tokens: 1 for a perfect critic, 0 for predicting the mean,
    negative for worse. NaN when the returns have no variance."""
    var_returns = masked_var(returns_BT, mask_BT)
    if var_returns <= 0:
        return torch.full((), float("nan"), dtype=values_BT.dtype)
    return 1.0 - masked_var(returns_BT - values_BT, mask_BT) / var_returns
