"""The reward pool: results identical to in-process scoring, in order; rewards that raise, hang (in
Python or blocked in C), crash their worker or return garbage score 0, are counted, and never hold
`score` past its deadline."""

import math
import os
import select
import signal
import time

import numpy as np
import pytest

from hpcrl.rewards import load_reward_fn
from hpcrl.rewards.pool import (INLINE_REWARDS, InlineRewards, RewardPool, RewardPoolError, reward_scorer,
                                score_in_process)

TIMEOUT_S = 1.0


def misbehaving(prompt, completion, answer, extra=None):
    """A reward that does what the completion says; otherwise token_match plus extra's bonus."""
    if completion == "raise":
        raise ValueError("bad completion")
    if completion == "loop":
        while True:
            pass
    if completion == "pause":  # blocked in C
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT, signal.SIGALRM])
        signal.pause()
    if completion == "select":
        select.select([], [], [])
    if completion == "exit":
        os._exit(3)
    if completion == "nan":
        return math.nan
    if completion == "none":
        return None
    if completion == "huge":  # finite in float64, inf as the float32 rewards travel in
        return 1e300
    if completion in ("text", "bool"):  # float() would take "0.5" and True
        return "0.5" if completion == "text" else True
    return load_reward_fn("token_match")(prompt, completion, answer) + (extra or {}).get("bonus", 0.0)


def three_args(prompt, completion, answer):
    return float(len(completion)) / 10


@pytest.fixture(scope="module")
def pool():
    with RewardPool(f"{__name__}:misbehaving", num_workers=2, timeout_s=TIMEOUT_S) as p:
        yield p


def _items(completions, extra=None):
    return [(c[:1], c, c[:1] * 4, dict(extra or {})) for c in completions]


def _good(n):
    return _items(["abcdefgh"[i % 8] * (1 + i % 5) for i in range(n)], {"bonus": 0.5})


@pytest.mark.timeout(60)
def test_results_match_in_process_scoring_in_order(pool):
    for n in (0, 1, 7, 128, 301):
        items = _good(n)
        scores = pool.score(items)
        assert scores.rewards.dtype == np.float32 and scores.num_errors == 0
        assert np.array_equal(scores.rewards, score_in_process(misbehaving, items)), n
    with RewardPool(f"{__name__}:three_args", num_workers=3, timeout_s=TIMEOUT_S) as p3:
        items = _good(50)
        reference = score_in_process(load_reward_fn(f"{__name__}:three_args"), items)
        assert np.array_equal(p3.score(items).rewards, reference)


@pytest.mark.timeout(60)
def test_raising_and_garbage_rewards_score_zero_and_are_counted(pool):
    items = _good(20)
    bad = {3: "raise", 11: "nan", 12: "none", 14: "huge", 15: "text", 16: "bool"}
    for i, what in bad.items():
        items[i] = _items([what])[0]
    scores = pool.score(items)
    assert sorted(scores.errors) == sorted(bad) and scores.num_errors == len(bad)
    assert scores.errors[3] == "ValueError: bad completion"
    assert "returned nan" in scores.errors[11] and "TypeError" in scores.errors[12]
    assert "returned 1e+300, not finite as a float32" in scores.errors[14]
    assert "returned '0.5' (str), not a number" in scores.errors[15] and "returned True (bool)" in scores.errors[16]
    good = [i for i in range(20) if i not in scores.errors]
    assert np.array_equal(scores.rewards[good], score_in_process(misbehaving, [items[i] for i in good]))
    assert (scores.rewards[sorted(bad)] == 0).all() and np.isfinite(scores.rewards).all()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("hang", ["loop", "pause", "select", "exit"])
