"""Entry point of every rank of an hpcrl MPI world: `python -m hpcrl.worker_main RUN_DIR`.

Rank 0 runs the controller loop; trainer and rollout ranks serve the controller's commands. Worker
ranks write their output to RUN_DIR/logs/rank<r>-<role>.log. Any failure ends the whole world:
a worker reports its traceback to the controller, which names rank, role, host and phase, then
aborts every rank (MPI_Abort) so nothing is left behind.

Fault injection for tests: HPCRL_FAULT="<rank>:<op>:<exit|crash|hang>" (hpcrl/faults.py).
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hpcrl import cpu_bind

EXIT_FAILURE = 1


def _redirect_output(run_dir: Path, rank: int, role: str) -> None:
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(log_dir / f"rank{rank}-{role}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def join_world_within(num_trainer: int, deadline_s: float):
    """`join_world` (MPI_Init, role split, rank table), ending this process with a traceback if it
    has not completed within `deadline_s`.

    MPI_Init has no timeout of its own: a rank whose peer died during it waits forever, and so
    does its Slurm job (seen once under CI: a garbled PMI2 exchange aborted one rank in MPI_Init,
    and its peers sat in MPI_Init until the test cancelled the job). faulthandler's watchdog is a
    C thread that needs no GIL, so it fires while this thread is blocked inside MPI_Init.
    """
    faulthandler.dump_traceback_later(deadline_s, exit=True)
    from hpcrl.controller.comm import join_world

    world = join_world(num_trainer)
    faulthandler.cancel_dump_traceback_later()
    return world


def serve(world, handlers: dict[str, Callable[[Any], Any]], idle_timeout_s: float,
          cores: tuple[int, ...] | None = None, trace=None) -> None:
    """Answer commands until 'shutdown'. A handler error is reported to the controller, which
    aborts the world; this rank then waits to be killed (the error is the controller's to tell).
    `cores` (resources.cpu_bind): this rank binds to them once 'init' has run, so that start-up
    (model build, engine launch) keeps every core. `trace` (hpcrl.profiling.StepTrace,
    logging.profile_steps) sees each command's step before it runs, and ends before 'shutdown'."""
    from hpcrl import faults
    from hpcrl.controller.comm import WorkerChannel

    chan = WorkerChannel(world)
    while True:
        cmd = chan.next_command(idle_timeout_s)
        try:
            if trace is not None:
                trace.close() if cmd.op == "shutdown" else trace.at(cmd.step)
            faults.inject(faults.planned(world.rank, cmd.op), cmd.op)
            with trace.span(cmd.op) if trace is not None else contextlib.nullcontext():
                result = handlers[cmd.op](cmd)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the controller
            from checkpoints.errors import CheckpointError
            from hpcrl.rollout.engine_watch import EngineDied

            # each names what failed (a file and step; an engine, its rank and log): the traceback
            # stays in the log
            brief = isinstance(exc, (CheckpointError, EngineDied))
            if brief:
                traceback.print_exc()
            chan.reply_error(cmd, exc, brief=brief)
            time.sleep(idle_timeout_s)
            os._exit(EXIT_FAILURE)
        if cmd.op == "init" and cores is not None:
            cpu_bind.bind_process(cores)
        chan.reply(cmd, result)
        if cmd.op == "shutdown":
            return


def main(argv: list[str] | None = None) -> int:
    from hpcrl.controller.preemption import record_early_signals

    record_early_signals()  # before the imports and MPI_Init, which take minutes at scale
    argv = sys.argv[1:] if argv is None else argv
    run_dir = Path(argv[0])
    from hpcrl.config import job_from_dict
    import json

    job = job_from_dict(json.loads((run_dir / "config.json").read_text()), base_dir=str(run_dir))
    from hpcrl.rollout.engine_auth import job_keys, set_process_keys

    set_process_keys(job_keys(run_dir))  # this rank's engine clients send the job's engine keys
    world = join_world_within(job.trainer.num_procs, job.resources.startup_timeout_s)
    from hpcrl.rollout.placement import set_shared_gpu_host

    set_shared_gpu_host(job, f"rank{world.rank}")  # NCCL refuses two ranks of a group on one GPU
    plan = cpu_bind.CpuPlan.from_env()  # set by `hpcrl run` (resources.cpu_bind)
    cores = None if plan is None else plan.for_rank(world.rank, job.trainer.num_procs)
    if cores is not None and world.role == "controller":  # worker ranks bind after their init (serve)
        cpu_bind.bind_process(cores)
    if world.rank == 0:  # the Slurm batch script retries a step that never got here (launch/slurm_spec.py)
        from launch.slurm_spec import WORLD_FORMED_FILE

        (run_dir / WORLD_FORMED_FILE).touch()
    if world.role != "controller":
        _redirect_output(run_dir, world.rank, world.role)
        # Preemption signals (USR1, TERM; USR2 from submitit's own _interrupt) may reach every rank;
        # only the controller acts on them (it saves, then stops the workers). Workers stay alive
        # until told to stop.
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)
    # A worker waits for its next command at most this long (a whole step of the other roles).
    idle_timeout_s = 4 * job.resources.timeout_s + job.resources.startup_timeout_s
    if world.role == "controller":
        from hpcrl.controller.main import controller_main

        code = controller_main(job, run_dir, world)
    elif world.role == "trainer":
        from hpcrl.trainer.worker import trainer_handlers

        from hpcrl.profiling import StepTrace

        trace = StepTrace(job.logging.profile_steps, run_dir, world.rank, job.resources.device == "cuda") \
            if job.logging.profile_steps else None
        serve(world, trainer_handlers(job, run_dir, world), idle_timeout_s, cores, trace)
        code = 0
    else:
        from hpcrl.rollout.worker import rollout_handlers

        serve(world, rollout_handlers(job, run_dir, world, plan), idle_timeout_s, cores)
        code = 0
    if world.role != "controller":
        print(cpu_bind.report_line(f"rank {world.rank} ({world.role})"), flush=True)
    finalize_and_exit(code)
    return code


def finalize_and_exit(code: int) -> None:
    """End this rank: MPI_Finalize, then exit without running interpreter teardown. Destructors of
    torch.distributed/gloo and Megatron state at interpreter exit crash intermittently (SIGSEGV,
    seen as exit code 11 after a completed run); everything that matters is written by now."""
    from mpi4py import MPI

    sys.stdout.flush()
    sys.stderr.flush()
    MPI.Finalize()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
