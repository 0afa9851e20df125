"""Python API: submit hpcrl runs to Slurm (or run them locally) and handle them as submitit jobs.

    from hpcrl.jobs import Executor
    ex = Executor(kind="slurm")                  # "local": the same handle over `hpcrl run` (mpiexec)
    job = ex.submit("examples/tiny_moe_grpo.yaml", ["algorithm.num_steps=4"], run_dir="runs/a")
    job.state, job.done(), job.restarts          # RUNNING, False, 0
    summary = job.result()                       # {"policy_sha256": ..., "last_step": 3, ...}

`Executor.submit` does what `hpcrl submit` / `hpcrl run` do before starting anything (load and
validate the job, check it against the cluster, check the resume request, prepare the run dir) and
raises the same `ConfigError` with the same one-line message. The Slurm handle is
`launch.slurm_executor.HetJob` (a `submitit.SlurmJob`), the local one `launch.local_job.LocalRunJob`;
both are submitit `Job`s, and `attach(run_dir)` re-attaches from any process. `after=[job]` starts a
Slurm job only once those jobs completed (afterok); `submit_batch` checks every job of a list first
and then submits each (a hetjob cannot be a Slurm array).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpcrl.config import ConfigError, JobConfig, apply_overrides, job_from_dict, load_job, to_dict, validate
from hpcrl.runner import check_resume, prepare_run_dir, resolve_run_dir

KINDS = ("slurm", "local")
LOCAL_RECORD = "local_job.json"
SUBMITTED_JOB_FILE = "submitted_job.yaml"


@dataclass(frozen=True)
class Submission:
    """One entry of `Executor.submit_batch`: a job file or config object, its `--set` overrides and
    its run dir (None: logging.run_dir or runs/<name>-<time>, as on the command line)."""

    job: str | os.PathLike[str] | JobConfig
    overrides: Sequence[str] = ()
    run_dir: str | os.PathLike[str] | None = None
    resume: str = "auto"
    after: Sequence[Any] = field(default_factory=tuple)


def load(job: str | os.PathLike[str] | JobConfig, overrides: Iterable[str] = ()) -> JobConfig:
    """A validated JobConfig from a job file or a config object, with `a.b=value` overrides applied.
    ConfigError (the CLI's message) on the first problem."""
    if not isinstance(job, JobConfig):
        return load_job(job, list(overrides))
    raw = to_dict(job)
    apply_overrides(raw, overrides)
    loaded = job_from_dict(raw, job.base_dir)
    validate(loaded, "run")
    return loaded


def _slurm_error(exc: Exception) -> ConfigError:
    return ConfigError(exc.path, exc.value, exc.hint)  # type: ignore[attr-defined]


def plan_slurm(job: JobConfig, run_dir: Path, resume: str = "auto") -> Any:
    """`hpcrl submit`'s checks without side effects: the rendered plan (cluster, run dir, resume)."""
    from launch.slurm_query import SlurmError
    from launch.slurm_submit import plan_submission

    try:
        plan = plan_submission(job, run_dir, resume=resume)
    except SlurmError as exc:
        raise _slurm_error(exc) from None
    check_resume(job, run_dir, resume)
    return plan


def start_slurm(job: JobConfig, plan: Any, after: Sequence[Any] = (), warn: Any = None) -> tuple[Any, dict]:
    """Print the plan's warnings (or pass them to `warn`), prepare the run dir and sbatch the plan
    through `HetJobExecutor`; returns (HetJob, RUN_DIR/slurm.json record)."""
    from launch.slurm_query import SlurmError
    from launch.slurm_submit import submit_run

    for warning in plan.warnings:
        (warn or (lambda text: print(f"hpcrl submit: warning: {text}", file=sys.stderr)))(warning)
    prepare_run_dir(job, plan.run_dir)
    try:
        return submit_run(plan, after=after)
    except SlurmError as exc:
        raise _slurm_error(exc) from None


def _resume_flags(resume: str) -> list[str]:
    if resume == "auto":
        return []
    return ["--no-resume"] if resume == "none" else ["--resume-from", str(int(resume))]


def run_local_background(job: JobConfig, run_dir: Path, resume: str = "auto") -> Any:
    """`hpcrl run` of `job` in the background (launch.local_job); returns its LocalRunJob."""
    from launch.local_job import LocalRunExecutor

    check_resume(job, run_dir, resume)
    prepare_run_dir(job, run_dir)
    job_file = run_dir / SUBMITTED_JOB_FILE
    job_file.write_text(yaml.safe_dump(to_dict(job), sort_keys=False))
    # -P: the caller's working directory stays off sys.path (a `checkpoints/` there would shadow ours)
    argv = [sys.executable, "-P", "-m", "hpcrl.cli", "run", str(job_file), "--run-dir", str(run_dir),
            *_resume_flags(resume)]
    handle = LocalRunExecutor(run_dir / "logs").submit_command(argv, run_dir)
    record = {"job_id": handle.job_id, "folder": str(handle.paths.folder), "argv": argv}
    (run_dir / LOCAL_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    return handle


class Executor:
    """Submits hpcrl runs; `kind` is "slurm" (a Slurm job, `HetJob`) or "local" (`hpcrl run` in
    the background on this machine, `LocalRunJob`). Both handles are submitit Jobs."""

    def __init__(self, kind: str = "slurm") -> None:
        if kind not in KINDS:
            raise ValueError(f"kind={kind!r}: choose one of {', '.join(KINDS)}")
        self.kind = kind

    def submit(self, job: str | os.PathLike[str] | JobConfig, overrides: Sequence[str] = (),
               run_dir: str | os.PathLike[str] | None = None, resume: str = "auto",
               after: Sequence[Any] = ()) -> Any:
        """Check and start one run; see `Submission` for the arguments (`after`: Slurm only)."""
        return self.submit_batch([Submission(job, overrides, run_dir, resume, after)])[0]

    def submit_batch(self, submissions: Sequence[Submission]) -> list[Any]:
        """Load and validate every submission first (nothing starts if one is bad; run dirs must
        differ), then start each in order; returns their jobs in the same order."""
        loaded = []
        for s in submissions:
            job = load(s.job, s.overrides)
            loaded.append((job, resolve_run_dir(job, None if s.run_dir is None else str(s.run_dir)), s))
        dirs = [str(d) for _, d, _ in loaded]
        if len(set(dirs)) != len(dirs):
            raise ConfigError("run_dir", dirs, "every job of a batch needs its own run dir; give run_dir= "
                              "to each submission")
        if self.kind == "local" and any(s.after for _, _, s in loaded):
            raise ConfigError("after", "local", "dependencies need Slurm; run local jobs one after another")
        if self.kind == "local":
            for job, run_dir, s in loaded:
                check_resume(job, run_dir, s.resume)
            return [run_local_background(job, run_dir, s.resume) for job, run_dir, s in loaded]
        plans = [plan_slurm(job, run_dir, s.resume) for job, run_dir, s in loaded]
        return [start_slurm(job, plan, s.after)[0] for (job, _, s), plan in zip(loaded, plans)]


def attach(run_dir: str | os.PathLike[str]) -> Any:
    """The job of a run dir made by `hpcrl submit`, `Executor.submit` or a local `Executor`."""
    path = Path(run_dir).resolve()
    slurm_record = path / "slurm.json"
    if slurm_record.is_file():
        from launch.slurm_runs import resolve_job

        return resolve_job(str(path))  # what hpcrl status/logs/cancel act on
    local_record = path / LOCAL_RECORD
    if local_record.is_file():
        from launch.local_job import LocalRunJob

        record = json.loads(local_record.read_text())
        return LocalRunJob(record["folder"], record["job_id"])
    raise ConfigError("run_dir", str(path), "holds no slurm.json or local_job.json: it was not started by "
                      "hpcrl submit or hpcrl.jobs.Executor")
