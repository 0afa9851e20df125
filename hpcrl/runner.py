"""`hpcrl run`: validate the job, prepare the run dir, start the local MPI world, report.

The run dir holds: config.yaml/config.json (resolved job), model_config.json (the HF config of the
policy), metrics.jsonl, tensorboard/, logs/ (one file per worker rank and engine), final.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from hpcrl import cpu_bind
from hpcrl.checkpoint_owner import check_not_in_use, check_own_checkpoint
from hpcrl.config import load_job, to_dict
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import JobConfig, rollout_ranks
from hpcrl.models.presets import load_hf_config
from launch.checkpoint_step import RUN_ID_FILE, checkpoint_dir, run_id
from launch.result import EXIT_INTERRUPTED
from launch.result import REQUEUE_EXIT_CODE as EXIT_REQUEUE  # the controller's "requeue me"

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2  # the controller's code for bad data or an algorithm's misuse (hpcrl/controller/main.py)


def resolve_run_dir(job: JobConfig, cli_run_dir: str | None) -> Path:
    if cli_run_dir is not None:
        if not cli_run_dir.strip():
            raise ConfigError("--run-dir", cli_run_dir, "give a directory, or leave --run-dir out for "
                                                        "logging.run_dir or runs/<name>-<time>")
        return Path(cli_run_dir).resolve()
    if job.logging.run_dir:
        return (Path(job.base_dir) / job.logging.run_dir).resolve()
    return (Path("runs") / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def run_dir_key(job: JobConfig, run_dir: Path) -> str:
    """The setting that named `run_dir`, for messages: logging.run_dir, or --run-dir."""
    if job.logging.run_dir and (Path(job.base_dir) / job.logging.run_dir).resolve() == run_dir.resolve():
        return "logging.run_dir"
    return "--run-dir"


def _make_writable(path: Path, key: str, value: str, fix: str) -> None:
    """Create `path` (with its parents) and write a file in it; ConfigError on `key` when it cannot."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(key, value, f"cannot create or write it ({exc.strerror}); {fix}") from None


LOCK_FILE = ".hpcrl_lock"


