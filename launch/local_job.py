"""The local twin of `HetJobExecutor`: run `hpcrl run` in the background, handled as a submitit job.

`LocalRunExecutor(folder).submit_command(argv, run_dir)` starts `python -m launch.local_job RUN_DIR
FOLDER -- ARGV...` in a session of its own and returns a `LocalRunJob`. That supervisor runs ARGV
(normally `hpcrl run JOB --run-dir RUN_DIR`: mpiexec, one MPI world, launch/local.py) with its
output in submitit's `<id>_0_log.out`, forwards SIGINT/SIGTERM to it, and when it ends writes
`<id>_0_result.pkl` exactly as the Slurm batch script does (launch/result.py). So the handle has
the Slurm job's shape: `state` (RUNNING, COMPLETED, FAILED, CANCELLED), `done()`, `result()`
(the run summary, or FailedJobError naming the failed rank and phase), `cancel()`, `stdout()`,
`stderr()`, and `LocalRunJob(folder, job_id)` re-attaches from another process. The job id is
`local<pid>` of the supervisor. submitit's own LocalExecutor is not used: it runs `_submit` with its
USR2 requeue handler, kills its task with SIGKILL on cancel (which would orphan the mpiexec
session) and times jobs out after `timeout_min`.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from submitit.core import core
from submitit.core import utils as submitit_utils

from launch.export_step import export_final
from launch.procs import process_gone
from launch.result import result_path, write_result

CANCEL_TIMEOUT_S = 120.0


class LocalRunJob(core.Job[dict[str, Any]]):
    """A background `hpcrl run` (see the module docstring); `tasks` is always (0,)."""

    def _pid(self) -> int:
        return int(self.job_id.removeprefix("local"))

    def _running(self) -> bool:
        proc = getattr(self, "_process", None)
        if proc is not None:
            return proc.poll() is None
        return not process_gone(self._pid())

    def done(self, force_check: bool = False) -> bool:
        return self.paths.result_pickle.exists() or not self._running()

    @property
    def state(self) -> str:
        """RUNNING, then COMPLETED / FAILED from the result file, CANCELLED after `cancel()`, or
        UNKNOWN when the supervisor is gone without a result (killed)."""
        if self._running() and not self.paths.result_pickle.exists():
            return "RUNNING"
        if (self.paths.folder / f"{self.job_id}.cancelled").exists():
            return "CANCELLED"
        if not self.paths.result_pickle.exists():
            return "UNKNOWN"
        kind, _ = submitit_utils.pickle_load(self.paths.result_pickle)
        return "COMPLETED" if kind == "success" else "FAILED"

    def get_info(self, mode: str = "force") -> dict[str, str]:
        return {"State": self.state}

    @property
    def run_dir(self) -> Path:
        """The run dir: the parent of the job folder (RUN_DIR/logs)."""
        return self.paths.folder.parent

    def cancel(self, check: bool = True) -> None:
        """Interrupt the run (as Ctrl-C of `hpcrl run`: the world stops, no rank is left) and wait."""
        (self.paths.folder / f"{self.job_id}.cancelled").touch()
        try:
            os.kill(self._pid(), signal.SIGINT)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + CANCEL_TIMEOUT_S
        while self._running() and time.monotonic() < deadline:
            time.sleep(0.2)
        if check and self._running():
            raise RuntimeError(f"job {self.job_id} did not stop within {CANCEL_TIMEOUT_S:.0f} s of SIGINT")


class LocalRunExecutor:
    """Starts background runs whose job folder is `folder` (RUN_DIR/logs)."""

    job_class = LocalRunJob

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder).expanduser().absolute()

    def submit_command(self, argv: Sequence[str], run_dir: Path, export_dir: Path | None = None
                       ) -> LocalRunJob:
        """Start `argv` under the supervisor; its outcome is read from `run_dir`. With `export_dir`,
        a run that finished exports its final checkpoint there before the result is written, as the
        Slurm batch script's finish step does (launch/export_step.py; a failed export fails the job)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        export = [] if export_dir is None else ["--export-to", str(export_dir)]
        cmd = [sys.executable, "-P", "-m", "launch.local_job", str(run_dir), str(self.folder), *export, "--",
               *argv]
        proc = subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        job = LocalRunJob(self.folder, f"local{proc.pid}")
        job.paths.result_pickle.unlink(missing_ok=True)  # an earlier run's, under a reused pid
        job._process = proc  # type: ignore[attr-defined]
        return job


def _supervise(run_dir: Path, folder: Path, argv: list[str], export_dir: Path | None = None) -> int:
    job_id = f"local{os.getpid()}"
    result_path(folder, job_id).unlink(missing_ok=True)  # a pid reused from an earlier run
    paths = submitit_utils.JobPaths(folder, job_id=job_id, task_id=0)
    with paths.stdout.open("ab") as out, paths.stderr.open("ab") as err:
        child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err)

        def forward(signum: int, _frame: object) -> None:
            try:
                child.send_signal(signum)
            except ProcessLookupError:
                pass

        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, forward)
        rc = child.wait()
        if export_dir is not None:
            os.dup2(err.fileno(), 1)  # the export's report goes to stderr()'s file, as to the batch log
            rc = export_final(run_dir, export_dir, rc) or rc
    write_result(folder, job_id, run_dir, rc)
    return rc


def main(argv: list[str]) -> int:
    """`python -m launch.local_job RUN_DIR FOLDER [--export-to DIR] -- COMMAND...`"""
    export = None
    if len(argv) > 3 and argv[2] == "--export-to":
        export, argv = Path(argv[3]), argv[:2] + argv[4:]
    if len(argv) < 4 or argv[2] != "--":
        print("usage: python -m launch.local_job RUN_DIR FOLDER [--export-to DIR] -- COMMAND...",
              file=sys.stderr)
        return 2
    return _supervise(Path(argv[0]), Path(argv[1]), argv[3:], export)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
