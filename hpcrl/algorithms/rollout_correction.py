"""Rollout correction: importance weights for the engine/trainer mismatch (TIS, MIS) and its metrics.

Shape legend: B sequences, T response positions; `mask_BT` is 1 on generated tokens.

The rollout engine samples from its own numerics mu (the behaviour policy: other kernels, bf16, fp8),
while the loss's ratio uses the trainer's pi_old on the same weights. The gap makes on-policy RL
off-policy (Yao et al. 2025, "Your efficient RL framework secretly brings you off-policy RL
training"). With per-token log-ratio d_t = log pi_old(y_t) - log mu(y_t):

    TIS (token-level truncated IS):  w_t = min(exp(d_t), C)           multiplies the per-token loss
    MIS (sequence-level masking):    rho_i = exp(sum_t d_t)           ("sequence", verl's seq level)
                                     rho_i = exp(mean_t d_t)          ("geometric", length-normalised)
                                     keep_i = 1[lo <= rho_i <= hi]    multiplies the mask of sequence i

Both are constants in the loss (no gradient flows through mu or pi_old). Apply TIS as
`loss_BT * w_BT` before aggregation; apply MIS as `mask_BT * keep_B[:, None]` *before* counting the
batch's global tokens and sequences, so the dropped samples leave the denominators too (as verl's
rejection sampling does). Metrics (means over this batch, or over the global counts if given) estimate
KL(mu || pi_old) from the engine's samples: k1 = mean(-d), k3 = mean(exp(d) - 1 - d).
"""

from __future__ import annotations

import torch

from hpcrl.algorithms.aggregation import aggregate

MIS_LEVELS = ("sequence", "geometric")
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
    if level not in MIS_LEVELS:
        raise ValueError(f"level={level!r}; valid: {', '.join(MIS_LEVELS)}")
    mask = mask_BT.to(old_logp_BT.dtype)
    d_sum_B = ((old_logp_BT - behaviour_logp_BT).detach() * mask).sum(dim=1)
    return d_sum_B if level == "sequence" else d_sum_B / mask.sum(dim=1).clamp(min=1.0)


def mis_mask(old_logp_BT: torch.Tensor, behaviour_logp_BT: torch.Tensor, mask_BT: torch.Tensor,
             lo: float = 0.5, hi: float = 2.0, level: str = "sequence", num_seqs: float | None = None,
             ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """1.0 for the sequences whose IS ratio lies in [lo, hi], 0.0 for the others, shape [B]; and the
    metrics `mis_masked_frac` (share of sequences dropped) and `mis_log_ratio_mean`."""
    if not 0.0 < lo <= 1.0 <= hi:
        raise ValueError(f"MIS needs 0 < lo <= 1 <= hi, got lo={lo}, hi={hi}")
    log_rho_B = sequence_is_log_ratio(old_logp_BT, behaviour_logp_BT, mask_BT, level)
    keep_B = ((log_rho_B >= torch.log(torch.tensor(lo, dtype=log_rho_B.dtype)))
              & (log_rho_B <= torch.log(torch.tensor(hi, dtype=log_rho_B.dtype)))).to(log_rho_B.dtype)
    seqs = num_seqs if num_seqs is not None else max(keep_B.shape[0], 1)
    metrics = {"mis_masked_frac": (1.0 - keep_B).sum() / seqs, "mis_log_ratio_mean": log_rho_B.sum() / seqs}
    return keep_B, metrics


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
