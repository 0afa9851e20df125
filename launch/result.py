"""The outcome of an hpcrl run, written where submitit's job folder expects it.

submitit's `Job.result()` waits for `<folder>/<job_id>_<task>_result.pkl`, a cloudpickled
`("success", value)` or `("error", text)`, and raises `FailedJobError(text)` for the second; a
plain submitit job without accounting cannot tell that a job ended, so it waits until the file
exists. hpcrl does not run submitit's per-task `_submit` entry point (one MPI world, rank 0 the
controller), so the batch script writes this file itself on every way out it sees (not after a
requeue): after the step's final exit, and when the job stops without finishing (Slurm is ending
it, a requeue failed, the requeue cap): `python -P -m launch.result RUN_DIR FOLDER JOB_ID RC [WHY]`.
Only task 0 gets a result, because the run has one outcome, so a plain
`submitit.SlurmJob(folder, job_id).result()` from any process returns it. The value is
`run_summary(run_dir)`; a failed run's text says why the job stopped (WHY) and names the failed
rank and the phase from RUN_DIR/.failure.txt and .phase.json. This module reads run-dir files only
(no hpcrl) and imports submitit only to write or read a result, so any process may import
`REQUEUE_EXIT_CODE` from it cheaply.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

FINAL_FILE = "final.json"
REQUEUE_EXIT_CODE = 3
"""The one definition of the exit code of "checkpoint saved, requeue me": the controller exits with
it (hpcrl.controller.preemption), the batch script requeues on it (SlurmJobSpec.requeue_exit_code)."""
EXIT_INTERRUPTED = 130
"""`hpcrl run` ended by Ctrl-C (the shell's code): outside a world (hpcrl/cli.py), or a world stopped
without saving (launch/local.py)."""
EXPORT_FILE = ".export.json"  # launch/export_step.py's record: {"out", "rc", "step"}
EXPORT_FAILED_EXIT_CODE = 4  # the finish step's export failed (after 0 done, 1-2 failures, 3 requeue)


def result_path(folder: Path, job_id: str) -> Path:
    """Where submitit's `Job(folder, job_id).result()` looks for the outcome (task 0)."""
    from submitit.core import utils as submitit_utils

    return submitit_utils.JobPaths(folder, job_id=job_id, task_id=0).result_pickle


def read_outcome(folder: Path, job_id: str) -> tuple[str, Any] | None:
    """The job's (outcome, value) as `write_result` wrote it, or None while there is no result."""
    from submitit.core import utils as submitit_utils

    path = result_path(folder, job_id)
    try:
        return submitit_utils.pickle_load(path)
    except (OSError, EOFError):
        return None


def read_json(path: Path) -> Any:
    """The JSON value of `path`, or None when it is missing or not (yet) valid JSON."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def last_metrics(run_dir: Path) -> dict[str, Any] | None:
    """The last step's row of RUN_DIR/metrics.jsonl (a line being written is skipped), or None. A
    step's evaluation cut short by a preemption is a row of its own, after it (docs/evaluation.md):
    the rows of one step are merged."""
    last = None
    path = run_dir / "metrics.jsonl"
    if path.is_file():
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue  # a line cut short
            last = {**last, **row} if last is not None and row.get("step") == last.get("step") else row
    return last


def run_summary(run_dir: Path) -> dict[str, Any] | None:
    """The finished run's summary, or None when RUN_DIR/final.json is missing (it did not finish).

    Keys: `policy_sha256`, `num_steps` (from final.json), `last_step` (the last step in
    metrics.jsonl, or None), `metrics` (that step's metrics row, or {}) and `run_dir`; plus
    `export_dir` when the job exported its final checkpoint (launch/export_step.py).
    """
    final = read_json(run_dir / FINAL_FILE)
    if not isinstance(final, dict):
        return None
    last = last_metrics(run_dir) or {}
    summary = {"policy_sha256": final.get("policy_sha256"), "num_steps": final.get("num_steps"),
               "last_step": last.get("step"), "metrics": last, "run_dir": str(run_dir)}
    export = read_json(run_dir / EXPORT_FILE)
    if isinstance(export, dict) and export.get("rc") == 0:
        summary["export_dir"] = export.get("out")
    return summary


def failure_text(run_dir: Path, rc: int | None, why: str = "") -> str:
    """Why the run did not finish: why the batch script stopped the job (`why`, when it did: Slurm
    was ending it, a requeue failed, the requeue cap), the controller's report (which names the
    failed rank), the phase and step it was in, the step's exit code (None: the step had not
    exited yet) and where the logs are; or, when the job's finish-step export failed
    (`EXPORT_FAILED_EXIT_CODE`, launch/export_step.py), that."""
    lines = []
    failure = run_dir / ".failure.txt"
    export = read_json(run_dir / EXPORT_FILE)
    if why:
        lines.append(f"hpcrl job stopped without finishing: {why}")
    if rc == EXPORT_FAILED_EXIT_CODE and isinstance(export, dict) and export.get("rc"):
        return (f"the run finished, but exporting its final checkpoint to {export.get('out')} failed: "
                f"hpcrl export exited with code {export['rc']} (its message is in the batch log, "
                f"slurm-<jobid>.out in {run_dir / 'logs'}); the job exits with {rc}. Once fixed, run "
                f"`hpcrl export {run_dir} --out {export.get('out')}` and start the jobs that waited on it")
    if failure.is_file():
        lines.append(failure.read_text().strip())
    elif rc == REQUEUE_EXIT_CODE:
        lines.append(f"hpcrl run was interrupted (preempted or cancelled) and not requeued: the controller "
                     f"saved what it had (a checkpoint of its last completed step) and exited with {rc}; "
                     "submit the job again to resume from its latest checkpoint")
    elif rc is None:
        lines.append("submit the job again to resume from its latest checkpoint")
    else:
        lines.append(f"hpcrl run failed: the step exited with code {rc} and the controller left no report "
                     "(a rank or the launcher died before it could write RUN_DIR/.failure.txt)")
    phase = read_json(run_dir / ".phase.json")
    if isinstance(phase, dict):
        lines.append(f"controller phase: '{phase.get('phase', '?')}' of step {phase.get('step', '?')}")
    if rc == 0:
        lines.append(f"the step exited with code 0 but {run_dir / FINAL_FILE} is missing")
    elif rc is not None:
        lines.append(f"step exit code: {rc}")
    lines.append(f"logs: {run_dir / 'logs'}")
    return "\n".join(lines)


def outcome(run_dir: Path, rc: int | None, why: str = "") -> tuple[str, Any]:
    """submitit's (outcome, value): ("success", run_summary) when the step exited 0 and the run
    finished, else ("error", failure_text)."""
    summary = run_summary(run_dir) if rc == 0 else None
    if summary is not None:
        return "success", summary
    return "error", failure_text(run_dir, rc, why)


class RunOutcome:
    """The callable submitit pickles as a run's submission (`Job.submission().function`): calling
    it returns the run's summary or raises RuntimeError with `failure_text`. The job never runs it;
    it records which run dir the job belongs to."""

    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir

    def __call__(self) -> dict[str, Any]:
        kind, value = outcome(Path(self.run_dir), 0)
        if kind != "success":
            raise RuntimeError(value)
        return value

    def __repr__(self) -> str:
        return f"RunOutcome({self.run_dir!r})"


def write_result(folder: Path, job_id: str, run_dir: Path, rc: int | None, why: str = "") -> Path:
    """Write `outcome(run_dir, rc, why)` atomically as the job's result pickle; return its path."""
    from submitit.core import utils as submitit_utils

    path = result_path(folder, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    with submitit_utils.temporary_save_path(path) as tmp:
        submitit_utils.cloudpickle_dump(outcome(run_dir, rc, why), tmp)
    return path


USAGE = "usage: python -m launch.result RUN_DIR FOLDER JOB_ID RC [WHY]  (RC '' while the step still runs)"


def main(argv: list[str]) -> int:
    """`python -m launch.result RUN_DIR FOLDER JOB_ID RC [WHY]`: the batch script's result writer."""
    if len(argv) not in (4, 5) or not (argv[3] == "" or argv[3].lstrip("-").isdigit()):
        print(USAGE, file=sys.stderr)
        return 2
    run_dir, folder, job_id = Path(argv[0]), Path(argv[1]), argv[2]
    rc = int(argv[3]) if argv[3] else None
    path = write_result(folder, job_id, run_dir, rc, argv[4] if len(argv) == 5 else "")
    print(f"[hpcrl-batch] wrote the job's result: {path}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
