"""submitit's Slurm executor and job, extended to hpcrl's heterogeneous job.

`HetJobExecutor` is a `submitit.SlurmExecutor` whose submission file is hpcrl's rendered sbatch
script (`SubmitPlan.script`, byte for byte what `hpcrl render` prints): submitit still pickles the
submission, runs sbatch, parses the job id, fills the job folder (`<id>_submission.sh`,
`<id>_submitted.pkl`) and returns the `Job`. The job folder is the run's log dir (RUN_DIR/logs).
What differs from a plain submitit job, and why:

* The step runs `hpcrl.worker_main` on every rank (one MPI world over both components), not
  submitit's per-task `_submit`, so submitit's USR2 checkpoint/requeue handler is never installed:
  preemption has one path, hpcrl's (batch script forwards USR1/TERM, and USR2 as USR1 -> controller
  saves -> step exits `REQUEUE_EXIT_CODE` -> `scontrol requeue`). `HetJob._interrupt()` sends USR1
  to the batch script, as Slurm does. The pickled callable (`launch.result.RunOutcome`) only reads
  the run dir's outcome; it documents the run and is never run by the job.
* The batch script writes task 0's `<id>_0_result.pkl` on every way out it sees (launch/result.py)
  and links `<id>_0_log.out` to the current attempt's step log, so a plain
  `submitit.SlurmJob(folder, job_id)` from any process gets `result()` and `stdout()`.
* `HetJob.watcher` reads state from `scontrol`/`squeue`, then `sacct` (launch.slurm_query.job_state):
  right on clusters without accounting, and it reports requeues (`HetJob.restarts`). A job Slurm
  reports ended without a result makes `result()` raise, naming its state.
* Hetjobs cannot be Slurm arrays: a batch of plans is submitted as separate jobs, and a job can wait
  for others (`after=[job, ...]`, sbatch `--dependency=afterok:...`, given on sbatch's command
  line so the script stays what `hpcrl render` prints).
"""

from __future__ import annotations

import contextlib
import io
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from submitit.core import utils as submitit_utils
from submitit.slurm.slurm import SlurmExecutor, SlurmInfoWatcher, SlurmJob

from launch.result import RunOutcome, write_result
from launch.slurm_query import JobState, SlurmError, cancel_job, is_final, job_state, require_tool, slurm_cmd

SBATCH_TIMEOUT_S = 60
GONE = "GONE"  # the watcher's state of a job neither Slurm nor accounting knows (any more)


class ScontrolWatcher(SlurmInfoWatcher):
    """submitit's shared state watcher, fed by `scontrol show job` (then sacct) instead of sacct only.

    Per job it records `State`, `Restarts`, `Reason`, `ExitCode`, `Requeue` and `NodeList`
    (component node lists joined by ','). A job is done when its state is final
    (`launch.slurm_query.is_final`: PREEMPTED is not, for a job Slurm requeues). A job Slurm no longer
    knows keeps its last recorded info; with none (a new process asking after MinJobAge, no
    accounting) its state is GONE, which counts as done, so `result()` raises instead of waiting
    forever for a job that ended without a result.
    """

    def _make_command(self) -> list[str] | None:
        return None  # update() asks scontrol per job instead of one sacct call

    def update(self) -> None:
        to_check = self._registered - self._finished
        self._num_calls += 1
        for job_id in to_check:
            try:
                state = job_state(job_id)
            except SlurmError:
                continue  # the controller did not answer: keep the last info, ask again later
            if state is None:
                self._info_dict.setdefault(job_id, {"State": GONE, "Reason": "no longer known to Slurm"})
            else:
                self._info_dict[job_id] = {
                    "State": state.state, "Restarts": str(state.restarts), "Reason": state.reason,
                    "ExitCode": state.exit_code, "Requeue": "1" if state.requeue else "0",
                    "NodeList": ",".join(n for _, n in state.components)}
        self._last_status_check = time.time()
        for job_id in to_check:
            if self.is_done(job_id, mode="cache"):
                self._finished.add(job_id)

    def is_done(self, job_id: str, mode: str = "standard") -> bool:
        info = self.get_info(job_id, mode=mode)
        state = info.get("State") or "UNKNOWN"
        return state == GONE or is_final(state, info.get("Requeue", "1") != "0")


