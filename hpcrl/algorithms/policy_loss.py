"""PPO's clipped policy loss per token, with decoupled clip ranges (DAPO) and dual clip.

Shape legend: B sequences, T response positions. `adv_BT` may be [B, 1] (one advantage per sequence,
broadcast) or [B, T].

PPO (Schulman et al. 2017, arXiv 1707.06347, eq. 7), with rho_t = pi(y_t) / pi_old(y_t):

    l_t = -min(rho_t * A_t, clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)
        =  max(-rho_t * A_t, -clip(rho_t, 1 - eps_low, 1 + eps_high) * A_t)

eps_low = eps_high is PPO; DAPO's clip-higher (arXiv 2503.14476, section 3.1) decouples them, e.g.
eps_low = 0.2 and eps_high = 0.28, so low-probability tokens can grow and entropy does not collapse.
Dual clip (Ye et al. 2020, arXiv 1912.09729) bounds the loss of negative-advantage tokens whose ratio
has exploded: for A_t < 0, l_t = min(l_t, -c * A_t) with c > 1 (verl's `clip_ratio_c`, default 3).

The result is per token: aggregate it with `hpcrl.algorithms.aggregation.aggregate` and the batch's
global counts, and add a KL term (`hpcrl.algorithms.kl.kl_estimate`) where the algorithm wants one.
Simplification (as verl): the log-ratio is clamped to [-20, 20] before exp for numerical safety.
"""

from __future__ import annotations

import torch

LOG_RATIO_LIMIT = 20.0


def ppo_clip_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor,
                  clip_eps_low: float = 0.2, clip_eps_high: float | None = None,
                  clip_ratio_c: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token clipped surrogate loss and per-token metrics (floats in {0, 1} or values):

    - `clip_frac`: the clipped branch was taken (the token gives no gradient),
    - `clip_frac_high` / `clip_frac_low`: of those, the ratio was above 1 + eps_high / below 1 - eps_low,
    - `dual_clip_frac`: the dual clip bound -c * A acted (A < 0),
    - `approx_kl`: k1 estimate of KL(pi_old || pi), old_logp - logp.

    `clip_eps_high=None` means symmetric (= `clip_eps_low`); `clip_ratio_c=None` disables dual clip.
    Only `logp_BT` carries the gradient.
    """
    eps_high = clip_eps_low if clip_eps_high is None else clip_eps_high
    if clip_ratio_c is not None and clip_ratio_c <= 1.0:
        raise ValueError(f"clip_ratio_c must be > 1 (dual-clip lower bound on the ratio), got {clip_ratio_c}")
    if adv_BT.dim() != 2:
        raise ValueError(f"advantages must be [B, T] or [B, 1] (pass adv_B[:, None]), "
                         f"got shape {tuple(adv_BT.shape)}")
    adv_BT = adv_BT.to(logp_BT.dtype)
    log_ratio_BT = (logp_BT - old_logp_BT).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -adv_BT * ratio_BT
    clipped_BT = -adv_BT * ratio_BT.clamp(1.0 - clip_eps_low, 1.0 + eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    took_clip_BT = (clipped_BT > unclipped_BT).to(logp_BT.dtype)
    dual_BT = torch.zeros_like(loss_BT)
    if clip_ratio_c is not None:
        bound_BT = -adv_BT * clip_ratio_c
        dual_BT = ((adv_BT < 0) & (loss_BT > bound_BT)).to(logp_BT.dtype)
        loss_BT = torch.where(adv_BT < 0, torch.minimum(loss_BT, bound_BT), loss_BT)
    with torch.no_grad():
        metrics = {
            "clip_frac": took_clip_BT,
            "clip_frac_high": took_clip_BT * (ratio_BT > 1.0).to(logp_BT.dtype),
            "clip_frac_low": took_clip_BT * (ratio_BT < 1.0).to(logp_BT.dtype),
            "dual_clip_frac": dual_BT,
            "approx_kl": -log_ratio_BT.detach(),
        }
    return loss_BT, metrics
