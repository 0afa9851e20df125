"""Rank 0: build the session, run the loop, report failures and stop the world cleanly."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import NoReturn

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import JobConfig
from hpcrl.controller.api import AlgorithmError
from hpcrl.controller.checkpointing import ResumeError
from hpcrl.controller.comm import RankFailure, World
from hpcrl.controller.preemption import EXIT_REQUEUE, Preempted
from hpcrl.controller.sync_check import WeightSyncError
from hpcrl.controller.wandb_log import WandbError
from hpcrl.rewards.pool import RewardFailing
from hpcrl.rollout.shard_requests import ShardPushError
from hpcrl.tasks.files import DataError

EXIT_FAILURE = 1
EXIT_BAD_INPUT = 2  # as `hpcrl validate` on bad input
ABORT_WANDB_WAIT_S = 30.0
"""How long a run that stops early (an error, a preemption: Slurm's kill follows its grace time)
waits for W&B to write and upload what it has."""


def _report(run_dir: Path, message: str) -> None:
    """Leave the failure in RUN_DIR/.failure.txt. Under `hpcrl run` the launcher prints it: output
    forwarded by Hydra can be lost when MPI_Abort follows at once. Elsewhere (Slurm) print it."""
    from hpcrl.rollout.engine_watch import dead_engines_first

    message = dead_engines_first(run_dir, message)  # an engine that died is the cause: named first
    (run_dir / ".failure.txt").write_text(message + "\n")
    if os.environ.get("HPCRL_LAUNCHER") != "mpiexec":
        print(f"\n{message}", file=sys.stderr, flush=True)


def _kept(session) -> str:
    saved = None if session is None else session.checkpointer.saved_step
    return f"the latest checkpoint (step {saved}) is kept" if saved is not None and saved >= 0 else \
        "no checkpoint was saved yet"


def _save_before_stop(session) -> None:
    """Save the last completed step, as a preemption does (checkpoint.interval_steps 0 saves only at
    the end: a long run stopped by bad input lost every step); what fails here leaves the latest
    checkpoint as it was."""
    ckpt = session.checkpointer
    try:
        ckpt.save_after_abandon(Preempted(ckpt.completed_step, "stopped"))
    except Exception as exc:  # the stop's own report follows
        print(f"hpcrl: saving step {ckpt.completed_step} before stopping failed: {exc}", file=sys.stderr)


def _in_step(session) -> str:
    """Where the controller was: the step in progress, or start-up."""
    return "at start-up" if session is None or session.metrics is None else \
        f"in step {session.checkpointer.completed_step + 1}"


def _abort(world: World, code: int, session=None) -> NoReturn:
    """Stop every rank. MPI_Abort can return before the process manager kills this process: then
    exit at once (MPI_Finalize after an abort fails on unread messages and prints a traceback).
    The metrics logs are closed first: W&B's service writes the run's records behind the controller,
    and the abort kills it with the ranks (an aborted run's W&B run had none of its steps)."""
    if session is not None and session.metrics is not None:
        try:
            session.metrics.close(wandb_wait_s=ABORT_WANDB_WAIT_S, exit_code=code)
        except Exception as exc:  # the abort goes on: its report is written
            print(f"hpcrl: closing the metrics logs failed: {exc!r}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    world.comm.Abort(code)
    os._exit(code)


def controller_main(job: JobConfig, run_dir: Path, world: World) -> int:
    from hpcrl.controller import loop
    from hpcrl.controller.session import Session

    session = None
    try:
        session = Session(job, run_dir, world)
        session.start()
        loop.run(session)
        digest = session.finish()
    except Preempted as exc:
        assert session is not None
        session.checkpointer.save_after_abandon(exc)
        session.stop_workers(exit_code=EXIT_REQUEUE, wandb_wait_s=ABORT_WANDB_WAIT_S)  # within the grace time
        saved = session.checkpointer.saved_step
        print(f"\nhpcrl: preempted ({exc.reason}); checkpoint of step {saved} saved in "
              f"{session.checkpointer.dir}; exiting with {EXIT_REQUEUE} (requeue me). `hpcrl run JOB "
              f"--run-dir {run_dir}` resumes from it (a Slurm requeue does by itself).", file=sys.stderr,
              flush=True)
        return EXIT_REQUEUE
    except RankFailure as exc:
        if session is not None and session.checkpointer.watch.requested:
            # Preemption also hit a worker (e.g. SIGTERM to every process of a Slurm step): save the
            # last completed step if the trainers can still do it, and ask for a requeue.
            try:
                ckpt = session.checkpointer
                ckpt.save_after_abandon(Preempted(ckpt.completed_step, "worker failed"))
            except RankFailure:
                pass
            _report(run_dir, f"hpcrl run preempted and a rank failed meanwhile: {exc}")
            _abort(world, EXIT_REQUEUE, session)
        _report(run_dir, f"hpcrl run failed: {exc}")
        _abort(world, EXIT_FAILURE, session)
    except (WeightSyncError, ShardPushError, ResumeError, WandbError) as exc:
        _report(run_dir, f"hpcrl run failed: {exc}")
        _abort(world, EXIT_FAILURE, session)
    except ConfigError as exc:  # the checkpoint dir is another run's (hpcrl/checkpoint_owner.py)
        _report(run_dir, f"hpcrl run stopped: {exc}")
        _abort(world, EXIT_BAD_INPUT, session)
    except DataError as exc:  # a row validation did not sample: bad input, not a fault
        _report(run_dir, f"hpcrl run stopped on bad data: {exc}\n{_kept(session)}; fix the file, then "
                         f"`hpcrl run JOB --run-dir {run_dir}` resumes")
        _abort(world, EXIT_BAD_INPUT, session)
    except RewardFailing as exc:  # the reward is broken: bad input, not a fault
        _save_before_stop(session)
        _report(run_dir, f"hpcrl run stopped: {exc}\n{_kept(session)}; once the reward is fixed, "
                         f"`hpcrl run JOB --run-dir {run_dir}` resumes")
        _abort(world, EXIT_BAD_INPUT, session)
    except AlgorithmError as exc:  # the algorithm's code called the API wrongly: bad input, not a fault
        _report(run_dir, f"hpcrl run stopped: algorithm.name={job.algorithm.name!r}, {_in_step(session)}: {exc}"
                         f"\n{_kept(session)}; fix the algorithm, then `hpcrl run JOB --run-dir {run_dir}` resumes")
        _abort(world, EXIT_BAD_INPUT, session)
    except BaseException as exc:  # the controller itself failed: say where, then stop every rank
        import traceback

        traceback.print_exc()
        _report(run_dir, f"hpcrl run failed on the controller (rank 0), {_in_step(session)} of algorithm.name="
                         f"{job.algorithm.name!r}: {exc!r}")
        _abort(world, EXIT_FAILURE, session)
    print(f"policy sha256: {digest}", flush=True)
    print(f"run dir: {run_dir}", flush=True)
    return 0
