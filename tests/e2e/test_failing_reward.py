"""A reward that fails on every completion (reward.max_failed_steps): the run stops with exit 2
naming the reward and its error, before the failing step's update, and saves the last completed
step (checkpoint.interval_steps 0 saved only at the end); W&B (offline) has the steps logged before
the stop (the abort killed its service before it wrote them) and the run's exit code. A resume
continues the row of failed steps the checkpoint holds."""

import json

import pytest
from e2e_util import EXAMPLE, hpcrl
from wandb_records import exit_code, history, offline_runs

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

REWARD = '''
def score(prompt, completion, answer, extra=None):
    return float(extra["reward_model"]["ground_truth"] == completion)  # the copy task's rows have no such column
'''


def test_a_reward_failing_on_every_completion_stops_the_run(tmp_path):
    (tmp_path / "broken_reward.py").write_text(REWARD)
    run_dir = tmp_path / "run"
    args = ["--set", "reward.fn=broken_reward:score", "--set", "reward.max_failed_steps=2",
            "--set", "algorithm.num_steps=4", "--set", "checkpoint.interval_steps=0", "--set", "logging.progress=false",
            "--set", "logging.wandb_project=hpcrl-e2e"]
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **{
        key: str(tmp_path / "wandb_home" / sub) for key, sub in
        (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"))}}
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *args, timeout_s=280,
                   env_extra={"PYTHONPATH": str(tmp_path), **wandb_env})
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("hpcrl run stopped: reward.fn='broken_reward:score' failed on every completion of 2 steps in a row "
            "(steps 0 to 1) (all scored 0: the policy learns nothing from them); step 1's first error, completion 0: "
            "KeyError: 'reward_model'") \
        in out.stderr, out.stderr[-3000:]
    assert "the latest checkpoint (step 0) is kept" in out.stderr and "Traceback" not in out.stderr
    # step 1 stopped at its scoring: no record, no update, no checkpoint of it
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0] and records[0]["reward/errors"] == 16 * 8  # prompts x group_size
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000000"]
    [wandb_run] = offline_runs(run_dir)
    assert [r["step"] for r in history(wandb_run)] == [0] and exit_code(wandb_run) == 2
    # Resumed with the reward still broken: the checkpoint's row (step 0) continues, so step 1 stops
    # the run again (a row restarted on resume trained on through two more failing steps).
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *args, timeout_s=280,
                   env_extra={"PYTHONPATH": str(tmp_path), **wandb_env})
    assert out.returncode == 2 and "resumed from checkpoint step 0" in out.stdout, out.stderr[-3000:]
    assert "failed on every completion of 2 steps in a row (steps 0 to 1)" in out.stderr, out.stderr[-3000:]