def lock_run_dir(job: JobConfig, run_dir: Path) -> int:
    """An exclusive lock on RUN_DIR/.hpcrl_lock for the run's life; returns its fd, which the
    launcher hands to mpiexec too, so that a world whose `hpcrl run` was killed keeps it. ConfigError
    (exit 2) while another run holds it: two runs in one run dir resumed, wrote and deleted each
    other's checkpoints and metrics."""
    import fcntl

    _make_writable(run_dir, run_dir_key(job, run_dir), str(run_dir), "choose a writable directory")
    fd = os.open(run_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError(run_dir_key(job, run_dir), str(run_dir),
                          f"is in use by another hpcrl run (its `hpcrl run` pid {holder}, or the MPI world it "
                          f"left running: `pgrep -af {run_dir}` lists it); wait for it, stop it, or use "
                          "another --run-dir") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _check_writable(path: Path, key: str, value: str, fix: str) -> None:
    """What `_make_writable` checks, creating nothing (`hpcrl submit --dry-run`): the nearest existing
    of `path` and its parents is a directory this process may write."""
    found = path
    while not found.exists() and not found.is_symlink() and found != found.parent:
        found = found.parent
    why = ("File exists" if found == path else "Not a directory") if not found.is_dir() else \
        None if os.access(found, os.W_OK | os.X_OK) else "Permission denied"
    if why is not None:
        raise ConfigError(key, value, f"cannot create or write it ({why}); {fix}")


def _run_dir_paths(job: JobConfig, run_dir: Path) -> list[tuple[Path, str, str, str]]:
    """(path, key, value, fix) of every directory a run writes into."""
    paths = [(path, run_dir_key(job, run_dir), str(run_dir), "choose a writable directory")
             for path in (run_dir, run_dir / "logs")]
    if job.checkpoint.dir:  # else RUN_DIR/checkpoints: writable with the run dir
        paths.append((Path(job.checkpoint.dir), "checkpoint.dir", job.checkpoint.dir,
                      "the run would train, then lose every checkpoint: choose a writable directory"))
    return paths


def check_run_dir_writable(job: JobConfig, run_dir: Path) -> None:
    """ConfigError where `prepare_run_dir` would fail to create or write a directory; creates nothing."""
    for args in _run_dir_paths(job, run_dir):
        _check_writable(*args)


def prepare_run_dir(job: JobConfig, run_dir: Path) -> None:
    """Create the run dir and write the resolved job and model configs into it."""
    for args in _run_dir_paths(job, run_dir):
        _make_writable(*args)
    resolved = to_dict(job)
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    hf = load_hf_config(job.model.preset, job.model.config_path, job.model.path)
    (run_dir / "model_config.json").write_text(json.dumps(hf, indent=2))
    for stale in ("final.json", ".phase.json", ".ranks.json", ".failure.txt"):  # kept: metrics, checkpoints
        (run_dir / stale).unlink(missing_ok=True)
    if run_id(run_dir) is None:
        (run_dir / RUN_ID_FILE).write_text(uuid.uuid4().hex + "\n")


def check_resume(job: JobConfig, run_dir: Path, resume: str) -> None:
    """Refuse impossible resume requests and run dirs before anything starts or is written (the
    controller checks the checkpoint again): a run dir holding something else than an hpcrl run, a
    checkpoint dir another run is writing into, checkpoints of another run (hpcrl/checkpoint_owner.py),
    of another model or without (or with) the critic this job trains."""
    from checkpoints import list_checkpoints

    check_run_dir(run_dir, run_dir_key(job, run_dir))
    ckpt_dir = checkpoint_dir(job, run_dir)
    if job.checkpoint.dir:  # RUN_DIR/checkpoints: the run dir's lock says it (lock_run_dir)
        check_not_in_use(job, ckpt_dir)
    existing = list_checkpoints(ckpt_dir) if ckpt_dir.exists() else []
    if resume == "none" and existing:
        raise ConfigError("--no-resume", True, f"{ckpt_dir} holds checkpoints (steps {existing}) that a fresh "
                          "run would overwrite; use another --run-dir or checkpoint.dir, or delete them")
    if resume not in ("auto", "none") and int(resume) not in existing:
        raise ConfigError("--resume-from", int(resume), f"no complete checkpoint at that step in {ckpt_dir}; "
                          f"available steps: {existing or 'none'}")
    if existing and resume != "none":
        step = existing[-1] if resume == "auto" else int(resume)
        _check_same_run(job, run_dir, ckpt_dir, step)
        if resume == "auto":
            check_own_checkpoint(job, run_dir, ckpt_dir, step, existing)
        if step >= job.algorithm.num_steps:
            flag = "" if resume == "auto" else f"--resume-from {step}: "
            raise ConfigError("algorithm.num_steps", job.algorithm.num_steps,
                              f"{flag}the checkpoint to resume from, step {step} in {ckpt_dir}, is past the run's "
                              f"last step ({job.algorithm.num_steps - 1}): the run would train nothing and label "
                              f"step {step}'s policy as {job.algorithm.num_steps} steps; raise algorithm.num_steps "
                              f"above {step + 1} to train on, --resume-from an earlier step (steps {existing}), or "
                              "use another --run-dir")


RUN_DIR_ENTRIES = frozenset({
    "config.json", "config.yaml", "model_config.json", "metrics.jsonl", "final.json", "logs", "checkpoints",
    "tensorboard", "engine_keys.yaml", "engine_model", "engine_python", "slurm.json", "job.sbatch",
    "local_job.json", "submitted_job.yaml", ".phase.json", ".ranks.json", ".failure.txt", ".export.json",
    ".hpcrl_world_formed", ".write-test", ".hpcrl_lock", "wandb", ".wandb.json", ".wandb.json.tmp", "rollouts",
    "profile", ".run_id", ".pending_eval.json", ".pending_eval.json.tmp"})
"""What a run writes into its run dir (hpcrl/runner.py, hpcrl/jobs.py, launch/)."""


def is_run_config(config: Any) -> bool:
    """Whether a run dir's parsed config.json is an hpcrl run's (it has the checkpoint section; a
    HuggingFace model directory's config.json has none)."""
    return isinstance(config, dict) and isinstance(config.get("checkpoint"), dict)


def check_run_dir(run_dir: Path, key: str = "--run-dir") -> None:
    """ConfigError for a run dir that holds something else than an hpcrl run: a config.json without
    hpcrl's checkpoint section (a HuggingFace model directory's, say), or entries a run never writes.
    The run would replace that config.json and fill the directory with run files."""
    if not run_dir.is_dir():
        return
    entries = sorted(p.name for p in run_dir.iterdir())
    try:
        ours = is_run_config(json.loads((run_dir / "config.json").read_text()))
    except FileNotFoundError:
        ours = all(name in RUN_DIR_ENTRIES for name in entries)
    except (OSError, ValueError, UnicodeDecodeError):
        ours = False
    if not ours:
        shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
        raise ConfigError(key, str(run_dir), f"holds {shown} but no hpcrl run (config.json with a "
                          "checkpoint section); a run writes config.json, logs/ and checkpoints/ there: give a "
                          "new or empty directory, or the run dir of the run to resume")


def _check_same_run(job: JobConfig, run_dir: Path, ckpt_dir: Path, step: int) -> None:
    """The checkpoint at `step` must be of this job's model (the HF config the checkpoint records, or,
    for checkpoints written before it did, the run dir's model_config.json where the checkpoints are
    the run dir's, against the job's HF config) and hold a critic exactly when the job trains one;
    otherwise the trainer would fail on its first missing tensor, or train on another model's weights."""
    from checkpoints import read_metadata
    from hpcrl.config import job_from_dict
    from hpcrl.config.schema import critic_enabled

    try:
        meta = read_metadata(ckpt_dir, step)
        stored = meta.get("config")
        before = job_from_dict(stored) if isinstance(stored, dict) else None
        recorded = meta.get("model_config")
    except Exception:  # noqa: BLE001 - an older or damaged checkpoint: the controller judges it
        before, recorded = None, None
    if before is not None and critic_enabled(before) != critic_enabled(job):
        has = "holds a critic" if critic_enabled(before) else "holds no critic"
        raise ConfigError("algorithm.name", job.algorithm.name,
                          f"the checkpoint of step {step} in {ckpt_dir} {has} (its job: algorithm.name="
                          f"{before.algorithm.name!r}, critic.enabled={before.critic.enabled}); resume with "
                          "that job's algorithm, or use another --run-dir / checkpoint.dir")
    old_model = run_dir / "model_config.json"
    if not isinstance(recorded, dict) and (job.checkpoint.dir or not old_model.is_file()):
        return
    try:
        old = recorded if isinstance(recorded, dict) else json.loads(old_model.read_text())
        new = load_hf_config(job.model.preset, job.model.config_path, job.model.path)
    except Exception:  # noqa: BLE001 - a model not there yet (a pipeline's export): nothing to compare
        return
    ignored = {"torch_dtype", "dtype", "transformers_version", "_name_or_path", "architectures", "auto_map"}
    differ = sorted((k for k in set(old) | set(new) if k not in ignored and old.get(k) != new.get(k)),
                    key=lambda k: (k != "model_type", k))
    if differ:
        shown = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differ[:4])
        key = next(f"model.{k}" for k in ("path", "config_path", "preset") if getattr(job.model, k))
        raise ConfigError(key, getattr(job.model, key.split(".")[1]),
                          f"the checkpoint to resume from (step {step} in {ckpt_dir}) is of another model "
                          f"({shown}{' ...' if len(differ) > 4 else ''}); resume with that run's model, or use "
                          "another --run-dir (and checkpoint.dir)")


