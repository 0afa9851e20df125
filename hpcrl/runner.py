"""`hpcrl run`: validate the job, prepare the run dir, start the local MPI world, report.

The run dir holds: config.yaml/config.json (resolved job), model_config.json (the HF config of the
policy), metrics.jsonl, tensorboard/, logs/ (one file per worker rank and engine), final.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import yaml

from hpcrl import cpu_bind
from hpcrl.config import load_job, to_dict
from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import JobConfig
from hpcrl.models.presets import load_hf_config
from launch.result import REQUEUE_EXIT_CODE as EXIT_REQUEUE  # the controller's "requeue me"

EXIT_FAILURE = 1


def resolve_run_dir(job: JobConfig, cli_run_dir: str | None) -> Path:
    if cli_run_dir:
        return Path(cli_run_dir).resolve()
    if job.logging.run_dir:
        return (Path(job.base_dir) / job.logging.run_dir).resolve()
    return (Path("runs") / f"{job.name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()


def prepare_run_dir(job: JobConfig, run_dir: Path) -> None:
    """Create the run dir and write the resolved job and model configs into it."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "logs").mkdir(exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as exc:
        raise ConfigError("--run-dir", str(run_dir), f"cannot create or write it ({exc.strerror}); "
                          "choose a writable directory") from None
    resolved = to_dict(job)
    (run_dir / "config.json").write_text(json.dumps(resolved, indent=2))
    (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    hf = load_hf_config(job.model.preset, job.model.config_path, job.model.path)
    (run_dir / "model_config.json").write_text(json.dumps(hf, indent=2))
    for stale in ("final.json", ".phase.json", ".ranks.json", ".failure.txt"):  # kept: metrics, checkpoints
        (run_dir / stale).unlink(missing_ok=True)


def check_resume(job: JobConfig, run_dir: Path, resume: str) -> None:
    """Refuse impossible resume requests before anything starts (the controller checks again)."""
    from checkpoints import list_checkpoints

    ckpt_dir = Path(job.checkpoint.dir) if job.checkpoint.dir else run_dir / "checkpoints"
    existing = list_checkpoints(ckpt_dir) if ckpt_dir.exists() else []
    if resume == "none" and existing:
        raise ConfigError("--no-resume", True, f"{ckpt_dir} holds checkpoints (steps {existing}) that a fresh "
                          "run would overwrite; use another --run-dir or checkpoint.dir, or delete them")
    if resume not in ("auto", "none") and int(resume) not in existing:
        raise ConfigError("--resume-from", int(resume), f"no complete checkpoint at that step in {ckpt_dir}; "
                          f"available steps: {existing or 'none'}")


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
    from launch.local import run_world

    job = load_job(job_path, overrides)
    run_dir = resolve_run_dir(job, cli_run_dir)
    check_resume(job, run_dir, resume)
    prepare_run_dir(job, run_dir)
    print(f"hpcrl run: {job.name}: {job.world_size} ranks (1 controller, {job.trainer.num_procs} trainer, "
          f"{job.rollout.num_engines} rollout), run dir {run_dir}", flush=True)
    env = dict(os.environ)
    # One compute thread per rank by default: ranks take turns on the cores, and idle OpenMP
    # threads spin-waiting would steal them from the rank that works (measured: 25x slower steps).
    env.setdefault("OMP_NUM_THREADS", str(job.resources.cpus_per_rank))
    env["HPCRL_RESUME"] = resume
    plan_cores(job, env)
    # -P: the working directory stays off sys.path (a `checkpoints/` or `moe/` folder there would
    # shadow hpcrl's packages).
    rc, first_death = run_world(job.world_size, [sys.executable, "-P", "-m", "hpcrl.worker_main", str(run_dir)],
                                run_dir, env=env)
    if rc == 0 and (run_dir / "final.json").exists():
        return 0
    failure = run_dir / ".failure.txt"
    if failure.exists():
        print(f"\n{failure.read_text().rstrip()}\nLogs: {run_dir / 'logs'}", file=sys.stderr, flush=True)
        return EXIT_REQUEUE if rc == EXIT_REQUEUE else (rc or EXIT_FAILURE)
    if rc == EXIT_REQUEUE:
        return rc
    why = first_death or f"mpiexec exited with code {rc}"
    print(f"hpcrl run failed: {why}; the MPI world was stopped. Logs: {run_dir / 'logs'}",
          file=sys.stderr, flush=True)
    return rc if rc not in (0, None) else EXIT_FAILURE
