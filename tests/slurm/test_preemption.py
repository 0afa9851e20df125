"""Issue 5 (b): a real preemption on the local Slurm cluster. A high-priority job takes the nodes
of a running `hpcrl submit` job -> Slurm's USR1 reaches the batch script -> the MPI world ->
the controller saves a checkpoint and exits with the requeue code -> the job is requeued and its
next attempt resumes from the checkpoint -> it completes with the same per-step rewards and the
same final policy_sha256 as an uninterrupted `hpcrl run` of the same job."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
ARGS = ["--set", "algorithm.num_steps=16", "--set", "checkpoint.interval_steps=5", "--set", "logging.progress=false",
        "--set", "logging.tensorboard=false"]


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(900)
def test_preempted_job_checkpoints_requeues_resumes_and_matches(slurm, job_dir: Path) -> None:
    local_dir, run_dir = job_dir / "local", job_dir / "slurm"
    local = subprocess.run([sys.executable, "-m", "hpcrl.cli", "run", str(EXAMPLE), *ARGS, "--run-dir",
                            str(local_dir)], capture_output=True, text=True, timeout=400, cwd=REPO)
    assert local.returncode == 0, local.stdout[-2000:] + local.stderr[-2000:]

    sub = subprocess.run([sys.executable, "-m", "hpcrl.cli", "submit", str(EXAMPLE), *ARGS, "--set",
                          "resources.rollout_nodes=1", "--run-dir", str(run_dir)], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert sub.returncode == 0, sub.stderr
    job_id = re.search(r"^submitted job (\d+) ", sub.stdout, re.MULTILINE).group(1)
    slurm.job_ids.append(job_id)
    slurm.wait_until("3 steps of the low-priority job", lambda: len(_metrics(run_dir)) >= 3, 400, job_id)
    nodes = len(slurm.nodes("high"))
    # --exclusive: whole nodes, so it cannot squeeze into the CPUs the running job leaves free
    blocker = slurm.submit(None, "-p", "high", "-N", str(nodes), "--exclusive", "--job-name", "hpcrl-preemptor",
                           "-o", str(job_dir / "preemptor-%j.out"), "--wrap", "sleep 5")
    slurm.wait_final(blocker, timeout_s=300)
    ended = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
    # PREEMPTED/REQUEUED are passing states here: the job must come back and finish.
    final = slurm.wait_until(f"job {job_id} to finish after its requeue",
                             lambda: next((r for r in slurm.job(job_id)[:1] if r["JobState"] in ended), None),
                             500, job_id)
    logs = sorted((run_dir / "logs").glob(f"{job_id}-attempt*.log"))
    text = "\n".join(p.read_text() for p in logs)
    assert final["JobState"] == "COMPLETED", f"{final}\n{text[-4000:]}"
    assert int(final.get("Restarts", "0")) >= 1, final
    assert len(logs) >= 2, logs
    assert "preempted" in logs[0].read_text(), logs[0].read_text()[-3000:]
    assert "resumed from checkpoint step" in logs[-1].read_text(), logs[-1].read_text()[-3000:]
    got = [(m["step"], m["reward/mean"]) for m in _metrics(run_dir)]
    want = [(m["step"], m["reward/mean"]) for m in _metrics(local_dir)]
    assert got == want
    digest = json.loads((local_dir / "final.json").read_text())["policy_sha256"]
    assert json.loads((run_dir / "final.json").read_text())["policy_sha256"] == digest
