"""The per-step weight-sync check: engine log-probs vs trainer log-probs of the same tokens.

After every sync the engine must compute what the trainer computes. The engine returns the
log-prob of each token it sampled; the trainer's training forward computes them again (the "old"
log-probs: the forward runs before the update). Their max absolute difference over all response
tokens is logged as `sync/logprob_max_abs_diff`; above `rollout.logprob_tolerance` the run stops,
with a message that tells a sync defect (every token moves: large median difference) from a few
tokens off (a router near-tie rounded differently by the two computations). Their mean is
`sync/logprob_mean_abs_diff`; above `rollout.logprob_mean_tolerance` (bf16 engines) the run stops too,
and the message tells the same two cases apart by the median: a routing flip in a prompt shared by a
group moves every later token of the group, which can carry the mean alone. The step's
mismatch/router_agreement, where measured, says whether routes flipped.

`mismatch_metrics` measures the same pairs every step as the rollout-train mismatch, whatever
algorithm.rollout_correction says: `mismatch/kl`, the token mean of k3 = exp(d) - 1 - d with
d = log pi_trainer - log mu_engine (an estimate of KL(mu || pi) from the engine's samples, 0 when they
agree), and `mismatch/over_tolerance_frac`, the share of response tokens whose |d| exceeds
rollout.logprob_tolerance.
"""

from __future__ import annotations

import itertools

import numpy as np


class WeightSyncError(RuntimeError):
    """The engine's weights do not match the trainer's after a sync."""


