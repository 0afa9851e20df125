"""MoE routing replay end to end (rollout.routing_replay r3): the reference engine returns its routes
in SGLang's format, the controller carries them, the trainer replays them. The copy example learns
with r3, the trainer's routes equal the engine's every step (mismatch/router_agreement 1), and a run
interrupted by SIGUSR1 and resumed ends bit-identical to the uninterrupted one (the same
policy_sha256 and per-step rewards): the routes are regenerated with the samples, nothing to save."""

import json
from pathlib import Path

import numpy as np
import pytest
from e2e_util import EXAMPLE, hpcrl, leftover_processes, preempt_then_resume

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ARGS = ["--set", "rollout.routing_replay=r3", "--set", "checkpoint.interval_steps=3",
        "--set", "logging.progress=false"]


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def r3_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("r3") / "run"
    out, wall = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, timeout_s=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    print(f"r3 example: {len(records(run_dir))} steps in {wall:.0f} s wall")
    return run_dir


def test_the_copy_example_learns_with_r3_routing_the_engines_way(r3_run):
    recs = records(r3_run)
    assert all(r["mismatch/router_agreement"] == 1.0 for r in recs)
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in recs)
    rewards = np.array([r["reward/mean"] for r in recs])
    assert len(recs) == 80 and rewards[-5:].mean() >= 0.8, rewards.round(2).tolist()


def test_resume_with_r3_is_bit_identical(tmp_path, r3_run):
    run_dir = tmp_path / "run"
    preempt_then_resume(run_dir, ARGS, at_step=5, timeout_s=800)
    final = [json.loads((d / "final.json").read_text())["policy_sha256"] for d in (run_dir, r3_run)]
    assert final[0] == final[1]
    assert [(r["step"], r["reward/mean"]) for r in records(run_dir)] == \
        [(r["step"], r["reward/mean"]) for r in records(r3_run)]
    assert not leftover_processes(str(run_dir))
