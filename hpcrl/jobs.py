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

Sweeps: `sweep_points(["algorithm.lr=1e-4,3e-4"])` gives one override tuple per job and
`sweep_dir_name` its run dir under the sweep's; `hpcrl submit JOB --sweep KEY=V1,V2` submits them
with `submit_batch`.

Pipelines: `export_to=DIR` makes a job export its final checkpoint to DIR at its end (`hpcrl
export`, in the batch script's finish step; a failed export fails the job). A job submitted with
`after=[that job]` and `model.path` = DIR is checked before DIR exists: everything is validated
with the dependency's model (its model.path, config_path or preset, from its run dir) standing in
for the export, which has that model's config.json, weights and tokenizer files:

    sft = ex.submit("sft.yaml", run_dir="runs/sft", export_to="runs/sft/export")
    rl = ex.submit("grpo.yaml", ["model.path=runs/sft/export"], run_dir="runs/rl", after=[sft])
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
from hpcrl.config.load import load_yaml
from hpcrl.runner import check_resume, check_run_dir_writable, prepare_run_dir, resolve_run_dir
from launch.checkpoint_step import checkpoint_dir

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
    export_to: str | os.PathLike[str] | None = None
    """Export the final checkpoint there (a HuggingFace model directory) when the run finishes."""


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


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def declared_export(dependency: Any) -> tuple[Path, dict[str, Any], str] | None:
    """(export dir, model section of its resolved config, job id) of a Slurm job submitted with
    `export_to` (a HetJob, or the job id of an hpcrl run Slurm still knows), else None."""
    run_dir = getattr(dependency, "run_dir", None)
    job_id = getattr(dependency, "job_id", dependency)
    if run_dir is None:
        from launch.slurm_query import SlurmError
        from launch.slurm_runs import resolve_job

        try:
            run_dir = resolve_job(str(dependency)).run_dir
        except SlurmError:
            return None  # not an hpcrl run (a plain sbatch job): it declares no export
    record, config = _read_json(Path(run_dir) / "slurm.json"), _read_json(Path(run_dir) / "config.json")
    if not isinstance(record, dict) or str(record.get("job_id")) != str(job_id):
        return None
    if not record.get("export_dir"):
        return None
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        return None
    return Path(record["export_dir"]), config["model"], str(job_id)


def _model_path(job: str | os.PathLike[str] | JobConfig, overrides: Iterable[str]) -> str | None:
    """The job's model.path as loading resolves it, without validating anything; None when the job
    cannot be read (loading it then reports why)."""
    try:
        return load_unchecked(job, overrides).model.path
    except (OSError, ValueError, TypeError, AttributeError, yaml.YAMLError):
        return None


SOURCE_KEYS = ("path", "preset", "config_path")
"""The model section's keys that choose the model; a stand-in takes the dependency's."""


def load_after(job: str | os.PathLike[str] | JobConfig, overrides: Sequence[str] = (),
               after: Sequence[Any] = ()) -> tuple[JobConfig, JobConfig | None]:
    """`load`, for a job that waits on `after`: (job, stand-in). When the job's model.path is the
    export dir a dependency declared (`declared_export`), the job is validated with that
    dependency's model in its place (the stand-in, returned too; `start_slurm` prepares the run dir
    from it) and the job itself is returned unvalidated otherwise equal; else (load(...), None)."""
    path = _model_path(job, overrides) if after else None
    exports = [e for e in map(declared_export, after) if e is not None] if path else []
    match = next((e for e in exports if path and Path(path).resolve() == e[0].resolve()), None)
    if match is None:
        return load(job, overrides), None
    _, model, dep_id = match
    stand_in = [f"model.{k}={json.dumps(model.get(k))}" for k in SOURCE_KEYS]
    try:
        checked = load(job, [*overrides, *stand_in])
    except ConfigError as exc:
        source = ", ".join(f"model.{k}={model.get(k)}" for k in SOURCE_KEYS if model.get(k) is not None)
        raise ConfigError(exc.path, exc.value, f"{exc.hint} [model.path={path} is job {dep_id}'s export, "
                                               f"not written yet: checked as the model that job trains, "
                                               f"{source}]") from None
    raw = to_dict(checked)
    own = to_dict(load_unchecked(job, overrides))["model"]
    raw["model"].update({k: own[k] for k in SOURCE_KEYS})
    return job_from_dict(raw, checked.base_dir), checked


def load_unchecked(job: str | os.PathLike[str] | JobConfig, overrides: Iterable[str] = ()) -> JobConfig:
    """The job with overrides applied, typed and paths resolved, but not validated."""
    if isinstance(job, JobConfig):
        raw, base = to_dict(job), job.base_dir
    else:
        raw, base = load_yaml(Path(job).read_text()), str(Path(job).resolve().parent)
    apply_overrides(raw, overrides)
    return job_from_dict(raw, base)


def _slurm_error(exc: Exception) -> ConfigError:
    return ConfigError(exc.path, exc.value, exc.hint)  # type: ignore[attr-defined]


def plan_slurm(job: JobConfig, run_dir: Path, resume: str = "auto", export_to: Path | None = None) -> Any:
    """`hpcrl submit`'s checks without side effects: the rendered plan (cluster, run dir, resume,
    export dir)."""
    from launch.slurm_query import SlurmError
    from launch.slurm_submit import plan_submission

    try:
        plan = plan_submission(job, run_dir, resume=resume, export_dir=export_to)
    except SlurmError as exc:
        raise _slurm_error(exc) from None
    check_resume(job, run_dir, resume)
    check_run_dir_writable(job, run_dir)  # what prepare_run_dir would refuse (submit --dry-run stops here)
    return plan


def start_slurm(job: JobConfig, plan: Any, after: Sequence[Any] = (), warn: Any = None,
                stand_in: JobConfig | None = None) -> tuple[Any, dict]:
    """Print the plan's warnings (or pass them to `warn`), prepare the run dir and sbatch the plan
    through `HetJobExecutor`; returns (HetJob, RUN_DIR/slurm.json record). With a `stand_in`
    (`load_after`), the run dir's model_config.json is the stand-in's model (the export's
    config.json once it exists) and config.json/config.yaml are `job`'s."""
    from launch.result import EXPORT_FILE
    from launch.slurm_query import SlurmError
    from launch.slurm_submit import submit_run

    for warning in plan.warnings:
        (warn or (lambda text: print(f"hpcrl submit: warning: {text}", file=sys.stderr)))(warning)
    prepare_run_dir(stand_in or job, plan.run_dir)
    if stand_in is not None:
        resolved = to_dict(job)
        (plan.run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
        (plan.run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    (plan.run_dir / EXPORT_FILE).unlink(missing_ok=True)  # an earlier job's export record
    try:
        return submit_run(plan, after=after)
    except SlurmError as exc:
        raise _slurm_error(exc) from None


def _resume_flags(resume: str) -> list[str]:
    if resume == "auto":
        return []
    return ["--no-resume"] if resume == "none" else ["--resume-from", str(int(resume))]


def check_export_to(job: JobConfig, run_dir: Path, export_to: Path | None) -> None:
    """ConfigError when `export_to` would overwrite the run's own files (run dir, checkpoints)."""
    from launch.slurm_query import SlurmError
    from launch.slurm_submit import check_export_dir

    if export_to is not None:
        try:
            check_export_dir(job, run_dir, export_to)
        except SlurmError as exc:
            raise _slurm_error(exc) from None


def run_local_background(job: JobConfig, run_dir: Path, resume: str = "auto",
                         export_to: Path | None = None) -> Any:
    """`hpcrl run` of `job` in the background (launch.local_job), exporting its final checkpoint to
    `export_to` when it finishes; returns its LocalRunJob."""
    from launch.local_job import LocalRunExecutor
    from launch.result import EXPORT_FILE

    check_resume(job, run_dir, resume)
    check_export_to(job, run_dir, export_to)
    prepare_run_dir(job, run_dir)
    (run_dir / EXPORT_FILE).unlink(missing_ok=True)  # an earlier job's export record
    job_file = run_dir / SUBMITTED_JOB_FILE
    job_file.write_text(yaml.safe_dump(to_dict(job), sort_keys=False))
    # -P: the caller's working directory stays off sys.path (a `checkpoints/` there would shadow ours)
    argv = [sys.executable, "-P", "-m", "hpcrl.cli", "run", str(job_file), "--run-dir", str(run_dir),
            *_resume_flags(resume)]
    handle = LocalRunExecutor(run_dir / "logs").submit_command(argv, run_dir, export_to)
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
               after: Sequence[Any] = (), export_to: str | os.PathLike[str] | None = None) -> Any:
        """Check and start one run; see `Submission` for the arguments (`after`: Slurm only)."""
        return self.submit_batch([Submission(job, overrides, run_dir, resume, after, export_to)])[0]

    def submit_batch(self, submissions: Sequence[Submission]) -> list[Any]:
        """Load and validate every submission first (nothing starts if one is bad; run dirs must
        differ), then start each in order; returns their jobs in the same order."""
        loaded, stand_ins = self._load_batch(submissions)
        if self.kind == "local":
            for job, run_dir, s in loaded:
                check_resume(job, run_dir, s.resume)
                check_export_to(job, run_dir, _export_dir(s))
            return [run_local_background(job, run_dir, s.resume, _export_dir(s))
                    for job, run_dir, s in loaded]
        plans = [plan_slurm(job, run_dir, s.resume, _export_dir(s)) for job, run_dir, s in loaded]
        return [start_slurm(job, plan, s.after, stand_in=stand_in)[0]
                for (job, _, s), plan, stand_in in zip(loaded, plans, stand_ins)]

    def plan_batch(self, submissions: Sequence[Submission]) -> list[Any]:
        """Every check of `submit_batch` on Slurm, nothing submitted or written: each submission's
        checked `SubmitPlan` (`hpcrl submit --sweep ... --dry-run`)."""
        if self.kind != "slurm":
            raise ConfigError("kind", self.kind, "a dry run plans Slurm jobs: use Executor(kind='slurm')")
        loaded, _ = self._load_batch(submissions)
        return [plan_slurm(job, run_dir, s.resume, _export_dir(s)) for job, run_dir, s in loaded]

    def _load_batch(self, submissions: Sequence[Submission]) -> tuple[list[tuple[JobConfig, Path, Submission]],
                                                                      list[JobConfig | None]]:
        """Every submission loaded and validated, with its run dir and stand-in (load_after); the
        checks across the batch (own run dirs and checkpoint dirs, no dependencies locally)."""
        loaded, stand_ins = [], []
        for s in submissions:
            job, stand_in = load_after(s.job, s.overrides, s.after if self.kind == "slurm" else ())
            loaded.append((job, resolve_run_dir(job, None if s.run_dir is None else str(s.run_dir)), s))
            stand_ins.append(stand_in)
        dirs = [str(d) for _, d, _ in loaded]
        if len(set(dirs)) != len(dirs):
            raise ConfigError("run_dir", dirs, "every job of a batch needs its own run dir; give run_dir= "
                              "to each submission")
        ckpt_dirs = [str(checkpoint_dir(job, d).resolve()) for job, d, _ in loaded]
        if len(set(ckpt_dirs)) != len(ckpt_dirs):
            raise ConfigError("checkpoint.dir", ckpt_dirs, "every job of a batch needs its own checkpoint dir "
                              "(they would overwrite, delete and resume each other's checkpoints): leave "
                              "checkpoint.dir null (RUN_DIR/checkpoints) or give each job its own")
        if self.kind == "local" and any(s.after for _, _, s in loaded):
            raise ConfigError("after", "local", "dependencies need Slurm; run local jobs one after another")
        return loaded, stand_ins


def _export_dir(s: Submission) -> Path | None:
    return None if s.export_to is None else Path(s.export_to).expanduser().resolve()


def sweep_points(sweeps: Sequence[str]) -> list[tuple[str, ...]]:
    """`--sweep KEY=V1,V2,...` options -> one tuple of `KEY=V` overrides per job: every combination
    of the options' values (the first option varies slowest). ConfigError for a malformed option, an
    unknown key, a key swept twice or an empty value."""
    from hpcrl.config import valid_keys

    axes: list[list[str]] = []
    seen: set[str] = set()
    for text in sweeps:
        key, sep, values = text.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError("--sweep", text, "expected KEY=V1,V2,... with a dotted key, e.g. "
                                               "--sweep algorithm.lr=1e-4,3e-4")
        if key not in valid_keys():
            raise ConfigError("--sweep", text, f"unknown key {key!r}; the keys are those of --set (hpcrl "
                                               "validate lists them for an unknown --set key)")
        if key in seen:
            raise ConfigError("--sweep", text, f"{key} is swept twice; give its values in one --sweep")
        seen.add(key)
        points = [v.strip() for v in values.split(",")]
        if any(not v for v in points):
            raise ConfigError("--sweep", text, "an empty value; separate the values by single commas "
                                               "(values cannot contain commas)")
        axes.append([f"{key}={v}" for v in points])
    combos: list[tuple[str, ...]] = [()]
    for axis in axes:
        combos = [(*c, o) for c in combos for o in axis]
    return combos


def sweep_dir_name(point: Sequence[str]) -> str:
    """The run dir (under the sweep's run dir) of one sweep point: 'algorithm.lr=1e-4,data.seed=2'
    -> 'lr=1e-4_seed=2' (the last part of each key; '/' and whitespace become '-')."""
    parts = []
    for override in point:
        key, _, value = override.partition("=")
        parts.append(f"{key.rsplit('.', 1)[-1]}={value}")
    return "".join("-" if c == "/" or c.isspace() else c for c in "_".join(parts))


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