def _response_tokens(rollout, trainer_logp_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(engine [N], trainer [N], response lengths [B]): every response token's log-prob in row order
    on both sides, in float64. One vectorised pass (a loop over rows cost ~1.4 ms per step of the
    tiny example's controller)."""
    engine = rollout.engine_logprobs
    lengths_B = np.fromiter(map(len, engine), dtype=np.int64, count=len(engine))
    engine_N = np.fromiter(itertools.chain.from_iterable(engine), dtype=np.float64,
                           count=int(lengths_B.sum()))
    assert lengths_B.max(initial=0) <= trainer_logp_BT.shape[1], "a response is longer than the trainer's"
    mask_BT = np.arange(trainer_logp_BT.shape[1])[None, :] < lengths_B[:, None]
    return engine_N, trainer_logp_BT[mask_BT].astype(np.float64), lengths_B


def mismatch_metrics(rollout, trainer_logp_BT: np.ndarray, tolerance: float) -> dict[str, float]:
    """`mismatch/kl` and `mismatch/over_tolerance_frac` of the engine's log-probs against the
    trainer's (module docstring); 0 for a rollout without response tokens."""
    return _mismatch(*_response_tokens(rollout, trainer_logp_BT)[:2], tolerance)


def sync_check_metrics(rollout, trainer_logp_BT: np.ndarray, tolerance: float, mean_tolerance: float,
                       step: int, router_agreement: float | None = None) -> dict[str, float]:
    """`logprob_sync_check` (WeightSyncError as there) and `mismatch_metrics` of one rollout from one
    pass over its response tokens: sync/logprob_max_abs_diff, sync/logprob_mean_abs_diff, mismatch/*.
    `router_agreement` (the step's mismatch/router_agreement, when measured) goes into the message."""
    engine_N, trainer_N, lengths_B = _response_tokens(rollout, trainer_logp_BT)
    worst, mean = _check(engine_N, trainer_N, lengths_B, tolerance, mean_tolerance, step, router_agreement)
    return {"sync/logprob_max_abs_diff": worst, "sync/logprob_mean_abs_diff": mean,
            **_mismatch(engine_N, trainer_N, tolerance)}


def _mismatch(engine_N: np.ndarray, trainer_N: np.ndarray, tolerance: float) -> dict[str, float]:
    if not engine_N.size:
        return {"mismatch/kl": 0.0, "mismatch/over_tolerance_frac": 0.0}
    d_N = trainer_N - engine_N
    with np.errstate(over="ignore", invalid="ignore"):
        k3 = float(np.mean(np.expm1(d_N) - d_N))
    return {"mismatch/kl": k3 if np.isfinite(k3) else float("inf"),
            "mismatch/over_tolerance_frac": float(np.mean(~(np.abs(d_N) <= tolerance)))}


def logprob_max_abs_diff(rollout, trainer_logp_BT: np.ndarray, tolerance: float, step: int) -> float:
    """The max |engine - trainer| log-prob over all response tokens; WeightSyncError above
    `tolerance` (a NaN or infinite log-prob on either side counts as infinitely far)."""
    return logprob_sync_check(rollout, trainer_logp_BT, tolerance, 0.0, step)[0]


def logprob_sync_check(rollout, trainer_logp_BT: np.ndarray, tolerance: float, mean_tolerance: float,
                       step: int) -> tuple[float, float]:
    """(max, mean) |engine - trainer| log-prob over all response tokens. WeightSyncError when the max
    exceeds `tolerance`, or the mean exceeds `mean_tolerance` (> 0; the check for bf16 engines,
    whose rounding moves single tokens by 1e-2-1e-1 while a wrong weight moves all of them)."""
    return _check(*_response_tokens(rollout, trainer_logp_BT), tolerance, mean_tolerance, step)


def _check(engine_N: np.ndarray, trainer_N: np.ndarray, lengths_B: np.ndarray, tolerance: float,
           mean_tolerance: float, step: int, router_agreement: float | None = None) -> tuple[float, float]:
    d_N = np.abs(engine_N - trainer_N)
    d_N[~np.isfinite(d_N)] = np.inf
    worst = float(d_N.max(initial=0.0))
    mean = float(d_N.mean()) if d_N.size else 0.0
    if mean_tolerance > 0 and mean > mean_tolerance:
        median = float(np.median(d_N))
        said = (f"step {step}: engine and trainer log-probs differ by {mean:.3g} on average over {d_N.size} "
                f"response tokens (max {worst:.3g}) > rollout.logprob_mean_tolerance={mean_tolerance:g}")
        if median > mean_tolerance:
            raise WeightSyncError(f"{said}: most tokens moved (median {median:.2g}), so the engine is not "
                                  "running the trainer's weights; check the weight sync")
        raise WeightSyncError(f"{said}, but most tokens agree (median {median:.2g}): "
                              f"{_few_tokens(d_N, lengths_B, mean_tolerance)} carry the mean. "
                              f"{_few_tokens_why(router_agreement, 'rollout.logprob_mean_tolerance')}")
    if worst <= tolerance:
        return worst, mean
    rows = [b for b, n in enumerate(lengths_B) if n]
    diffs = np.split(d_N, np.cumsum(lengths_B[rows])[:-1])
    worst_of = [float(d.max()) for d in diffs]
    k = int(np.argmax(worst_of))
    median = float(np.median(d_N))
    if median <= tolerance / 10:
        why = ("Most tokens agree, and a weight-sync defect would move them all. "
               + _few_tokens_why(router_agreement, "rollout.logprob_tolerance"))
    else:
        why = ("The engine is not running the trainer's weights: check the Megatron->HF name mapping "
               "and the weight sync, or raise the tolerance for bf16 runs.")
    raise WeightSyncError(
        f"step {step}: engine and trainer log-probs differ by {worst:.3g} (sequence {rows[k]}, response "
        f"token {int(diffs[k].argmax())}) > rollout.logprob_tolerance={tolerance:g}; "
        f"{_few_tokens(d_N, lengths_B, tolerance)} exceed it, median difference {median:.2g}. {why}")


def _few_tokens(d_N: np.ndarray, lengths_B: np.ndarray, threshold: float) -> str:
    """'K of N response tokens in S of B sequences': those further apart than `threshold`."""
    per_seq = np.split(d_N > threshold, np.cumsum(lengths_B)[:-1])
    seqs = sum(1 for far in per_seq if far.any())
    return (f"{int((d_N > threshold).sum())} of {d_N.size} response tokens in {seqs} of "
            f"{int((lengths_B > 0).sum())} sequences")


def _few_tokens_why(router_agreement: float | None, tolerance_field: str) -> str:
    """Why a few tokens are far apart while the rest agree, from what the step measured of the routes."""
    flip = ("a top-k router near-tie that trainer and engine round to different experts (the flip also "
            "shifts the later tokens of that sequence, and of the group when it falls in the shared prompt)")
    if router_agreement is None:
        return (f"This is most likely {flip}: rollout.routing_replay observe logs how often the routes "
                f"agree and r3 has the trainer take the engine's. If it recurs, raise {tolerance_field}.")
    if router_agreement < 1:
        return (f"The trainer routed {router_agreement:.4f} of this step's (token, MoE layer) pairs as the "
                f"engine did: this is most likely {flip}. rollout.routing_replay r3 has the trainer take "
                f"the engine's routes; or raise {tolerance_field}.")
    return ("Every route of this step agreed (mismatch/router_agreement 1), so no routing flip explains "
            "it: a weight only some tokens use (one expert's) may differ; check the weight sync, or raise "
            f"{tolerance_field} for bf16 runs.")
