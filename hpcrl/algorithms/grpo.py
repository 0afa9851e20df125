"""GRPO: group-relative advantages and the clipped policy loss with a KL penalty.

Math (per prompt group g of G completions with scalar rewards r_i):

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)          # norm_adv_by_std=True (GRPO)
    A_i =  r_i - mean_g(r)                               # norm_adv_by_std=False (Dr. GRPO)

Per response token t of completion i, with ratio rho = exp(logp - logp_old):

    L_pg = -min(rho * A_i, clip(rho, 1 - eps, 1 + eps) * A_i)
    L    = L_pg + kl_coef * KL_est(logp, logp_ref)
    k1 = logp - logp_ref;  k2 = (logp - logp_ref)^2 / 2;  k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1

Aggregation over tokens (mask = response tokens): token-mean (all tokens of the batch equal),
seq-mean-token-mean (each sequence equal), seq-mean-token-sum (each sequence's token sum).
Simplifications: one policy update per rollout batch (so rho = 1 on the forward pass, the clip only
shapes the gradient through later micro-batches' identical weights); the std uses the unbiased
estimator like TRL and verl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.algorithms import KL_ESTIMATORS, LOSS_AGGS


def group_advantages(rewards_N: torch.Tensor, group_size: int, norm_by_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """Advantages of N = num_groups * group_size rewards laid out group after group."""
    r_GS = rewards_N.reshape(-1, group_size).to(torch.float64)
    centred_GS = r_GS - r_GS.mean(dim=1, keepdim=True)
    if norm_by_std:
        std_G1 = r_GS.std(dim=1, keepdim=True) if group_size > 1 else torch.ones_like(r_GS[:, :1])
        centred_GS = centred_GS / (std_G1 + eps)
    return centred_GS.reshape(-1).to(rewards_N.dtype)


def kl_estimate(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi."""
    log_ratio = logp_BT - ref_logp_BT
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        neg = -log_ratio
        return torch.exp(neg) - neg - 1.0
    raise ValueError(f"kl_estimator={estimator!r}; valid: {', '.join(KL_ESTIMATORS)}")


def aggregate(values_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str,
              num_tokens: float | None = None, num_seqs: float | None = None) -> torch.Tensor:
    """Reduce per-token values to a scalar. `num_tokens`/`num_seqs` are the *global* batch counts, so
    micro-batch losses add up to the full-batch loss under gradient accumulation."""
    mask = mask_BT.to(values_BT.dtype)
    if mode == "token-mean":
        denom = num_tokens if num_tokens is not None else mask.sum().clamp(min=1.0)
        return (values_BT * mask).sum() / denom
    seqs = num_seqs if num_seqs is not None else values_BT.shape[0]
    if mode == "seq-mean-token-mean":
        per_seq = (values_BT * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
        return per_seq.sum() / seqs
    if mode == "seq-mean-token-sum":
        return (values_BT * mask).sum() / seqs
    raise ValueError(f"loss_agg={mode!r}; valid: {', '.join(LOSS_AGGS)}")


@dataclass(frozen=True, kw_only=True)
class GRPOLossConfig:
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"


def grpo_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor | None,
              advantages_B: torch.Tensor, mask_BT: torch.Tensor, cfg: GRPOLossConfig,
              num_tokens: float | None = None, num_seqs: float | None = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one (micro-)batch and detached metrics (pg loss, kl, clip fraction).

    `logp_BT` carries the gradient; the other tensors are constants. Shapes: B sequences x T
    response positions; `mask_BT` is 1 on generated tokens.
    """
    adv_B1 = advantages_B.unsqueeze(1).to(logp_BT.dtype)
    ratio_BT = torch.exp(logp_BT - old_logp_BT)
    clipped_BT = ratio_BT.clamp(1.0 - cfg.clip_eps, 1.0 + cfg.clip_eps)
    pg_BT = -torch.minimum(ratio_BT * adv_B1, clipped_BT * adv_B1)
    pg = aggregate(pg_BT, mask_BT, cfg.loss_agg, num_tokens, num_seqs)
    loss = pg
    kl = torch.zeros((), dtype=logp_BT.dtype)
    if ref_logp_BT is not None and cfg.kl_coef != 0.0:
        kl = aggregate(kl_estimate(logp_BT, ref_logp_BT, cfg.kl_estimator), mask_BT, cfg.loss_agg,
                       num_tokens, num_seqs)
        loss = loss + cfg.kl_coef * kl
    clip_frac = aggregate(((ratio_BT - clipped_BT).abs() > 0).to(logp_BT.dtype), mask_BT, "token-mean",
                          num_tokens)
    return loss, {"pg_loss": pg.detach(), "kl": kl.detach(), "clip_frac": clip_frac.detach()}
