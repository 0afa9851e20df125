"""Asynchronous RL (rollout.max_staleness, docs/async.md) end to end on the copy example: it learns
with stale batches, the sync check passes every step (the engines score the trained batch again at
the trainer's version), and SIGUSR1, kill -9 of everything, or an engine killed mid-run, then a
resume, end with the uninterrupted run's final policy bit for bit."""

import json
import os
import signal

import numpy as np
import pytest
from e2e_util import EXAMPLE, hpcrl, kill_everything, leftover_processes, start_run, wait_for_step

from launch.result import REQUEUE_EXIT_CODE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

QUIET = ["--set", "logging.progress=false"]
# Two engines: the kill -9 and engine-death runs below kill one of them; the schedule does not
# depend on how the prompts are split, but the engines' batch shapes (and so their log-prob bits) do.
SHORT = [*QUIET, "--set", "rollout.max_staleness=1", "--set", "rollout.num_engines=2",
         "--set", "algorithm.num_steps=10", "--set", "checkpoint.interval_steps=3"]
# Partial rollouts: a block waits two steps, its first 2 of up to 4 tokens sampled by version s - 2,
# the rest by s - 1 (docs/async.md); the checkpoints hold completions cut between the two.
PARTIAL = ["--set", "rollout.max_staleness=2", "--set", "rollout.partial=true"]
SHORT_PARTIAL = [*SHORT, *PARTIAL]


def _records(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _final(run_dir) -> str:
    return json.loads((run_dir / "final.json").read_text())["policy_sha256"]


def _run(run_dir, *args, timeout_s=400):
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *args, timeout_s=timeout_s)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def learned(tmp_path_factory):
    """The example's 80 steps with max_staleness 1."""
    run_dir = tmp_path_factory.mktemp("async") / "k1"
    _run(run_dir, *QUIET, "--set", "rollout.max_staleness=1", "--set", "checkpoint.interval_steps=50")
    return run_dir


@pytest.fixture(scope="module")
def learned_partial(tmp_path_factory):
    """The example's 80 steps with max_staleness 2 and partial rollouts."""
    run_dir = tmp_path_factory.mktemp("async") / "partial"
    _run(run_dir, *QUIET, *PARTIAL, "--set", "checkpoint.interval_steps=50")
    return run_dir


def _short(tmp_path_factory, name: str, args: list[str]) -> tuple[list[dict], str]:
    run_dir = tmp_path_factory.mktemp("async") / name
    _run(run_dir, *args)
    return _records(run_dir), _final(run_dir)


@pytest.fixture(scope="module")
def short(tmp_path_factory):
    return _short(tmp_path_factory, "short", SHORT)


@pytest.fixture(scope="module")
def short_partial(tmp_path_factory):
    return _short(tmp_path_factory, "short_partial", SHORT_PARTIAL)


def _check_schedule(records: list[dict], k: int) -> None:
    staleness = [r["rollout/staleness_mean"] for r in records]
    assert staleness == [min(s, k) for s in range(len(records))]  # batch s by version max(0, s - k)
    assert all(r["rollout/staleness_max"] == min(r["step"], k) and r["rollout/dropped_stale"] == 0 for r in records)
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records)  # the engines' scores at the trainer's version
    assert all(r["train/tis_weight_mean"] > 0 for r in records)  # decoupled PPO's behaviour weight is on
    # each step's push is collected by the next step's update, the last one's by the last step itself
    pushes = [r.get("sync/pushes", 0) for r in records]
    assert pushes == [0] + [1] * (len(records) - 2) + [2], pushes
    assert len({r["sync/bytes"] / r["sync/pushes"] for r in records[1:]}) == 1


def _check_learned(records: list[dict], k: int) -> None:
    rewards = np.array([r["reward/mean"] for r in records])
    assert len(records) == 80
    assert rewards[-5:].mean() >= 0.8, rewards.round(2).tolist()
    _check_schedule(records, k)


def test_learns_with_max_staleness_1(learned):
    _check_learned(_records(learned), 1)


def test_learns_with_partial_rollouts(learned_partial):
    records = _records(learned_partial)
    _check_learned(records, 2)
    # from step 2 on every batch was cut by a push: its completions that did not stop within their
    # first 2 tokens were finished by the next version
    assert all(r["rollout/spanning_frac"] > 0 for r in records[2:]), [r["rollout/spanning_frac"] for r in records]
    assert all(r["rollout/spanning_frac"] == 0 for r in records[:2])


