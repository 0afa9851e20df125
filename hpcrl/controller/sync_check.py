"""The per-step weight-sync check: engine log-probs vs trainer log-probs of the same tokens.

After every sync the engine must compute what the trainer computes. The engine returns the
log-prob of each token it sampled; the trainer's training forward computes them again (the "old"
log-probs: the forward runs before the update). Their max absolute difference over all response
tokens is logged as `sync/logprob_max_abs_diff`; above `rollout.logprob_tolerance` the run stops,
with a message that tells a sync defect (every token moves: large median difference) from a few
tokens off (a router near-tie rounded differently by the two computations).
"""

from __future__ import annotations

import numpy as np


class WeightSyncError(RuntimeError):
    """The engine's weights do not match the trainer's after a sync."""


def logprob_max_abs_diff(rollout, trainer_logp_BT: np.ndarray, tolerance: float, step: int) -> float:
    """The max |engine - trainer| log-prob over all response tokens; WeightSyncError above
    `tolerance` (a NaN or infinite log-prob on either side counts as infinitely far)."""
    diffs: list[np.ndarray] = []
    rows: list[int] = []
    for b, engine_lp in enumerate(rollout.engine_logprobs):
        if not engine_lp:
            continue
        d = np.abs(np.asarray(engine_lp, dtype=np.float64) - trainer_logp_BT[b, : len(engine_lp)])
        d[~np.isfinite(d)] = np.inf
        diffs.append(d)
        rows.append(b)
    if not diffs:
        return 0.0
    worst_of = [float(d.max()) for d in diffs]
    k = int(np.argmax(worst_of))
    worst = worst_of[k]
    if worst <= tolerance:
        return worst
    every = np.concatenate(diffs)
    over, median = int((every > tolerance).sum()), float(np.median(every))
    seqs = sum(1 for w in worst_of if w > tolerance)
    if median <= tolerance / 10:
        why = ("Most tokens agree, and a weight-sync defect would move them all: this is most likely "
               "a top-k router near-tie that trainer and engine round to different experts (the "
               "flip also shifts the later tokens of that sequence, and of the group when it falls in "
               "the shared prompt). If it recurs, raise rollout.logprob_tolerance.")
    else:
        why = ("The engine is not running the trainer's weights: check the Megatron->HF name mapping "
               "and the weight sync, or raise the tolerance for bf16 runs.")
    raise WeightSyncError(
        f"step {step}: engine and trainer log-probs differ by {worst:.3g} (sequence {rows[k]}, response "
        f"token {int(diffs[k].argmax())}) > rollout.logprob_tolerance={tolerance:g}; {over} of "
        f"{every.size} response tokens in {seqs} of {len(diffs)} sequences exceed it, median "
        f"difference {median:.2g}. {why}")
