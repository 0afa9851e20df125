"""The `hpcrl` command line: a thin dispatcher; each subcommand lives in the module that owns it.

User errors (bad config, bad paths) print one message and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

EXIT_USER_ERROR = 2


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="path to the job YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config value (repeatable), e.g. --set algorithm.lr=3e-4")


def _add_run_dir_and_resume(p: argparse.ArgumentParser) -> None:
    """--run-dir and the resume choice, shared by `run` and `submit`."""
    p.add_argument("--run-dir", default=None, help="run directory (default: logging.run_dir or runs/<name>-<time>)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-resume", action="store_true",
                   help="start from step 0 even if the run dir has checkpoints (refused if it would overwrite them)")
    g.add_argument("--resume-from", type=int, default=None, metavar="STEP",
                   help="resume from the checkpoint of STEP (newer checkpoints are discarded)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a job file without running it")
    _add_job_args(p)
    p = sub.add_parser("run", help="run a job locally (mpiexec; CPU or local GPUs)")
    _add_job_args(p)
    _add_run_dir_and_resume(p)
    p = sub.add_parser("render", help="print the sbatch script that `hpcrl submit` would send")
    _add_job_args(p)
    p.add_argument("--run-dir", default=None, help="run directory the script is rendered for (as for submit)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-resume", action="store_true", help="as for submit")
    g.add_argument("--resume-from", type=int, default=None, metavar="STEP", help="as for submit")
    p = sub.add_parser("submit", help="check the job against the Slurm cluster and sbatch it")
    _add_job_args(p)
    _add_run_dir_and_resume(p)
    p.add_argument("--sweep", action="append", default=[], metavar="A.B=V1,V2",
                   help="submit one job per value (repeatable: every combination), each in "
                        "RUN_DIR/<key>=<value>; all are checked before any is submitted")
    p.add_argument("--dry-run", action="store_true",
                   help="check everything submit checks and ask Slurm when and where the job would start "
                        "(sbatch --test-only); submits nothing and writes no run dir")
    for name, what in (("status", "Slurm state, attempt, time left, step and reward of a submitted run"),
                       ("logs", "the step log of a submitted run's current attempt"),
                       ("cancel", "cancel a submitted run's Slurm job")):
        p = sub.add_parser(name, help=what)
        p.add_argument("run", metavar="RUN", help="run directory printed by hpcrl submit (or its job id)")
    p = sub.choices["logs"]
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends (Ctrl-C stops)")
    p.add_argument("--attempt", type=int, default=None, help="attempt N's log instead of the latest")
    p.add_argument("--all", dest="every", action="store_true", help="the logs of every attempt, oldest first")
    p.add_argument("--batch", action="store_true", help="the batch script's log (signals, requeues, exit codes)")
    p = sub.add_parser("plan", help="full-scale weight-sync plan: memory per GPU, bytes per rank, time vs "
                                    "line rate and the broadcast baseline (no processes, no GPU)")
    _add_job_args(p)
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p = sub.add_parser("export", help="write a checkpoint's policy as HuggingFace safetensors + config.json")
    p.add_argument("run_dir", help="the run directory")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file, e.g. 5GB (10^9 bytes) or 500MiB (2^20); "
                        "default 5GB as in transformers")
    return parser


def _export(args: argparse.Namespace) -> int:
    from hpcrl.export import export_checkpoint

    out = export_checkpoint(args.run_dir, args.step, args.out, args.max_shard_size)
    print(f"exported to {out} ({', '.join(sorted(p.name for p in out.iterdir()))})")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from hpcrl.plan_cmd import run_plan

    return run_plan(args.job, args.overrides, args.json)


def _validate(args: argparse.Namespace) -> int:
    from hpcrl.config import load_job
    from hpcrl.config.schema import rollout_ranks

    job = load_job(args.job, args.overrides)
    print(f"{args.job}: OK ({job.world_size} ranks: 1 controller, {job.trainer.num_procs} trainer, "
          f"{rollout_ranks(job)} rollout)")
    return 0


def _run(args: argparse.Namespace) -> int:
    from hpcrl.runner import run_local

    resume = "none" if args.no_resume else ("auto" if args.resume_from is None else str(args.resume_from))
    return run_local(args.job, args.overrides, args.run_dir, resume)


@contextlib.contextmanager
def _slurm_errors():
    """Slurm problems are user errors too: the same one-line message and exit code as ConfigError."""
    from hpcrl.config.errors import ConfigError
    from launch.slurm_query import SlurmError

    try:
        yield
    except SlurmError as exc:
        raise ConfigError(exc.path, exc.value, exc.hint) from None


def _render(args: argparse.Namespace) -> int:
    from hpcrl.config import load_job
    from hpcrl.runner import resolve_run_dir
    from launch.slurm_submit import plan_submission

    job = load_job(args.job, args.overrides)
    run_dir = resolve_run_dir(job, args.run_dir)
    with _slurm_errors():
        plan = plan_submission(job, run_dir, check=False, resume=_resume_mode(args))
    for warning in plan.warnings:
        print(f"hpcrl render: warning: {warning}", file=sys.stderr)
    if not args.run_dir and not job.logging.run_dir:
        print(f"hpcrl render: rendered for run dir {run_dir}; pass the same --run-dir to submit to get this "
              "exact script", file=sys.stderr)
    sys.stdout.write(plan.script)
    return 0


def _submit(args: argparse.Namespace) -> int:
    from hpcrl.config import load_job
    from hpcrl.jobs import plan_slurm, start_slurm
    from hpcrl.runner import resolve_run_dir

    if args.sweep:
        return _submit_sweep(args)
    job = load_job(args.job, args.overrides)
    run_dir = resolve_run_dir(job, args.run_dir)
    plan = plan_slurm(job, run_dir, _resume_mode(args))
    if args.dry_run:
        _print_dry_run(job.name, plan)
        return 0
    _, record = start_slurm(job, plan)  # through launch.slurm_executor.HetJobExecutor (submitit)
    _print_submitted(job.name, record, run_dir)
    return 0


def _layout(record: dict) -> str:
    return f"{record['world_size']} ranks; " + " | ".join(f"component {i}: {_nodes(c['nodes'])}, {c['ranks']}"
                                                          for i, c in enumerate(record["components"]))


def _print_dry_run(name: str, plan: object) -> None:
    """`submit --dry-run`: the plan's warnings, layout and Slurm's verdict (sbatch --test-only)."""
    from launch.slurm_submit import layout, test_submission

    for warning in plan.warnings:
        print(f"hpcrl submit: warning: {warning}", file=sys.stderr)
    with _slurm_errors():
        verdict = test_submission(plan)
    print(f"dry run: {name} ({_layout(layout(plan))}) to partition {plan.spec.partition}\n"
          f"  sbatch --test-only: {verdict}\n"
          f"  run dir: {plan.run_dir} (nothing submitted or written; `hpcrl render` prints the script)", flush=True)


def _print_submitted(name: str, record: dict, run_dir: object, hints: bool = True) -> None:
    print(f"submitted job {record['job_id']} ({name}: {_layout(record)}) to partition {record['partition']}\n"
          f"run dir: {run_dir}", flush=True)
    if hints:
        print(f"  hpcrl status {run_dir}\n"
              f"  hpcrl logs {run_dir} -f\n"
              f"  hpcrl cancel {run_dir}", flush=True)


def _submit_sweep(args: argparse.Namespace) -> int:
    """--sweep: one job per point, in RUN_DIR/<point> (RUN_DIR as for one job), through
    Executor.submit_batch: every job is checked before the first is submitted."""
    import json

    from hpcrl.config import load_job
    from hpcrl.jobs import Executor, Submission, sweep_dir_name, sweep_points
    from hpcrl.runner import resolve_run_dir

    points = sweep_points(args.sweep)
    first = load_job(args.job, [*args.overrides, *points[0]])  # its name and run dir; the batch checks all
    sweep_dir = resolve_run_dir(first, args.run_dir)
    batch = [Submission(args.job, [*args.overrides, *point], sweep_dir / sweep_dir_name(point),
                        _resume_mode(args)) for point in points]
    if args.dry_run:
        for point, plan in zip(points, Executor(kind="slurm").plan_batch(batch), strict=True):
            _print_dry_run(f"{first.name} {' '.join(point)}", plan)
        return 0
    jobs = Executor(kind="slurm").submit_batch(batch)
    for point, job in zip(points, jobs):
        record = json.loads((job.run_dir / "slurm.json").read_text())
        _print_submitted(f"{first.name} {' '.join(point)}", record, job.run_dir, hints=False)
    print(f"sweep: {len(jobs)} jobs under {sweep_dir}; hpcrl status / logs / cancel take each run dir",
          flush=True)
    return 0


def _resume_mode(args: argparse.Namespace) -> str:
    """--no-resume / --resume-from STEP as the controller's HPCRL_RESUME value."""
    return "none" if args.no_resume else ("auto" if args.resume_from is None else str(args.resume_from))