def plan_cores(job: JobConfig, env: dict[str, str]) -> None:
    """resources.cpu_bind: put the core plan of the ranks into `env` (hpcrl.cpu_bind) and say it."""
    env.pop(cpu_bind.ENV, None)
    if job.resources.cpu_bind == "none" or job.resources.device != "cpu":
        return
    t, e = job.trainer.num_procs, job.rollout.num_engines
    make = cpu_bind.make_apart_plan if job.resources.cpu_bind == "apart" else cpu_bind.make_plan
    plan, why_not = make(sorted(os.sched_getaffinity(0)), t, e, job.resources.cpus_per_rank)
    if plan is None:
        print(f"cpu_bind: not bound: {why_not}", flush=True)
        return
    env[cpu_bind.ENV] = plan.to_env()
    print(f"cpu_bind: {plan.describe(t, e)}", flush=True)


def run_local(job_path: str, overrides: list[str], cli_run_dir: str | None, resume: str = "auto") -> int:
    """`hpcrl run`: resume is "auto" (latest checkpoint of the run dir), "none" or a step number."""
    job = load_job(job_path, overrides)
    if job.rollout.backend == "sglang" and job.rollout.nodes_per_engine > 1:  # placement.check_engine_hosts
        raise ConfigError("rollout.nodes_per_engine", job.rollout.nodes_per_engine,
                          "`hpcrl run` starts every rank on this host, and an SGLang engine's nodes need a "
                          "host each: run it with `hpcrl submit`, or set rollout.nodes_per_engine: 1")
    run_dir = resolve_run_dir(job, cli_run_dir)
    check_resume(job, run_dir, resume)
    lock = lock_run_dir(job, run_dir)
    try:
        return _run_locked(job, run_dir, resume, lock)
    finally:
        os.close(lock)


