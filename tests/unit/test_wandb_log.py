"""W&B logging (hpcrl/controller/wandb_log.py) in offline mode, read back from the files W&B wrote:
every record at its `step`, a requeued run continuing the same W&B run, and a resume from before
the W&B run's last step starting a new W&B run that gets the restored history first."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("wandb")  # installed with hpcrl's test extras

from wandb_records import history, offline_runs, run_id  # noqa: E402

from hpcrl.controller.wandb_log import STATE_FILE, WandbError, WandbLog  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for key, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    yield run_dir
    import wandb

    wandb.teardown()  # its service and settings live on in this process: the next test's start afresh


def _record(step):
    return {"step": step, "time": 1.5e9 + step, "reward/mean": step / 8, "sync/ok": True, "note": "text"}


def _attempt(run_dir, first_step, history_records, steps):
    log = WandbLog("hpcrl-test", None, run_dir, {"algorithm": {"lr": 1e-3}}, first_step, history_records)
    for step in steps:
        record = _record(step)
        log.log(step, {k: v for k, v in record.items() if k not in ("step", "time")})
    log.close()
    import wandb

    wandb.teardown()  # its service writes the run file behind finish(); teardown waits for it (a run's end)
    return log


def test_records_a_requeue_and_a_resume_from_before_the_last_logged_step(offline):
    run_dir = offline
    first = _attempt(run_dir, -1, [], [-1, 0, 1, 2])  # a fresh run, eval.before_train's record first
    assert not first.continued
    assert json.loads((run_dir / STATE_FILE).read_text()) == {"id": first.run_id, "last_step": 2}
    [path] = offline_runs(run_dir)
    assert run_id(path) == first.run_id
    # numbers only (no bools, no strings), at their step; the record's time is not a metric
    assert history(path) == [{"reward/mean": s / 8, "step": s} for s in (-1, 0, 1, 2)]

    # requeued after a checkpoint of step 2: the same W&B run goes on from step 3
    second = _attempt(run_dir, 3, [_record(s) for s in range(-1, 3)], [3, 4])
    assert second.continued and second.run_id == first.run_id
    assert history(offline_runs(run_dir)[-1]) == [{"reward/mean": s / 8, "step": s} for s in (3, 4)]

    # resumed from step 1's checkpoint while W&B has up to step 4: a new W&B run, the restored
    # history (steps -1..1) first, then this attempt's steps
    third = _attempt(run_dir, 2, [_record(s) for s in range(-1, 2)], [2, 3])
    assert not third.continued and third.run_id != first.run_id
    path = offline_runs(run_dir)[-1]
    assert run_id(path) == third.run_id
    assert history(path) == [{"reward/mean": s / 8, "step": s} for s in (-1, 0, 1, 2, 3)]

    # a rerun from step 0 (no checkpoint): a new W&B run again
    assert not _attempt(run_dir, -1, [], [0]).continued


def test_a_failing_wandb_init_names_what_to_set(offline, tmp_path, monkeypatch):
    """Online without an API key (a compute node nobody logged in on): wandb's UsageError, in words."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no wandb login either
    with pytest.raises(WandbError, match=r"logging.wandb_project='hpcrl-test': wandb.init failed \(.*\); set "
                                         r"WANDB_API_KEY \(wandb login\), or WANDB_MODE=offline"):
        WandbLog("hpcrl-test", None, offline, {}, -1, [])
