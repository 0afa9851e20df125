"""Rollout correction: importance weights for the engine/trainer mismatch (TIS, MIS) and its metrics.

Shape legend: B sequences, T response positions; `mask_BT` is 1 on generated tokens.

The rollout engine samples from its own numerics mu (the behaviour policy: other kernels, bf16, fp8),
while the loss's ratio uses the trainer's pi_old on the same weights. The gap makes on-policy RL
off-policy (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"). With per-token log-ratio d_t = log pi_old(y_t) - log mu(y_t):

    TIS (token-level truncated IS):  w_t = min(exp(d_t), C)           multiplies the per-token loss
    MIS (masked IS, rejection):      rho_i = exp(sum_t d_t)           ("sequence", verl's seq_sum_k1)
                                     rho_i = exp(mean_t d_t)          ("geometric", verl's seq_mean_k1)
                                     keep_it = 1[lo <= rho_i <= hi]   every token of sequence i
                                     keep_it = 1[lo <= exp(d_t) <= hi]  ("token", verl's token_k1)

Both are constants in the loss (no gradient flows through mu or pi_old). Apply TIS as
`loss_BT * w_BT` before aggregation. Apply MIS to the mask, `mask_BT * keep_BT`, *before* counting the
batch's global tokens and sequences (`kept_counts`), so the rejected samples leave every term of the
loss (policy gradient, KL, entropy) and its denominators, as verl's rejection sampling does (it
rewrites the batch's response_mask). Metrics (means over this batch, or over the global counts if
given) estimate KL(mu || pi_old) from the engine's samples: k1 = mean(-d), k3 = mean(exp(d) - 1 - d).
"""

from __future__ import annotations

import math

import torch

from hpcrl.algorithms import MIS_LEVELS
from hpcrl.algorithms.aggregation import aggregate

SEQUENCE_LEVELS = tuple(level for level in MIS_LEVELS if level != "token")
"""The MIS levels that test one ratio per sequence (sequence_is_log_ratio)."""
LOG_RATIO_LIMIT = 20.0


def _log_ratio(old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor) -> torch.Tensor:
    return (old_logp_BT - behaviour_logp_BT).detach().clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)


def tis_weights(old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                cap: float = 2.0, num_tokens: float | None = None,
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Detached truncated importance weights min(pi_old / mu, cap) per token (0 on padding), and the
    metrics `tis_weight_mean` and `tis_truncated_frac` (share of tokens whose ratio exceeded the cap)."""
    if cap <= 0:
        raise ValueError(f"the TIS cap must be > 0 (e.g. 2.0), got {cap}")
    mask = mask_BT.to(old_logp_BT.dtype)
    ratio_BT = torch.exp(_log_ratio(old_logp_BT, behaviour_logp_BT))
    weights_BT = ratio_BT.clamp(max=cap) * mask
    metrics = {
        "tis_weight_mean": aggregate(weights_BT, mask, "token-mean", num_tokens),
        "tis_truncated_frac": aggregate((ratio_BT > cap).to(mask.dtype), mask, "token-mean", num_tokens),
    }
    return weights_BT, metrics


def sequence_is_log_ratio(old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor,
                          mask_BT: torch.Tensor, level: str = "sequence") -> torch.Tensor:
    """log rho_i of each sequence: the sum (`sequence`) or mean (`geometric`) of token log-ratios, [B]."""
    if level not in SEQUENCE_LEVELS:
        raise ValueError(f"level={level!r}; valid: {', '.join(SEQUENCE_LEVELS)}")
    mask = mask_BT.to(old_logp_BT.dtype)
    d_sum_B = ((old_logp_BT - behaviour_logp_BT).detach() * mask).sum(dim=1)
    return d_sum_B if level == "sequence" else d_sum_B / mask.sum(dim=1).clamp(min=1.0)


def mis_mask(old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
             lo: float = 0.5, hi: float = 2.0, level: str = "sequence", num_seqs: float | None = None,
             num_tokens: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The MIS keep mask [B, T]: 1.0 on the valid tokens whose sequence's IS ratio (`sequence`,
    `geometric`) or own ratio (`token`) lies in [lo, hi], 0.0 elsewhere (padding included); and the
    metrics `mis_masked_frac`, the share of sequences rejected (of tokens at the `token` level), and
    `mis_log_ratio_mean`, the mean log ratio tested (per sequence, or per token)."""
    if not 0.0 < lo <= 1.0 <= hi:
        raise ValueError(f"MIS needs 0 < lo <= 1 <= hi, got lo={lo}, hi={hi}")
    if level not in MIS_LEVELS:
        raise ValueError(f"level={level!r}; valid: {', '.join(MIS_LEVELS)}")
    mask = mask_BT.to(old_logp_BT.dtype)
    log_lo, log_hi = math.log(lo), math.log(hi)
    if level == "token":
        d_BT = (old_logp_BT - behaviour_logp_BT).detach()
        keep_BT = ((d_BT >= log_lo) & (d_BT <= log_hi)).to(mask.dtype) * mask
        metrics = {"mis_masked_frac": aggregate(1.0 - keep_BT, mask, "token-mean", num_tokens),
                   "mis_log_ratio_mean": aggregate(d_BT, mask, "token-mean", num_tokens)}
        return keep_BT, metrics
    log_rho_B = sequence_is_log_ratio(old_logp_BT, behaviour_logp_BT, mask_BT, level)
    keep_B = ((log_rho_B >= log_lo) & (log_rho_B <= log_hi)).to(log_rho_B.dtype)
    seqs = num_seqs if num_seqs is not None else max(keep_B.shape[0], 1)
    metrics = {"mis_masked_frac": (1.0 - keep_B).sum() / seqs, "mis_log_ratio_mean": log_rho_B.sum() / seqs}
    return keep_B.unsqueeze(1) * mask, metrics


def kept_counts(mask_BT: torch.Tensor, keep_BT: torch.Tensor) -> tuple[int, int]:
    """The loss's token and sequence counts after MIS: the kept tokens, and the rows minus those whose
    every token was rejected (a row without tokens stays counted, as without MIS). Use them as the
    global `num_tokens` / `num_seqs` of the step's batch."""
    valid_BT = mask_BT.bool()
    kept_BT = valid_BT & (keep_BT > 0)
    rejected_rows = int((valid_BT.any(dim=1) & ~kept_BT.any(dim=1)).sum())
    return int(kept_BT.sum()), mask_BT.shape[0] - rejected_rows


def mismatch_metrics(old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
                     num_tokens: float | None = None) -> dict[str, torch.Tensor]:
    """Token-mean estimates of KL(mu || pi_old) (`mismatch_kl_k1`, `mismatch_kl_k3`) and the mean
    absolute log-ratio (`mismatch_abs_log_ratio`); all 0 when engine and trainer agree."""
    d_BT = _log_ratio(old_logp_BT, behaviour_logp_BT)
    mask = mask_BT.to(d_BT.dtype)
    return {
        "mismatch_kl_k1": aggregate(-d_BT, mask, "token-mean", num_tokens),
        "mismatch_kl_k3": aggregate(torch.exp(d_BT) - 1.0 - d_BT, mask, "token-mean", num_tokens),
        "mismatch_abs_log_ratio": aggregate(d_BT.abs(), mask, "token-mean", num_tokens),
    }
