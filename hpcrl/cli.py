"""The `hpcrl` command line: a thin dispatcher; each subcommand lives in the module that owns it.

User errors (bad config, bad paths) print one message and exit 2, without a traceback.
"""

from __future__ import annotations

import argparse
import sys

EXIT_USER_ERROR = 2


def _add_job_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="path to the job YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="A.B=VALUE",
                   help="override one config value (repeatable), e.g. --set algorithm.lr=3e-4")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hpcrl", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("validate", help="check a job file without running it")
    _add_job_args(p)
    p = sub.add_parser("run", help="run a job locally (mpiexec; CPU or local GPUs)")
    _add_job_args(p)
    p.add_argument("--run-dir", default=None, help="run directory (default: logging.run_dir or runs/<name>-<time>)")
    return parser


def _validate(args: argparse.Namespace) -> int:
    from hpcrl.config import load_job

    job = load_job(args.job, args.overrides)
    print(f"{args.job}: OK ({job.world_size} ranks: 1 controller, {job.trainer.num_procs} trainer, "
          f"{job.rollout.num_engines} rollout)")
    return 0


def _run(args: argparse.Namespace) -> int:
    from hpcrl.runner import run_local

    return run_local(args.job, args.overrides, args.run_dir)


COMMANDS = {"validate": _validate, "run": _run}


def main(argv: list[str] | None = None) -> int:
    from hpcrl.config.errors import ConfigError

    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except ConfigError as exc:
        print(f"hpcrl {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
