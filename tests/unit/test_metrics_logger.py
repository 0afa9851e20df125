"""MetricsLogger (hpcrl/controller/metrics.py): metrics.jsonl as logged, and TensorBoard scalars
written as one event per step that TensorBoard reads exactly as it reads `add_scalar`'s one event
per key (same tags, steps and values); a fresh run keeps an earlier attempt's records in a file of
their own."""

from __future__ import annotations

import json

from torch.utils.tensorboard import SummaryWriter

from hpcrl.controller.metrics import MetricsLogger, read_metrics, set_aside_metrics

RECORDS = [{"reward/mean": 0.25, "train/loss": -1.5e-3, "rollout/tokens": 256, "sync/ok": True,
            "note": "text", "timing/step_s": 0.047},
           {"reward/mean": 0.5, "train/loss": 2.0, "rollout/tokens": 250, "sync/ok": False,
            "note": "more", "timing/step_s": 0.045, "val/reward_mean": 0.75}]


def _scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_reads_one_event_per_step_as_it_reads_add_scalar(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    logger = MetricsLogger(run, num_steps=2, progress=False)
    for step, record in enumerate(RECORDS):
        logger.log(step, record)
    logger.close()
    assert [{k: v for k, v in r.items() if k not in ("step", "time")} for r in read_metrics(run)] == RECORDS

    baseline = SummaryWriter(log_dir=str(tmp_path / "add_scalar"))
    for step, record in enumerate(RECORDS):
        for key, value in record.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                baseline.add_scalar(key, value, step)
    baseline.close()
    got, want = _scalars(run / "tensorboard"), _scalars(tmp_path / "add_scalar")
    assert got == want
    assert sorted(got) == ["reward/mean", "rollout/tokens", "timing/step_s", "train/loss", "val/reward_mean"]
    assert got["val/reward_mean"] == [(1, 0.75)]


def test_a_fresh_run_sets_an_earlier_attempts_records_aside(tmp_path):
    assert set_aside_metrics(tmp_path) is None  # nothing there
    for attempt in (1, 2):
        logger = MetricsLogger(tmp_path, num_steps=2, tensorboard=False, progress=False)
        logger.log(0, RECORDS[attempt - 1])
        logger.close()
        assert set_aside_metrics(tmp_path) == tmp_path / f"metrics.jsonl.{attempt}"
    assert not (tmp_path / "metrics.jsonl").exists()
    for attempt in (1, 2):  # each attempt's record, alone in its file
        lines = (tmp_path / f"metrics.jsonl.{attempt}").read_text().splitlines()
        assert [json.loads(line)["reward/mean"] for line in lines] == [RECORDS[attempt - 1]["reward/mean"]]


def _two_attempts(tmp_path, first_steps: int, start_step: int, num_steps: int) -> list[tuple[int, float]]:
    """TensorBoard's reward/mean after an attempt that logged steps 0..first_steps-1 (reward = step)
    and one that logged start_step..num_steps-1 (reward = 10 + step)."""
    run = tmp_path / "run"
    run.mkdir()
    first = MetricsLogger(run, num_steps=num_steps, progress=False)
    for step in range(first_steps):
        first.log(step, {"reward/mean": float(step)})
    first.close()
    second = MetricsLogger(run, num_steps=num_steps, start_step=start_step, progress=False)
    for step in range(start_step, num_steps):
        second.log(step, {"reward/mean": 10.0 + step})
    second.close()
    return _scalars(run / "tensorboard")["reward/mean"]


def test_a_resume_hides_the_steps_an_earlier_attempt_logged_past_its_checkpoint(tmp_path):
    """Killed after step 4, resumed from step 2's checkpoint: steps 3 and 4 are logged again, and
    TensorBoard shows each step once, with the resumed run's values (it showed both attempts')."""
    assert _two_attempts(tmp_path, 5, 3, 6) == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]


def test_a_rerun_from_step_0_hides_an_earlier_attempts_steps(tmp_path):
    """An attempt that saved no checkpoint (its metrics.jsonl is set aside), then a rerun from step 0:
    TensorBoard showed both attempts' steps 0 and 1."""
    assert _two_attempts(tmp_path, 2, 0, 3) == [(0, 10.0), (1, 11.0), (2, 12.0)]


def test_the_before_training_record_is_step_minus_1_and_a_rerun_replaces_it(tmp_path):
    """eval.before_train's record (step -1): TensorBoard shows it before step 0; a rerun from step 0
    (the attempt saved no checkpoint) evaluates again and shows its value once; a resume keeps it."""
    run = tmp_path / "run"
    run.mkdir()
    for attempt, start_step in ((1, 0), (2, 0), (3, 2)):
        logger = MetricsLogger(run, num_steps=3, start_step=start_step, progress=False)
        if start_step == 0:
            logger.log(-1, {"val/reward_mean": 0.25 * attempt})
        for step in range(start_step, 3):
            logger.log(step, {"reward/mean": 10.0 * attempt + step})
        logger.close()
    scalars = _scalars(run / "tensorboard")
    assert scalars["val/reward_mean"] == [(-1, 0.5)]
    assert scalars["reward/mean"] == [(0, 20.0), (1, 21.0), (2, 32.0)]
