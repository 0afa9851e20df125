"""Reducing per-token values to a scalar loss, and masked batch statistics.

Shape legend: B sequences (rows of a micro-batch), T response positions. `mask_BT` is 1 on the tokens
that count (generated tokens) and 0 on padding.

Loss aggregation (l = per-token loss, m = mask, n_i = sum_t m_it tokens of sequence i):

    token-mean               sum_{i,t} m_it l_it / N_tok               (DAPO's token-level loss)
    seq-mean-token-mean      sum_i (sum_t m_it l_it / n_i) / N_seq     (GRPO as written in the paper)
    seq-mean-token-sum       sum_{i,t} m_it l_it / N_seq
    seq-mean-token-sum-norm  sum_{i,t} m_it l_it / (N_seq * C)         (Dr. GRPO; C a constant)

N_tok and N_seq are the *global* counts of the optimizer step's batch (all micro-batches on all
data-parallel ranks). Pass them in and each micro-batch's value is its share, so the micro-batch losses
add up to the loss of the whole batch under gradient accumulation and data-parallel gradient averaging
(scaled by the number of ranks, which the trainer undoes). Without them the local counts are used.

Dr. GRPO's constant C (`loss_agg_norm`) is e.g. the maximum response length; it must not depend on the
micro-batch (not its padded T), or the sum over micro-batches stops being the batch's loss. This
matches TRL's `loss_type="dr_grpo"` (sum / (B * max_completion_length)); verl's mode of the same name
divides by T only (no 1/N_seq), a constant factor apart.
"""

from __future__ import annotations

import torch

from hpcrl.algorithms import LOSS_AGGS


def aggregate(values_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str,
              num_tokens: float | None = None, num_seqs: float | None = None,
              loss_agg_norm: float | None = None) -> torch.Tensor:
    """Reduce per-token values to a scalar. `num_tokens`/`num_seqs` are the *global* batch counts, so
    micro-batch losses add up to the full-batch loss under gradient accumulation. `loss_agg_norm` is
    the constant divisor of `seq-mean-token-sum-norm` (required there, unused otherwise)."""
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
    if mode == "seq-mean-token-sum-norm":
        if loss_agg_norm is None or loss_agg_norm <= 0:
            raise ValueError(f"loss_agg='seq-mean-token-sum-norm' needs loss_agg_norm > 0 (a constant such "
                             f"as the maximum response length), got {loss_agg_norm!r}")
        return (values_BT * mask).sum() / (seqs * loss_agg_norm)
    raise ValueError(f"loss_agg={mode!r}; valid: {', '.join(LOSS_AGGS)}")


def masked_mean(values_BT: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean of `values_BT` over the positions where `mask_BT` is 1 (0 when the mask is empty)."""
    mask = mask_BT.to(values_BT.dtype)
    return (values_BT * mask).sum() / mask.sum().clamp(min=1.0)


def masked_var(values_BT: torch.Tensor, mask_BT: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance over the masked positions; `unbiased` applies Bessel's n / (n - 1) like verl."""
    mask = mask_BT.to(values_BT.dtype)
    n = mask.sum()
    var = ((values_BT - masked_mean(values_BT, mask)).square() * mask).sum() / n.clamp(min=1.0)
    if unbiased:
        var = var * n / (n - 1.0).clamp(min=1.0)
    return var


def whiten(values_BT: torch.Tensor, mask_BT: torch.Tensor, shift_mean: bool = True,
           eps: float = 1e-8) -> torch.Tensor:
    """Batch whitening over the valid tokens: (x - mean) / sqrt(var + eps), zero on padding.

    Mean and (unbiased) variance are taken over every masked token of the batch, as verl's
    `masked_whiten` does for GAE and REINFORCE++. `shift_mean=False` only rescales (the mean is added
    back). OpenRLHF uses the biased variance; the two differ by n / (n - 1), negligible for real batches.
    Call it on the whole batch (the controller's view), not per micro-batch.
    """
    # masked_mean and masked_var's arithmetic, in the same order (bit-identical), with each shared
    # term computed once: this runs on the controller between phases, where every tensor op costs
    # tens of microseconds on cold caches.
    mask = mask_BT.to(values_BT.dtype)
    n = mask.sum()
    n_or_1 = n.clamp(min=1.0)
    mean = (values_BT * mask).sum() / n_or_1
    centred_BT = values_BT - mean
    var = (centred_BT.square() * mask).sum() / n_or_1 * n / (n - 1.0).clamp(min=1.0)  # unbiased
    whitened = centred_BT * torch.rsqrt(var + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask
