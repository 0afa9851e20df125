"""The per-step sync check: the max difference is returned, and a failure says which token and
whether it looks like a weight-sync defect (every token off) or a router near-tie (a few off)."""

from types import SimpleNamespace

import numpy as np
import pytest

from hpcrl.controller.sync_check import WeightSyncError, logprob_max_abs_diff

rng = np.random.default_rng(0)
TRAINER = -rng.random((8, 6)) * 3  # 8 sequences, up to 6 response tokens


def rollout(engine):
    return SimpleNamespace(engine_logprobs=[row.tolist() for row in engine])


def test_returns_the_max_over_response_tokens_only():
    engine = TRAINER + rng.normal(0, 1e-7, TRAINER.shape)
    lengths = [6, 3, 0, 6, 1, 6, 2, 6]
    rows = [engine[b, :n] for b, n in enumerate(lengths)]
    trainer = TRAINER.copy()
    for b, n in enumerate(lengths):
        trainer[b, n:] = 99.0  # padding past a response: never compared
    want = max(float(np.abs(r - TRAINER[b, : len(r)]).max()) for b, r in enumerate(rows) if len(r))
    got = logprob_max_abs_diff(SimpleNamespace(engine_logprobs=[r.tolist() for r in rows]), trainer, 1e-4, 0)
    # The check's arithmetic is this test's (float64 subtraction, abs, max of the same numbers): equal.
    # 1e-6 is 10 standard deviations of the 1e-7 noise added, not a rounding bound.
    assert got == want and 0 < got < 1e-6


def test_a_few_tokens_off_are_named_as_a_router_near_tie():
    engine = TRAINER + rng.normal(0, 1e-7, TRAINER.shape)
    engine[5, 3:] += 0.03  # a flip at token 3 of sequence 5 shifts its later tokens
    with pytest.raises(WeightSyncError) as info:
        logprob_max_abs_diff(rollout(engine), TRAINER, 1e-4, 7)
    msg = str(info.value)
    assert "step 7" in msg and "(sequence 5, response token" in msg
    assert "3 of 48 response tokens in 1 of 8" in msg
    assert "router near-tie" in msg and "not running the trainer's weights" not in msg


def test_every_token_off_is_named_as_a_sync_defect():
    engine = TRAINER + rng.normal(0, 0.05, TRAINER.shape)
    with pytest.raises(WeightSyncError, match="not running the trainer's weights") as info:
        logprob_max_abs_diff(rollout(engine), TRAINER, 1e-4, 2)
    assert "router near-tie" not in str(info.value)


def test_nan_log_probs_fail_the_check():
    engine = TRAINER.copy()
    engine[2, 1] = np.nan
    with pytest.raises(WeightSyncError, match=r"differ by inf \(sequence 2, response token 1\)"):
        logprob_max_abs_diff(rollout(engine), TRAINER, 1e-4, 0)


def test_the_mean_check_lets_bf16_rounding_through_and_stops_a_shift_of_every_token():
    from hpcrl.controller.sync_check import logprob_sync_check

    rounded = TRAINER.copy()
    rounded[3, 2] += 0.5  # one token off by bf16 rounding at a near-tie: mean 0.5 / 48 ~ 0.01
    worst, mean = logprob_sync_check(rollout(rounded), TRAINER, 1.0, 0.02, 4)
    # float64 as the check computes it: (x + 0.5) - x, the only non-zero difference, over 48 tokens
    assert worst == abs(rounded[3, 2] - TRAINER[3, 2]) and mean == worst / TRAINER.size
    with pytest.raises(WeightSyncError, match=r"step 4: .* differ by 0.05 on average over 48 response tokens "
                                              r"\(max 0.05\) > rollout.logprob_mean_tolerance=0.02: most "
                                              r"tokens moved \(median 0.05\), so the engine is not running"):
        logprob_sync_check(rollout(TRAINER + 0.05), TRAINER, 1.0, 0.02, 4)


