"""Fixtures for tests that run against a real Slurm cluster (normally `tests/slurm/cluster.sh start`).

Every test under tests/slurm is skipped, with the reason, when `sinfo` cannot reach a controller.
The `slurm` fixture submits jobs, polls their state with deadlines and cancels whatever a test
submitted when the test ends, so no job (and no job process) outlives its test.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from launch.slurm_query import is_final

CLUSTER_SCRIPT = Path(__file__).with_name("cluster.sh")
CMD_TIMEOUT_S = 30.0


def run_cmd(args: list[str], timeout: float = CMD_TIMEOUT_S, check: bool = True) -> subprocess.CompletedProcess:
    """Run a Slurm client command with a hard timeout; on failure raise with its output."""
    proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


@functools.cache
def controller_problem() -> str | None:
    """None when `sinfo` reaches a controller, else the reason the slurm tests are skipped."""
    if shutil.which("sinfo") is None:
        return f"Slurm client tools are not installed; run `{CLUSTER_SCRIPT} start` as root"
    try:
        proc = run_cmd(["sinfo", "-h", "-o", "%P"], timeout=15, check=False)
    except subprocess.TimeoutExpired:
        return "sinfo timed out: the Slurm controller does not answer"
    if proc.returncode != 0 or not proc.stdout.strip():
        err = (proc.stderr.strip() or "no partitions").splitlines()[-1]
        return f"no Slurm controller reachable ({err}); start one with `{CLUSTER_SCRIPT} start` (root)"
    return None


@pytest.fixture(autouse=True)
def _require_slurm_controller() -> None:
    problem = controller_problem()
    if problem is not None:
        pytest.skip(problem)


def parse_scontrol(text: str) -> list[dict[str, str]]:
    """`scontrol -o show ...` output -> one dict per record (a hetjob prints one per component)."""
    records = []
    for line in text.splitlines():
        rec: dict[str, str] = {}
        for token in line.split():
            key, sep, value = token.partition("=")
            if sep:
                rec[key] = value
        if rec:
            records.append(rec)
    return records


@dataclass
class SlurmClient:
    """Submit jobs, read their state, wait with deadlines; cancels its jobs at teardown."""

    job_ids: list[str] = field(default_factory=list)

    def nodes(self, partition: str = "debug") -> list[str]:
        out = run_cmd(["sinfo", "-h", "-N", "-p", partition, "-o", "%N"]).stdout.split()
        return sorted(set(out), key=lambda n: (len(n), n))

    def partitions(self) -> set[str]:
        return {p.rstrip("*") for p in run_cmd(["sinfo", "-h", "-o", "%P"]).stdout.split()}

    def gres(self, partition: str = "debug") -> set[str]:
        return set(run_cmd(["sinfo", "-h", "-p", partition, "-o", "%G"]).stdout.split())

    def submit(self, script: Path | None, *sbatch_args: str, cwd: Path | None = None) -> str:
        """sbatch --parsable [args] [script]; returns the job id (the leader id for a hetjob)."""
        args = ["sbatch", "--parsable", *sbatch_args] + ([str(script)] if script is not None else [])
        job_id = run_cmd(args).stdout.strip().split(";")[0]
        self.job_ids.append(job_id)
        return job_id

    def signal_batch(self, job_id: str, signal_name: str) -> None:
        """Send a signal to the batch shell only (`scancel --batch`), not to the job's steps."""
        run_cmd(["scancel", "--batch", f"--signal={signal_name}", job_id])

    def job(self, job_id: str) -> list[dict[str, str]]:
        """Every component record of the job (scontrol keeps finished jobs for MinJobAge)."""
        return parse_scontrol(run_cmd(["scontrol", "-o", "show", "job", job_id]).stdout)

    def state(self, job_id: str) -> str:
        return self.job(job_id)[0]["JobState"]

    def wait_until(self, what: str, predicate, timeout_s: float, job_id: str | None = None, poll_s: float = 0.5):
        """Poll `predicate()` until it returns a truthy value; fail with `what` and the job record."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = predicate()
            if value:
                return value
            time.sleep(poll_s)
        detail = ""
        if job_id is not None:
            detail = "\n" + run_cmd(["scontrol", "show", "job", job_id], check=False).stdout
        pytest.fail(f"timed out after {timeout_s:.0f}s waiting for {what}{detail}")

    def wait_final(self, job_id: str, timeout_s: float) -> dict[str, str]:
        """Wait until the job (leader record) is in a final state; return that record."""
        def finished() -> dict[str, str] | None:
            record = self.job(job_id)[0]
            return record if is_final(record["JobState"], record.get("Requeue") != "0") else None

        return self.wait_until(f"job {job_id} to finish", finished, timeout_s, job_id)

    def cancel_all(self) -> None:
        live = [j for j in self.job_ids if self._live(j)]
        if not live:
            return
        run_cmd(["scancel", *live], check=False)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(self._live(j) for j in live):
            time.sleep(0.5)

    def _live(self, job_id: str) -> bool:
        proc = run_cmd(["scontrol", "-o", "show", "job", job_id], check=False)
        recs = parse_scontrol(proc.stdout) if proc.returncode == 0 else []
        return any(not is_final(r.get("JobState", ""), r.get("Requeue") != "0") for r in recs)


@pytest.fixture
def slurm() -> SlurmClient:
    client = SlurmClient()
    yield client
    client.cancel_all()


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A directory every virtual node can write (they all run on this host, as root)."""
    os.chmod(tmp_path, 0o777)
    return tmp_path