class HetJob(SlurmJob[dict[str, Any]]):
    """A submitted hpcrl run as a submitit job; `HetJob(RUN_DIR/logs, job_id)` re-attaches to it.

    `result()` waits and returns `launch.result.run_summary` (policy_sha256, last_step, ...) or
    raises submitit's `FailedJobError`, whose text starts with Slurm's final state ("hpcrl job 42
    ended CANCELLED") and then says why (the failed rank and phase, a cancel, the requeue cap); a job
    that ended without a result (cancelled while pending, killed) raises `UncompletedJobError` naming
    its state. `stdout()` is the current attempt's step log, `stderr()` the batch script's log
    (signals, requeues, exit codes).
    """

    watcher = ScontrolWatcher(delay_s=30)
    ending_timeout_s = 90.0
    """How long `result()` of a failed job waits for Slurm to finish ending it (its result can be
    written while the job is still COMPLETING), to name its final state."""

    @property
    def run_dir(self) -> Path:
        """The run dir: the parent of the job folder (hpcrl's log dir is RUN_DIR/logs)."""
        return self.paths.folder.parent

    @property
    def restarts(self) -> int:
        """How often Slurm requeued the job so far (SLURM_RESTART_COUNT of the current attempt)."""
        return int(self.get_info(mode="standard").get("Restarts", "0"))

    def slurm_state(self) -> JobState | None:
        """Everything Slurm reports of the job now (state, reason, restarts, exit code, run time,
        time left, partition, component node lists), asked afresh; None once Slurm has forgotten
        the job and no accounting knows it. SlurmError when the controller does not answer."""
        return job_state(self.job_id)

    @property
    def log_record(self) -> dict[str, str]:
        """{job_id, log_dir}: what launch.slurm_query's log-file functions need of this job."""
        return {"job_id": self.job_id, "log_dir": str(self.paths.folder)}

    def stderr(self) -> str | None:
        folder = self.paths.folder
        parts = [p.read_text(errors="replace") for p in
                 (folder / f"slurm-{self.job_id}.out", folder / f"slurm-{self.job_id}.err") if p.is_file()]
        return "".join(parts) if parts else None

    def cancel(self, check: bool = True) -> None:
        """scancel every component and wait until Slurm reports the job ended (every rank gone). A job
        that ended without a result (cancelled while pending) then gets one, so that `result()`, also
        of a plain submitit job, raises at once instead of waiting."""
        try:
            final = cancel_job(self.job_id)
        except SlurmError:
            if check:
                raise
            final = None
        self.watcher.update()
        if final is not None and final.final and not self.paths.result_pickle.exists():
            write_result(self.paths.folder, self.job_id, self.run_dir, None,
                         f"the job was cancelled (Slurm state {final.state}) before its batch script wrote "
                         "a result")

    def _interrupt(self, timeout: bool = False) -> None:
        """Simulate preemption or the time-limit warning (submitit's testing hook): USR1 to the batch
        script, as Slurm sends it (`--signal=B:USR1`); it forwards the signal to the step, whose
        controller saves a checkpoint and asks to be requeued. `timeout` changes nothing: hpcrl
        handles both the same way."""
        slurm_cmd(["scancel", "--batch", "--signal=USR1", self.job_id])

    def results(self) -> list[dict[str, Any]]:
        try:
            return super().results()
        except submitit_utils.FailedJobError as exc:
            raise submitit_utils.FailedJobError(f"{self._ended_line()}\n{exc}") from None

    def _get_outcome_and_result(self) -> tuple[str, Any]:
        try:
            return super()._get_outcome_and_result()
        except submitit_utils.UncompletedJobError:
            raise submitit_utils.UncompletedJobError(self._no_result_text()) from None

    def _ended_state(self) -> JobState | None:
        """Slurm's state of the job, waiting up to `ending_timeout_s` while it is not final yet."""
        deadline = time.monotonic() + self.ending_timeout_s
        while True:
            try:
                state = job_state(self.job_id)
            except SlurmError:
                return None
            if state is None or state.final or time.monotonic() >= deadline:
                return state
            time.sleep(1.0)

    def _ended_line(self) -> str:
        state = self._ended_state()
        if state is None:
            return f"hpcrl job {self.job_id} ended; Slurm no longer knows it (and no accounting does)"
        reason = f" ({state.reason})" if state.reason not in ("", "None") else ""
        code = f", exit code {state.exit_code}" if state.exit_code else ""
        if state.final:
            return f"hpcrl job {self.job_id} ended {state.state}{reason}{code}"
        waited = f"{self.ending_timeout_s:.0f} s"
        return f"hpcrl job {self.job_id} is {state.state}{reason}, not ended after {waited}"

    def _no_result_text(self) -> str:
        log = self.paths.folder / f"slurm-{self.job_id}.out"
        tail = log.read_text(errors="replace").splitlines()[-20:] if log.is_file() else []
        lines = [f"{self._ended_line()}, without a result: it ended before its batch script could write "
                 "one (cancelled while pending, its batch node failed, or killed before it got to it)",
                 f"run dir: {self.run_dir} (hpcrl status {self.run_dir}); batch log: {log}"]
        if tail:
            lines += ["last lines of the batch log:", *tail]
        return "\n".join(lines)