def test_a_mean_carried_by_a_flipped_group_is_named_as_routing_not_as_a_sync_defect():
    """A flip in a prompt shared by a group moves all its completions' tokens: the mean can exceed
    rollout.logprob_mean_tolerance while most tokens agree. The message says so, and what the step's
    router agreement makes of it: a flip (< 1), no flip (1: a weight only some tokens use), unknown."""
    from hpcrl.controller.sync_check import sync_check_metrics

    flipped = TRAINER.copy()
    flipped[2:4] += 0.3  # two completions of one group, 12 of 48 tokens: mean 0.075, median 0
    for agreement, says in [(0.9961, ("The trainer routed 0.9961 of this step's (token, MoE layer) pairs as "
                                       "the engine did: this is most likely a top-k router near-tie")),
                            (1.0, ("Every route of this step agreed (mismatch/router_agreement 1), so no "
                                   "routing flip explains it")),
                            (None, "rollout.routing_replay observe logs how often the routes agree")]:
        with pytest.raises(WeightSyncError) as info:
            sync_check_metrics(rollout(flipped), TRAINER, 1.0, 0.02, 9, agreement)
        msg = str(info.value)
        assert ("step 9: engine and trainer log-probs differ by 0.075 on average over 48 response tokens "
                "(max 0.3) > rollout.logprob_mean_tolerance=0.02, but most tokens agree (median 0): 12 of 48 "
                "response tokens in 2 of 8 sequences carry the mean.") in msg, msg
        assert says in msg and "not running the trainer's weights" not in msg, msg
        assert "rollout.logprob_mean_tolerance for bf16" in msg if agreement == 1.0 else "r3" in msg


def test_mismatch_metrics_are_k3_and_the_share_over_tolerance_of_response_tokens():
    """mismatch/kl is the token mean of exp(d) - 1 - d, d = trainer - engine, over response tokens only
    (padding past a response never enters); the share counts |d| > tolerance. Same float64 arithmetic
    as the test's on the same numbers: compared to a few ulps of the sum of 13 terms."""
    from hpcrl.controller.sync_check import mismatch_metrics, sync_check_metrics

    lengths = [6, 3, 0, 4]
    trainer = TRAINER[:4].copy()
    d = np.zeros_like(trainer)
    d[0, :6] = [0.0, 0.1, -0.2, 0.0, 0.3, 0.0]
    d[1, :3] = [0.05, 0.0, -0.05]
    d[3, :4] = [0.0, 0.0, 0.0, 0.5]
    engine_rows = [(trainer[b] - d[b])[:n] for b, n in enumerate(lengths)]
    for b, n in enumerate(lengths):
        trainer[b, n:] = 99.0
    got = mismatch_metrics(rollout(engine_rows), trainer, 0.15)
    d_N = np.concatenate([d[b, :n] for b, n in enumerate(lengths)])
    want = float(np.mean(np.expm1(d_N) - d_N))
    assert abs(got["mismatch/kl"] - want) <= 13 * 2.0 ** -52 * want and want > 0.01
    assert got["mismatch/over_tolerance_frac"] == 3 / 13  # 0.2, 0.3 and 0.5; not 0.1 or 0.05
    # the check and the metrics from one pass over the response tokens: the same numbers
    diff_N = np.concatenate([np.abs(r - trainer[b, : len(r)]) for b, r in enumerate(engine_rows)])
    assert sync_check_metrics(rollout(engine_rows), trainer, 1.0, 0.0, 3) == {
        **mismatch_metrics(rollout(engine_rows), trainer, 1.0),
        "sync/logprob_max_abs_diff": float(diff_N.max()), "sync/logprob_mean_abs_diff": float(diff_N.mean())}
    same = mismatch_metrics(rollout([trainer[b, :n] for b, n in enumerate(lengths)]), trainer, 0.15)
    assert same == {"mismatch/kl": 0.0, "mismatch/over_tolerance_frac": 0.0}
