"""W&B logging (hpcrl/controller/wandb_log.py) in offline mode, read back from the files W&B wrote:
every record at its `step`, each attempt a whole W&B run with the restored history, its exit code;
and when an online attempt continues the W&B run (no W&B server here: the rule alone)."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("wandb")  # installed with hpcrl's test extras

from wandb_records import exit_code, history, offline_runs, run_id  # noqa: E402

from hpcrl.controller.wandb_log import STATE_FILE, WandbError, WandbLog, continues  # noqa: E402


@pytest.fixture
def offline(tmp_path, monkeypatch):
    for key, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(key, str(tmp_path / sub))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.delenv("WANDB_ENTITY", raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    yield run_dir
    import wandb

    wandb.teardown()  # its service and settings live on in this process: the next test's start afresh


def _record(step):
    return {"step": step, "time": 1.5e9 + step, "reward/mean": step / 8, "sync/ok": True, "note": "text"}


def _attempt(run_dir, first_step, history_records, steps, exit_code=0):
    log = WandbLog("hpcrl-test", None, run_dir, {"algorithm": {"lr": 1e-3}}, first_step, history_records)
    for step in steps:
        record = _record(step)
        log.log(step, {k: v for k, v in record.items() if k not in ("step", "time")})
    log.close(exit_code=exit_code)
    import wandb

    wandb.teardown()  # its service writes the run file behind finish(); teardown waits for it (a run's end)
    return log


def test_offline_every_attempt_is_a_whole_w_and_b_run(offline):
    """Offline (wandb cannot resume offline runs: a second offline run under one id counts its steps
    from 0, and syncing both can replace the first's history): each attempt is a new W&B run that
    gets the restored history first, and ends with the attempt's exit code."""
    run_dir = offline
    first = _attempt(run_dir, -1, [], [-1, 0, 1, 2], exit_code=3)  # eval.before_train's record first; preempted
    assert not first.continued
    assert json.loads((run_dir / STATE_FILE).read_text()) == {"id": first.run_id, "project": "hpcrl-test",
                                                              "entity": None, "last_step": 2}
    [path] = offline_runs(run_dir)
    assert run_id(path) == first.run_id and exit_code(path) == 3
    # numbers only (no bools, no strings), at their step; the record's time is not a metric
    assert history(path) == [{"reward/mean": s / 8, "step": s} for s in (-1, 0, 1, 2)]

    # requeued after a checkpoint of step 2: a new offline run with the history, then steps 3 and 4
    second = _attempt(run_dir, 3, [_record(s) for s in range(-1, 3)], [3, 4])
    assert not second.continued and second.run_id != first.run_id
    path = offline_runs(run_dir)[-1]
    assert run_id(path) == second.run_id and exit_code(path) == 0
    assert history(path) == [{"reward/mean": s / 8, "step": s} for s in range(-1, 5)]


def test_online_a_requeue_continues_unless_the_w_and_b_run_is_ahead_or_elsewhere():
    where = {"project": "p", "entity": None}
    state = {"id": "abc", **where, "last_step": 4}
    assert continues(state, where, offline=False, first_step=5)  # preempted after saving step 4
    assert not continues(state, where, offline=False, first_step=3)  # resumed from step 2: W&B has 3, 4
    assert not continues(state, where, offline=False, first_step=-1)  # a rerun from step 0
    assert continues({**state, "last_step": None}, where, offline=False, first_step=-1)  # nothing logged yet
    assert not continues(state, {**where, "project": "q"}, offline=False, first_step=5)
    assert not continues(state, {**where, "entity": "lab"}, offline=False, first_step=5)
    assert not continues(state, where, offline=True, first_step=5)
    assert not continues(None, where, offline=False, first_step=5)


def test_a_failing_wandb_init_names_what_to_set(offline, tmp_path, monkeypatch):
    """Online without an API key (a compute node nobody logged in on): wandb's UsageError, in words."""
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "netrc"))  # no wandb login either
    with pytest.raises(WandbError, match=r"logging.wandb_project='hpcrl-test': wandb.init failed \(.*\); without "
                                         r"a login set WANDB_API_KEY \(wandb login\), and on nodes without internet "
                                         r"WANDB_MODE=offline"):
        WandbLog("hpcrl-test", None, offline, {}, -1, [])


def test_a_controller_environment_without_wandb_is_named(offline, monkeypatch):
    """slurm.python may name another environment than the one that validated the job."""
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ModuleNotFoundError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    with monkeypatch.context() as patched, pytest.raises(
            WandbError, match=r"logging.wandb_project='hpcrl-test': wandb does not import in the controller's "
                              r"environment \(ModuleNotFoundError: No module named 'wandb'\); install it there"):
        patched.setattr(builtins, "__import__", no_wandb)
        WandbLog("hpcrl-test", None, offline, {}, -1, [])


def test_a_bounded_close_does_not_wait_for_a_hanging_upload(offline):
    """A run stopping early (an error, a preemption within Slurm's grace time) waits for W&B at most
    wait_s: an upload that hangs must not hold it until the kill."""
    import time

    log = WandbLog("hpcrl-test", None, offline, {}, -1, [])
    finish = log._run.finish
    log._run.finish = lambda exit_code=0: time.sleep(5)  # an upload that hangs
    t0 = time.monotonic()
    log.close(wait_s=0.5, exit_code=3)
    assert time.monotonic() - t0 < 3.0  # 0.5 s, with room for a loaded machine (the hang is 5 s)
    finish(exit_code=3)
