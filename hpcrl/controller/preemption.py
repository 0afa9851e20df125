"""Preemption awareness on the controller: the pre-kill signal and the job's end time.

Slurm announces preemption with `--signal=B:USR1@<grace>` (the batch script forwards it to the
controller), or only with SIGTERM at the start of the grace time; submitit's `Job._interrupt()` and
`SUBMITIT_PREEMPT_SIGNAL` default use SIGUSR2. `hpcrl run` forwards SIGUSR1, SIGUSR2 and SIGTERM it
receives to the controller. Each means "checkpoint now and exit for requeue". The job's end time
(Slurm's time limit) is read once, so the controller can save before it is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable
from datetime import datetime

from launch.result import REQUEUE_EXIT_CODE

EXIT_REQUEUE = REQUEUE_EXIT_CODE
"""Exit code of a run that saved a checkpoint on preemption (or before its time limit) and wants
to be requeued; the Slurm batch script turns it into `scontrol requeue` (one definition, in launch)."""


class Preempted(Exception):
    """Raised to end the loop after a preemption checkpoint; carries the last completed step."""

    def __init__(self, last_completed_step: int, reason: str) -> None:
        super().__init__(reason)
        self.last_completed_step = last_completed_step
        self.reason = reason


def slurm_end_time() -> float | None:
    """Epoch seconds at which Slurm will end this job, or None outside Slurm / unlimited."""
    if os.environ.get("HPCRL_JOB_END_TIME"):
        return float(os.environ["HPCRL_JOB_END_TIME"])
    job_id = os.environ.get("SLURM_JOB_ID")
    if not job_id:
        return None
    try:
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True,
                             timeout=10).stdout.split()
        # a heterogeneous job prints one line per component, all with the job's end time
        return datetime.fromisoformat(out[0]).timestamp()
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


_EARLY: list[tuple[float, str]] = []
"""(monotonic time, name) of the first preemption signal a rank got before its PreemptionWatch."""


def record_early_signals() -> None:
    """From the very start of a rank: USR1/USR2/TERM are recorded, not fatal (Python's default
    action for USR1 ends the process, and Slurm may preempt a job during the minutes its ranks
    import and form the MPI world; the job then failed instead of being requeued). The controller's
    PreemptionWatch takes a recorded signal as its own; worker ranks ignore them once the world formed.
    Under `hpcrl run`'s mpiexec, USR1 is Hydra's note that a rank died: ignored (_on_preemption_signals)."""
    def record(signum: int, _frame: object) -> None:
        if not _EARLY:
            _EARLY.append((time.monotonic(), signal.Signals(signum).name))

    _on_preemption_signals(record)


def _on_preemption_signals(handler: Callable[[int, object], None]) -> None:
    """`handler` for SIGTERM, SIGUSR2 (its default action would end the process) and SIGUSR1, except
    under `hpcrl run`'s mpiexec: MPICH's Hydra (local runs, -disable-auto-cleanup) tells survivors
    that a rank died with SIGUSR1, which is not a preemption (the controller's deadlines handle it);
    the local launcher forwards a user's USR1 to the controller as SIGTERM instead."""
    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGUSR2, handler)
    local = os.environ.get("HPCRL_LAUNCHER") == "mpiexec"
    signal.signal(signal.SIGUSR1, signal.SIG_IGN if local else handler)


class PreemptionWatch:
    """Records SIGUSR1/SIGUSR2/SIGTERM on this process and knows the grace budget and the end time."""

    def __init__(self, grace_s: float) -> None:
        # Under Slurm the signal comes signal_delay_s before the time limit, but a preemption's kill
        # follows after the partition's GraceTime, which checkpoint.grace_s states: the smaller
        delay = os.environ.get("HPCRL_SIGNAL_DELAY_S")
        self.grace_s = min(float(delay), float(grace_s)) if delay else float(grace_s)
        self.end_time = slurm_end_time()
        self.signal_time: float | None = None
        self.signal_name = ""
        if _EARLY:  # a signal before this watch existed (record_early_signals)
            self.signal_time, self.signal_name = _EARLY[0]
        _on_preemption_signals(self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if self.signal_time is None:
            self.signal_time = time.monotonic()
            self.signal_name = signal.Signals(signum).name

    @property
    def requested(self) -> bool:
        return self.signal_time is not None

    def seconds_left(self) -> float:
        """Until the expected kill: the grace budget after a signal, else the time limit."""
        left = float("inf")
        if self.signal_time is not None:
            left = self.grace_s - (time.monotonic() - self.signal_time)
        if self.end_time is not None:
            left = min(left, self.end_time - time.time())
        return left