def test_hung_or_crashing_reward_is_killed_within_the_deadline(pool, hang):
    items = _good(40)
    for i in (5, 30):
        items[i] = _items([hang])[0]
    t0 = time.monotonic()
    scores = pool.score(items)
    elapsed = time.monotonic() - t0
    # Two bad items, two workers: each costs at most a deadline plus a worker restart (~0.2 s here).
    assert elapsed < 2 * TIMEOUT_S + 10, elapsed
    assert sorted(scores.errors) == [5, 30], scores.errors
    why = "exited (code 3)" if hang == "exit" else f"timed out after {TIMEOUT_S:g} s"
    assert all(why in msg for msg in scores.errors.values()), scores.errors
    good = [i for i in range(40) if i not in (5, 30)]
    assert np.array_equal(scores.rewards[good], score_in_process(misbehaving, [items[i] for i in good]))
    # the pool recovered: the next call is clean and fast
    t0 = time.monotonic()
    assert pool.score(_good(64)).num_errors == 0 and time.monotonic() - t0 < 5


@pytest.mark.timeout(90)
def test_every_item_hanging_still_returns_within_the_bound():
    n, workers, timeout_s = 6, 2, 0.5
    with RewardPool(f"{__name__}:misbehaving", num_workers=workers, timeout_s=timeout_s) as p:
        p.score(_good(2))  # workers up
        t0 = time.monotonic()
        scores = p.score(_items(["loop"] * n))
        elapsed = time.monotonic() - t0
    assert scores.num_errors == n and not scores.rewards.any()
    # ceil(n / workers) + 1 deadlines back to back, plus a worker start per hang (generous on 2 busy cores)
    assert elapsed < (math.ceil(n / workers) + 1) * timeout_s + n * 3.0, elapsed


@pytest.mark.timeout(60)
def test_reward_that_cannot_load_in_a_worker_is_a_clear_error():
    with pytest.raises(RewardPoolError, match="failed to load in a reward worker"):
        with RewardPool("no_such_module_xyz:f", num_workers=1, timeout_s=1.0) as p:
            p.score(_good(3))


@pytest.mark.timeout(60)
def test_close_stops_every_worker():
    p = RewardPool("token_match", num_workers=2, timeout_s=1.0)
    procs = [s.proc for s in p._slots]
    p.score(_good(4))
    p.close()
    p.close()
    assert all(not proc.is_alive() for proc in procs)


WARMED = []


def warmed(prompt, completion, answer, extra=None):
    return float(len(WARMED))


warmed.warm_up = lambda: WARMED.append(1)


@pytest.mark.timeout(60)
def test_warm_up_runs_once_per_worker_before_scoring():
    with RewardPool(f"{__name__}:warmed", num_workers=2, timeout_s=TIMEOUT_S) as p:
        assert (p.score(_good(8)).rewards == 1.0).all()
    with RewardPool("math", num_workers=1, timeout_s=0.5) as p:  # math-verify imported before the deadline
        assert p.score([("p", "#### 0.5", "\\frac{1}{2}", {})]).rewards.tolist() == [1.0]


def worker_pid(prompt, completion, answer, extra=None):
    return float(os.getpid())


def slow_worker_pid(prompt, completion, answer, extra=None):
    time.sleep(0.01)
    return float(os.getpid())


def _all_ready(pool: RewardPool) -> None:
    for _ in range(600):  # a worker's "ready" is read by the next call
        if all(s.ready for s in pool._slots):
            return
        pool.score(_good(1))
        time.sleep(0.05)
    raise AssertionError("reward workers did not start")


@pytest.mark.timeout(90)
def test_cheap_calls_go_to_one_worker_and_costly_ones_to_all():
    """A call that the workers' measured cost puts under SPREAD_MIN_S is one chunk for one worker
    (one wake-up); one above it is spread over every worker. The reward returns its worker's pid."""
    with RewardPool(f"{__name__}:worker_pid", num_workers=2, timeout_s=TIMEOUT_S) as p:
        _all_ready(p)
        for _ in range(3):
            assert len(set(p.score(_good(8)).rewards.tolist())) == 1
    with RewardPool(f"{__name__}:slow_worker_pid", num_workers=2, timeout_s=TIMEOUT_S) as p:
        _all_ready(p)  # 10 ms per item: 8 items are 80 ms of scoring
        for _ in range(3):
            assert len(set(p.score(_good(8)).rewards.tolist())) == 2