def _run_locked(job: JobConfig, run_dir: Path, resume: str, lock: int) -> int:
    from launch.local import run_world

    prepare_run_dir(job, run_dir)
    print(f"hpcrl run: {job.name}: {job.world_size} ranks (1 controller, {job.trainer.num_procs} trainer, "
          f"{rollout_ranks(job)} rollout), run dir {run_dir}", flush=True)
    env = dict(os.environ)
    # One compute thread per rank by default: ranks take turns on the cores, and idle OpenMP
    # threads spin-waiting would steal them from the rank that works (measured: 25x slower steps).
    env.setdefault("OMP_NUM_THREADS", str(job.resources.cpus_per_rank))
    env["HPCRL_RESUME"] = resume
    plan_cores(job, env)
    # -P: the working directory stays off sys.path (a `checkpoints/` or `moe/` folder there would
    # shadow hpcrl's packages).
    rc, first_death = run_world(job.world_size, [sys.executable, "-P", "-m", "hpcrl.worker_main", str(run_dir)],
                                run_dir, env=env, keep_fds=(lock,))
    if rc == 0 and (run_dir / "final.json").exists():
        return 0
    if rc == EXIT_INTERRUPTED:
        print(f"hpcrl run: interrupted; `hpcrl run JOB --run-dir {run_dir}` resumes from the latest checkpoint",
              file=sys.stderr, flush=True)
        return rc
    failure = run_dir / ".failure.txt"
    if failure.exists():
        print(f"\n{failure.read_text().rstrip()}\nLogs: {run_dir / 'logs'}", file=sys.stderr, flush=True)
        # the controller's code; mpiexec's is a killed rank's signal (9) when one was killed
        return rc if rc in (EXIT_REQUEUE, EXIT_BAD_INPUT) else EXIT_FAILURE
    if rc == EXIT_REQUEUE:
        return rc
    why = first_death or f"mpiexec exited with code {rc}"
    print(f"hpcrl run failed: {why}; the MPI world was stopped. Logs: {run_dir / 'logs'}",
          file=sys.stderr, flush=True)
    return rc if rc not in (0, None) else EXIT_FAILURE
