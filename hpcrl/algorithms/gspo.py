"""GSPO: a sequence-level, length-normalised importance ratio with sequence-level clipping.

Shape legend: B sequences, T response positions; `adv_BT` is [B, 1] (broadcast) or [B, T].

GSPO (Zheng et al., arXiv 2507.18071, eq. 5-7) replaces PPO's token ratio by the geometric mean of the
sequence's token ratios, and clips whole sequences:

    s_i(theta) = (pi(y_i | x) / pi_old(y_i | x))^(1 / |y_i|)
               = exp((1 / |y_i|) sum_t log(pi(y_it) / pi_old(y_it)))
    J = E[ (1 / G) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i) ]

Its token form GSPO-token (eq. 13-14) uses, per token, s_it = sg[s_i] * pi(y_it) / sg[pi(y_it)]: the
value equals s_i, the gradient of s_it is s_i * grad log pi(y_it). With A_it = A_i and the
`seq-mean-token-mean` aggregation, its loss value and gradient equal GSPO's exactly; with per-token
advantages it is GSPO-token. `gspo_loss` implements that form, so it aggregates like any other loss.

The paper's clip ranges are far narrower than PPO's (3e-4 and 4e-4) because s_i is an average of
log-ratios. Simplification (as verl): log s_it is clamped at 10 before exp for numerical safety.
"""

from __future__ import annotations

import torch

LOG_RATIO_MAX = 10.0


def sequence_log_ratio(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor,
                       mask_BT: torch.Tensor) -> torch.Tensor:
    """log s_i: the mean over the sequence's valid tokens of log pi - log pi_old, shape [B]."""
    mask = mask_BT.to(logp_BT.dtype)
    return ((logp_BT - old_logp_BT) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


def gspo_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, adv_BT: torch.Tensor,
              mask_BT: torch.Tensor, clip_eps_low: float = 3e-4, clip_eps_high: float = 4e-4,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token GSPO-token loss -min(s_it A, clip(s_it) A) and per-token metrics (`clip_frac`: the
    token's sequence was clipped; `seq_ratio`: s_i on each token). Aggregate with
    `seq-mean-token-mean` for GSPO proper. Only `logp_BT` carries the gradient."""
    if adv_BT.dim() != 2:
        raise ValueError(f"advantages must be [B, T] or [B, 1] (pass adv_B[:, None]), "
                         f"got shape {tuple(adv_BT.shape)}")
    adv_BT = adv_BT.to(logp_BT.dtype)
    log_s_B = sequence_log_ratio(logp_BT, old_logp_BT, mask_BT).detach()
    log_s_BT = (log_s_B.unsqueeze(1) + logp_BT - logp_BT.detach()).clamp(max=LOG_RATIO_MAX)
    s_BT = torch.exp(log_s_BT)
    unclipped_BT = -adv_BT * s_BT
    clipped_BT = -adv_BT * s_BT.clamp(1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    with torch.no_grad():
        metrics = {
            "clip_frac": (clipped_BT > unclipped_BT).to(logp_BT.dtype),
            "seq_ratio": s_BT.detach().expand_as(logp_BT).clone(),
        }
    return loss_BT, metrics