def _nodes(n: int) -> str:
    return f"{n} node" if n == 1 else f"{n} nodes"


def _status(args: argparse.Namespace) -> int:
    from launch.slurm_runs import resolve_job, status_text

    with _slurm_errors():
        print(status_text(resolve_job(args.run)), flush=True)
    return 0


def _logs(args: argparse.Namespace) -> int:
    from launch.slurm_query import write_logs
    from launch.slurm_runs import follow_logs, resolve_job

    with _slurm_errors():
        job = resolve_job(args.run)
        if not args.follow:
            write_logs(job.run_dir, job.log_record, sys.stdout, attempt=args.attempt, every=args.every,
                       batch=args.batch)
            return 0
        try:
            state = follow_logs(job, sys.stdout, attempt=args.attempt)
        except KeyboardInterrupt:
            print(file=sys.stderr)
            return 130
    ended = state.state if state is not None else "no longer known to Slurm"
    print(f"hpcrl logs: job {job.job_id} ended: {ended}", file=sys.stderr, flush=True)
    return 0


def _cancel(args: argparse.Namespace) -> int:
    from launch.slurm_runs import cancel_run, resolve_job

    with _slurm_errors():
        print(cancel_run(resolve_job(args.run)), flush=True)
    return 0


COMMANDS = {"validate": _validate, "run": _run, "export": _export, "render": _render, "submit": _submit,
            "status": _status, "logs": _logs, "cancel": _cancel, "plan": _plan}


def main(argv: list[str] | None = None) -> int:
    from hpcrl.config.errors import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"hpcrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # Ctrl-C outside a world (`hpcrl run` forwards it to one)
        from launch.result import EXIT_INTERRUPTED

        print(f"hpcrl {args.command}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