class HetJobExecutor(SlurmExecutor):
    """Submits `launch.slurm_submit.SubmitPlan`s; the job folder is the plan's log dir.

    `submit_plan(plan, after=...)` is the entry point; `submit(fn)` is not (a run is not a pickled
    function). Parameters come from the plan, so `update_parameters` has nothing to set.
    """

    job_class = HetJob

    def __init__(self, folder: str | Path, python: str | None = None) -> None:
        require_tool("sbatch")
        super().__init__(folder, max_num_timeout=0, python=python)
        self._plan: Any = None
        self._after: tuple[str, ...] = ()
        self.last_sbatch: list[str] = []  # the last sbatch command line (the file is then renamed)

    @classmethod
    def affinity(cls) -> int:
        return 2  # sbatch is checked in __init__ with hpcrl's message; srun runs inside the job only

    def submit_plan(self, plan: Any, after: Sequence[SlurmJob[Any] | str] = ()) -> HetJob:
        """sbatch `plan.script` (its log dir must be this executor's folder); start only after every
        job of `after` completed successfully. SlurmError when sbatch rejects the job."""
        if Path(plan.spec.log_dir) != self.folder:
            raise ValueError(f"plan log dir {plan.spec.log_dir} is not this executor's folder {self.folder}")
        self._plan, self._after = plan, tuple(j if isinstance(j, str) else j.job_id for j in after)
        try:
            # submitit prints sbatch's stderr itself on failure; hpcrl reports it once, in its words
            with contextlib.redirect_stderr(io.StringIO()):
                job = self.submit(RunOutcome(str(plan.run_dir)))
        except submitit_utils.FailedJobError as exc:
            err = str(exc).strip()
            code = getattr(exc.__cause__, "returncode", None)
            if code == 124 and not err:  # killed by `timeout`
                raise SlurmError("sbatch", " ".join(self.last_sbatch),
                                 f"no answer within {SBATCH_TIMEOUT_S} s; is the Slurm controller up "
                                 "(`scontrol ping`)?") from None
            raise SlurmError("sbatch", str(plan.run_dir / "job.sbatch"),
                             f"Slurm rejected the job: {err or f'exit code {code}'}") from None
        finally:
            self._plan, self._after = None, ()
        assert isinstance(job, HetJob)
        # Job ids restart at 1 when a cluster's state is wiped: a reused run dir may hold an older job's
        # result under this id, which result() would return at once.
        job.paths.result_pickle.unlink(missing_ok=True)
        return job

    def _internal_process_submissions(self, delayed_submissions: list[Any]) -> list[Any]:
        assert self._plan is not None, "use HetJobExecutor.submit_plan(plan)"
        assert len(delayed_submissions) == 1, "a hetjob cannot be a Slurm array; submit plans one by one"
        return super()._internal_process_submissions(delayed_submissions)

    def _make_submission_file_text(self, command: str, uid: str) -> str:
        return str(self._plan.script)

    def _num_tasks(self) -> int:
        return 1  # one outcome per run: rank 0's, written by the batch script

    def _make_submission_command(self, submission_file_path: Path) -> list[str]:
        dependency = [f"--dependency=afterok:{':'.join(self._after)}"] if self._after else []
        self.last_sbatch = ["sbatch", "--parsable", *dependency, str(submission_file_path)]
        return ["timeout", str(SBATCH_TIMEOUT_S), *self.last_sbatch]

    @staticmethod
    def _get_job_id_from_submission_command(string: bytes | str) -> str:
        text = string.decode() if isinstance(string, bytes) else string
        lines = text.strip().splitlines()
        job_id = lines[-1].split(";")[0].strip() if lines else ""
        if not job_id.isdigit():
            raise submitit_utils.FailedSubmissionError(f"no job id in sbatch's output {text!r}")
        return job_id
