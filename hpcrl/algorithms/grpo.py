"""GRPO: group-relative advantages and the clipped policy loss with a KL penalty.

Math (per prompt group g of G completions with scalar rewards r_i):

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)          # norm_adv_by_std=True (GRPO)
    A_i =  r_i - mean_g(r)                               # norm_adv_by_std=False (Dr. GRPO)

Per response token t of completion i, with ratio rho = exp(logp - logp_old):

    L_pg = -min(rho * A_i, clip(rho, 1 - eps, 1 + eps_high) * A_i)     eps_high = eps unless set
    L    = L_pg + kl_coef * KL_est(logp, logp_ref)
    k1 = logp - logp_ref;  k2 = (logp - logp_ref)^2 / 2;  k3 = exp(logp_ref - logp) - (logp_ref - logp) - 1

Aggregation over tokens (mask = response tokens): token-mean (all tokens of the batch equal),
seq-mean-token-mean (each sequence equal), seq-mean-token-sum (each sequence's token sum),
seq-mean-token-sum-norm (Dr. GRPO: token sum over a constant, `loss_agg_norm`); see
`hpcrl.algorithms.aggregation`. The advantages, KL estimators and aggregation live in their own
modules (`advantages`, `kl`, `aggregation`) and are re-exported here under their historical names;
the per-token surrogate is `policy_loss.ppo_clip_loss` (so `clip_frac` counts the tokens whose
clipped branch was taken: rho > 1 + eps_high with A > 0, rho < 1 - eps with A < 0, as verl's
pg_clipfrac). With algorithm.ppo_epochs 1 and one mini-batch the update is on-policy (rho = 1, the
clip never acts); more epochs or mini-batches move the ratio. The std uses the unbiased estimator
like TRL and verl.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hpcrl.algorithms import KL_ESTIMATORS, LOSS_AGGS
from hpcrl.algorithms.advantages import group_advantages
from hpcrl.algorithms.aggregation import aggregate
from hpcrl.algorithms.kl import kl_estimate
from hpcrl.algorithms.policy_loss import ppo_clip_loss

__all__ = ["KL_ESTIMATORS", "LOSS_AGGS", "GRPOLossConfig", "aggregate", "group_advantages", "grpo_loss",
           "kl_estimate"]


@dataclass(frozen=True, kw_only=True)
class GRPOLossConfig:
    """The constants of `grpo_loss`; `loss_agg_norm` is the divisor of `seq-mean-token-sum-norm`,
    `clip_eps_high` the upper clip range (None: `clip_eps`), `clip_ratio_c` dual clip's c (None: off)."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    clip_ratio_c: float | None = None
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    loss_agg: str = "token-mean"
    loss_agg_norm: float | None = None

    def __post_init__(self) -> None:
        needs_norm = self.loss_agg == "seq-mean-token-sum-norm"
        if needs_norm and (self.loss_agg_norm is None or self.loss_agg_norm <= 0):
            raise ValueError("loss_agg='seq-mean-token-sum-norm' needs loss_agg_norm > 0 (e.g. the maximum "
                             f"response length), got loss_agg_norm={self.loss_agg_norm!r}")


def grpo_loss(logp_BT: torch.Tensor, old_logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor | None,
              advantages_B: torch.Tensor, mask_BT: torch.Tensor, cfg: GRPOLossConfig,
              num_tokens: float | None = None, num_seqs: float | None = None,
              weights_BT: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The GRPO loss of one (micro-)batch and detached metrics (pg loss, kl, clip fraction).

    `logp_BT` carries the gradient; the other tensors are constants. Shapes: B sequences x T
    response positions; `mask_BT` is 1 on generated tokens. `weights_BT` (rollout correction: TIS
    weights or an MIS mask, detached) multiplies the policy-gradient term per token.
    """
    pg_BT, token = ppo_clip_loss(logp_BT, old_logp_BT, advantages_B.unsqueeze(1), cfg.clip_eps,
                                 cfg.clip_eps_high, cfg.clip_ratio_c)
    if weights_BT is not None:  # rollout correction: detached per-token importance weights or a mask
        pg_BT = pg_BT * weights_BT
    pg = aggregate(pg_BT, mask_BT, cfg.loss_agg, num_tokens, num_seqs, cfg.loss_agg_norm)
    loss = pg
    kl = torch.zeros((), dtype=logp_BT.dtype)
    if ref_logp_BT is not None and cfg.kl_coef != 0.0:
        kl = aggregate(kl_estimate(logp_BT, ref_logp_BT, cfg.kl_estimator, mask_BT), mask_BT, cfg.loss_agg,
                       num_tokens, num_seqs, cfg.loss_agg_norm)
        loss = loss + cfg.kl_coef * kl
    clip_frac = aggregate(token["clip_frac"], mask_BT, "token-mean", num_tokens)
    return loss, {"pg_loss": pg.detach(), "kl": kl.detach(), "clip_frac": clip_frac.detach()}