@pytest.mark.timeout(90)
def test_a_hang_in_a_single_chunk_call():
    """A cheap reward's call is one chunk; a hang there kills the worker and scores the item 0, and
    the rest of the chunk, spread again, scores as in process (the bound test covers the time)."""
    with RewardPool(f"{__name__}:misbehaving", num_workers=2, timeout_s=0.5) as p:
        _all_ready(p)
        assert p._chunks(6) == 1
        items = _good(6)
        items[2] = _items(["loop"])[0]
        scores = p.score(items)
        assert sorted(scores.errors) == [2]
        good = [0, 1, 3, 4, 5]
        assert np.array_equal(scores.rewards[good], score_in_process(misbehaving, [items[i] for i in good]))


@pytest.mark.timeout(60)
def test_inline_builtins_score_as_the_pool_does_without_workers():
    import multiprocessing

    items = [*_good(8), ("p", "abc", None, {}), ("p", "x", 7, {})]  # answers a dataset should not hold
    for spec in sorted(INLINE_REWARDS):
        before = len(multiprocessing.active_children())
        inline = reward_scorer(spec, num_workers=2, timeout_s=TIMEOUT_S)
        assert isinstance(inline, InlineRewards) and len(multiprocessing.active_children()) == before
        got = inline.score(items)
        with RewardPool(spec, num_workers=1, timeout_s=TIMEOUT_S) as pool:
            want = pool.score(items)
        assert got.rewards.dtype == np.float32 and np.array_equal(got.rewards, want.rewards)
        assert np.array_equal(got.rewards[:8], score_in_process(load_reward_fn(spec), items[:8]))
        assert got.errors == want.errors and sorted(got.errors) == [8, 9], got.errors
        assert got.errors[8].startswith("TypeError") or got.errors[8].startswith("AttributeError")
    with reward_scorer("math", 1, TIMEOUT_S) as math_pool:  # math-verify can hang: workers
        assert isinstance(math_pool, RewardPool)


def _scores(n_ok: int, n_failed: int):
    from hpcrl.rewards.pool import Scores

    return Scores(np.zeros(n_ok + n_failed, dtype=np.float32),
                  {n_ok + i: f"KeyError: 'ground_truth' ({i})" for i in range(n_failed)})


def test_failed_steps_stop_after_max_failed_steps_in_a_row():
    """reward.max_failed_steps: the policy learns nothing from steps whose every completion failed;
    the run stopped only at num_steps, having learnt nothing in all of them."""
    from hpcrl.rewards.pool import FailedSteps, RewardFailing

    steps = FailedSteps("my_reward:score", 3)
    steps.add(0, _scores(0, 4))
    steps.add(1, _scores(1, 3))  # one success ends the row
    steps.add(2, _scores(0, 4))
    steps.add(2, _scores(0, 4))  # a second scoring of a step (dapo's rounds) counts once
    steps.add(3, _scores(0, 4))
    with pytest.raises(RewardFailing, match=r"reward.fn='my_reward:score' failed on every completion of 3 steps "
                                            r"in a row \(steps 2 to 4\) \(all scored 0: the policy learns nothing "
                                            r"from them\); step 4's first "
                                            r"error, completion 0: KeyError: 'ground_truth' \(0\)\. Fix the "
                                            r"reward \(or set reward.max_failed_steps: 0 to go on\)"):
        steps.add(4, _scores(0, 4))
    never = FailedSteps("my_reward:score", 0)
    for step in range(10):
        never.add(step, _scores(0, 4))
    FailedSteps("x", 1).add(0, _scores(0, 0))  # nothing scored is no failure
    with pytest.raises(RewardFailing, match=r"failed on every completion of step 0 \(all scored 0"):
        FailedSteps("x", 1).add(0, _scores(0, 1))
    rounds = FailedSteps("x", 1)  # dapo: a step fails when every round did
    rounds.add(0, _scores(1, 3))
    rounds.add(0, _scores(0, 4))
    with pytest.raises(RewardFailing, match="of step 1 "):
        rounds.add(1, _scores(0, 4))