def test_max_staleness_2_keeps_its_schedule(tmp_path):
    """k = 2 without partial rollouts adds no overlap over k = 1 (a push waits for the batch in
    flight) and learns less reliably on this example (last-5 0.55-0.99 at six data seeds): the
    schedule and the check are what is tested here, on a short run."""
    _run(tmp_path / "k2", *QUIET, "--set", "rollout.max_staleness=2", "--set", "algorithm.num_steps=6")
    _check_schedule(_records(tmp_path / "k2"), 2)


@pytest.mark.parametrize("name,settings", [("k1", ["--set", "rollout.max_staleness=1"]), ("partial", PARTIAL)])
def test_sigusr1_then_resume_is_bit_identical(tmp_path, request, name, settings):
    """Preempted at step 40 (a checkpoint holding the batches sampled ahead; with partial rollouts
    some cut), resumed: the same rewards every step and the same final policy as the uninterrupted run."""
    learned = request.getfixturevalue({"k1": "learned", "partial": "learned_partial"}[name])
    run_dir = tmp_path / "run"
    args = [*QUIET, *settings, "--set", "checkpoint.interval_steps=50"]
    proc = start_run(run_dir, *args)
    wait_for_step(proc, run_dir, 40)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    resumed = _run(run_dir, *args)
    assert "resumed from checkpoint step" in resumed.stdout
    whole = _records(learned)
    assert [r["reward/mean"] for r in _records(run_dir)] == [r["reward/mean"] for r in whole]
    assert _final(run_dir) == _final(learned)


@pytest.mark.parametrize("name", ["short", "short_partial"])
def test_kill_9_then_resume_is_bit_identical(tmp_path, request, name):
    args, whole = {"short": SHORT, "short_partial": SHORT_PARTIAL}[name], request.getfixturevalue(name)
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *args)
    wait_for_step(proc, run_dir, 8)  # checkpoints after steps 2 and 5 (and 8 maybe): then everything dies
    kill_everything(proc, run_dir)
    assert not leftover_processes(str(run_dir))
    resumed = _run(run_dir, *args)
    assert "resumed from checkpoint step" in resumed.stdout
    assert [r["reward/mean"] for r in _records(run_dir)] == [r["reward/mean"] for r in whole[0]]
    assert _final(run_dir) == whole[1]


def test_engine_killed_while_generating_ahead_is_named_then_resume_is_bit_identical(tmp_path, short):
    """kill -9 of engine 1 while it samples the next batch: the run stops naming it (no hang), and a
    rerun resumes from the last checkpoint to the uninterrupted run's final policy."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *SHORT)
    wait_for_step(proc, run_dir, 4)  # a checkpoint after step 2 exists
    record = json.loads((run_dir / "logs" / "engine1.json").read_text())
    os.kill(record["pid"], signal.SIGKILL)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0, out[-3000:]
    headline = next((line for line in out.splitlines() if line.startswith("hpcrl run failed")), "")
    assert "engine" in headline and "rank 3" in headline and "Traceback" not in out, out[-3000:]
    assert not leftover_processes(str(run_dir))
    resumed = _run(run_dir, *SHORT)
    assert "resumed from checkpoint step" in resumed.stdout
    assert _final(run_dir) == short[1]


@pytest.mark.parametrize("name,k,settings", [
    ("dapo", 1, []),
    ("dapo", 2, PARTIAL),
    ("ppo", 1, ["--set", "algorithm.ppo_epochs=2", "--set", "algorithm.mini_batch_size=64"])])
def test_dapo_and_ppo_run_asynchronously(tmp_path, name, k, settings):
    """The other dataflows over the same API: PPO's critic and policy train on the stale batch; DAPO's
    refills take more batches in a step than the k + 1 sampled ahead, so its later rounds are
    sampled synchronously by the current version (docs/async.md): never older than k. With partial
    rollouts a refill may take a batch a push has cut: the current version finishes it."""
    _run(tmp_path / name, *QUIET, "--set", f"algorithm.name={name}", "--set", "algorithm.num_steps=6",
         "--set", f"rollout.max_staleness={k}", *settings)
    records = _records(tmp_path / name)
    assert len(records) == 6
    assert all(r["rollout/staleness_max"] <= k for r in records)
    if name == "ppo":
        assert [r["rollout/staleness_mean"] for r in records] == [0, 1, 1, 1, 1, 1]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records)
