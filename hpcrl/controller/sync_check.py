"""The per-step weight-sync check: engine log-probs vs trainer log-probs of the same tokens.

After every sync the engine must compute what the trainer computes. The engine returns the
log-prob of each token it sampled; the trainer's training forward computes them again (the "old"
log-probs: the forward runs before the update). Their max absolute difference over all response tokens is logged as
`sync/logprob_max_abs_diff`; above `rollout.logprob_tolerance` the run stops.
"""

from __future__ import annotations

import numpy as np


class WeightSyncError(RuntimeError):
    """The engine's weights do not match the trainer's after a sync."""


def logprob_max_abs_diff(rollout, trainer_logp_BT: np.ndarray, tolerance: float, step: int) -> float:
    worst = 0.0
    where = (0, 0)
    for b, engine_lp in enumerate(rollout.engine_logprobs):
        if not engine_lp:
            continue
        diff = np.abs(np.asarray(engine_lp, dtype=np.float64) - trainer_logp_BT[b, : len(engine_lp)])
        i = int(diff.argmax())
        if diff[i] > worst:
            worst, where = float(diff[i]), (b, i)
    if not worst <= tolerance:
        b, i = where
        raise WeightSyncError(
            f"step {step}: engine and trainer log-probs differ by {worst:.3g} (sequence {b}, response "
            f"token {i}) > rollout.logprob_tolerance={tolerance:g}. The engine is not running the "
            "trainer's weights: check the Megatron->HF name mapping and the weight sync, or raise "
            "the tolerance for bf16 runs.")
    return worst
