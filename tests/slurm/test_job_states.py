"""How hpcrl's jobs end, on the real local Slurm cluster (issue 30 item 10).

(a) accounting knows a hetjob only as `<id>+0`, `<id>+1`: its state comes from the leader record;
(c) a job cancelled while it runs has a result that says so, written by its batch script before
Slurm kills it, so a plain `submitit.SlurmJob(folder, id).result()` raises at once instead of
waiting forever, and hpcrl's `HetJob.result()` names Slurm's final state; a job cancelled while
pending has no result and `HetJob.result()` raises naming its state;
(d) USR2 (submitit's preemption signal) to the batch script is forwarded to the step as USR1;
(f) more than `max_requeues` requeues in a row without a newer checkpoint stop the job, saying why.
The jobs are rendered from hpcrl's templates with tiny stand-in programs, not full hpcrl runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from submitit.core.utils import FailedJobError, UncompletedJobError

from launch.checkpoint_step import checkpoint_step_command
from launch.result import REQUEUE_EXIT_CODE
from launch.slurm_executor import HetJob
from launch.slurm_query import job_state, sacct_state
from launch.slurm_runs import status_text
from launch.slurm_spec import SlurmComponent, SlurmJobSpec, render

pytestmark = pytest.mark.slurm
PYTHON = sys.executable
PLAIN_SUBMITIT_RESULT = """
import sys, submitit
try:
    submitit.SlurmJob(sys.argv[1], sys.argv[2]).result()
    print("no error")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def spec_for(job_dir: Path, components: tuple[SlurmComponent, ...], program: Path, **extra) -> SlurmJobSpec:
    """A rendered hpcrl job running `program` on every task, with hpcrl's result writer."""
    (job_dir / "logs").mkdir(exist_ok=True)
    result = f'{PYTHON} -P -m launch.result {job_dir} {job_dir / "logs"} "${{SLURM_JOB_ID}}"'
    return SlurmJobSpec(job_name="hpcrl-test", partition="debug", time_limit_min=5, components=components,
                        command=f"{PYTHON} {program} {job_dir}", run_dir=str(job_dir),
                        log_dir=str(job_dir / "logs"), signal_delay_s=30, result_command=result, **extra)


def submit_rendered(slurm, job_dir: Path, spec: SlurmJobSpec, *sbatch_args: str) -> str:
    script = job_dir / "job.sbatch"
    script.write_text(render(spec))
    return slurm.submit(None, *sbatch_args, str(script))


def plain_submitit_result(folder: Path, job_id: str) -> str:
    """What a plain submitit `result()` in a fresh process raises; fails the test if it still waits."""
    try:
        proc = subprocess.run([PYTHON, "-c", PLAIN_SUBMITIT_RESULT, str(folder), job_id], capture_output=True,
                              text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"plain submitit.SlurmJob({folder}, {job_id}).result() still waits after 60 s")
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def accounting_on() -> bool:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    return any(line.split("=", 1)[-1].strip() not in ("accounting_storage/none", "")
               for line in out.splitlines() if line.startswith("AccountingStorageType"))


HETJOB_SLEEP = """#!/bin/bash
#SBATCH --ntasks=1 --time=2 --output=/dev/null
#SBATCH hetjob
#SBATCH --ntasks=1
sleep 60
"""


@pytest.mark.timeout(150)
def test_accounting_knows_a_hetjob_by_its_leader_record(slurm, job_dir: Path, monkeypatch) -> None:
    if not accounting_on():
        pytest.skip("the cluster has no accounting (tests/slurm/cluster.sh with HPCRL_SLURM_ACCOUNTING=1)")
    (job_dir / "het.sbatch").write_text(HETJOB_SLEEP)
    job_id = slurm.submit(job_dir / "het.sbatch")
    slurm.wait_until("the hetjob to run", lambda: slurm.state(job_id) == "RUNNING", 60, job_id)
    subprocess.run(["scancel", job_id], check=True, timeout=30)

    def component_records() -> list[str]:
        out = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "JobID,State"],
                             capture_output=True, text=True, timeout=30).stdout
        return sorted(line for line in out.splitlines() if line.startswith(f"{job_id}+"))

    # slurmdbd lists a new hetjob as `<id>` for a few seconds, then as its components only
    records = slurm.wait_until("accounting to list the components", lambda: len(component_records()) == 2
                               and component_records(), 60, job_id)
    assert records == [f"{job_id}+0|CANCELLED by 0", f"{job_id}+1|CANCELLED by 0"]
    assert sacct_state(job_id) == "CANCELLED"
    # Once Slurm has forgotten the job (MinJobAge) only accounting knows it; a scontrol that no longer
    # knows the id stands in for that here (the cluster keeps jobs for 10 min)
    bin_dir = job_dir / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n"
                                      "echo 'slurm_load_jobs error: Invalid job id specified' >&2\nexit 1\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    state = job_state(job_id)
    assert (state.state, state.final, state.source) == ("CANCELLED", True, "sacct")
    job = HetJob(job_dir / "logs", job_id)
    assert job.state == "CANCELLED" and job.done(force_check=True)  # not GONE


# Every task: ignore TERM (like a controller still saving a checkpoint, it outlives Slurm's KillWait
# and is killed), say it runs, wait.
IGNORES_TERM = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], "ready-" + os.environ["SLURM_PROCID"]), "w").close()
time.sleep(120)
"""


@pytest.mark.timeout(180)
def test_job_cancelled_while_running_or_pending_raises_naming_its_state(slurm, job_dir: Path) -> None:
    program = job_dir / "prog.py"
    program.write_text(IGNORES_TERM)
    two = (SlurmComponent(nodes=1, ntasks_per_node=1), SlurmComponent(nodes=1, ntasks_per_node=1))
    job_id = submit_rendered(slurm, job_dir, spec_for(job_dir, two, program))
    slurm.wait_until("both tasks to run", lambda: all((job_dir / f"ready-{r}").exists() for r in (0, 1)),
                     90, job_id)
    subprocess.run(["scancel", job_id], check=True, timeout=30)
    record = slurm.wait_final(job_id, timeout_s=60)
    batch_log = (job_dir / "logs" / f"slurm-{job_id}.out").read_text()
    assert record["JobState"] == "CANCELLED", (record, batch_log)
    assert "Slurm is ending the job (JobState=COMPLETING); writing its result now" in batch_log, batch_log
    # a hetjob: plain submitit cannot see its state (sacct has no record `<id>`), only the result file
    plain = plain_submitit_result(job_dir / "logs", job_id)
    assert plain.startswith("FailedJobError") and "Slurm ended the job while it ran" in plain, plain
    with pytest.raises(FailedJobError, match=f"^hpcrl job {job_id} ended CANCELLED") as err:
        HetJob(job_dir / "logs", job_id).result()
    assert "it was cancelled (scancel, hpcrl cancel) or reached its time limit" in str(err.value)

    # cancelled while pending: no batch script ran, no result; HetJob.result() says what Slurm says
    held = submit_rendered(slurm, job_dir, spec_for(job_dir, two, program), "--hold")
    assert slurm.state(held) == "PENDING"
    subprocess.run(["scancel", held], check=True, timeout=30)
    assert slurm.wait_final(held, timeout_s=30)["JobState"] == "CANCELLED"
    with pytest.raises(UncompletedJobError, match=f"^hpcrl job {held} ended CANCELLED.*, without a result"):
        HetJob(job_dir / "logs", held).result()


# Every attempt: say it runs, wait for the forwarded signal; the first attempt commits a checkpoint
# (step 1, as the controller's save on the signal does), the later ones save nothing; then ask to be
# requeued.
SAVES_ONCE = """
import os, pathlib, signal, sys, time
out, attempt = pathlib.Path(sys.argv[1]), int(os.environ["HPCRL_ATTEMPT"])
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
(out / f"ready-{attempt}").touch()
deadline = time.monotonic() + 90
while not got and time.monotonic() < deadline:
    time.sleep(0.1)
print(f"attempt={attempt} signal={got}", flush=True)
if attempt == 0:
    (out / "checkpoints" / "step_000001").mkdir(parents=True)
    (out / "checkpoints" / "step_000001" / "manifest.json").write_text("{}")
sys.exit({requeue} if got else 1)
"""


@pytest.mark.timeout(240)
def test_usr2_preempts_and_requeues_without_progress_stop_at_the_cap(slurm, job_dir: Path) -> None:
    # max_requeues=1: attempt 0 saves (the count stays 0), attempt 1 saves nothing (1 of at most 1),
    # attempt 2 saves nothing (2 > 1): the job stops, FAILED with the requeue code, saying why.
    program = job_dir / "prog.py"
    program.write_text(SAVES_ONCE.replace("{requeue}", str(REQUEUE_EXIT_CODE)))
    spec = spec_for(job_dir, (SlurmComponent(nodes=1, ntasks_per_node=1),), program, max_requeues=1,
                    checkpoint_step_command=checkpoint_step_command(PYTHON, str(job_dir / "checkpoints")))
    job_id = submit_rendered(slurm, job_dir, spec)
    for attempt in range(3):
        ready = job_dir / f"ready-{attempt}"
        slurm.wait_until(f"attempt {attempt} to run", ready.exists, 90, job_id)
        slurm.signal_batch(job_id, "USR2")  # what submitit sends (scancel --full / SUBMITIT_PREEMPT_SIGNAL)
    record = slurm.wait_final(job_id, timeout_s=60)
    logs = job_dir / "logs"
    batch_log = (logs / f"slurm-{job_id}.out").read_text()
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == (
        "FAILED", f"{REQUEUE_EXIT_CODE}:0", "2"), (record, batch_log)
    assert batch_log.count("received SIGUSR2; forwarding SIGUSR1 to the step's tasks") == 3, batch_log
    for attempt in range(3):
        step_log = (logs / f"{job_id}-attempt{attempt}.log").read_text()
        assert f"attempt={attempt} signal=['SIGUSR1']" in step_log, step_log
    assert ("the step asked to be requeued (exit code 3): scontrol requeue "
            f"{job_id} (latest checkpoint step: 1; requeues in a row without a newer one: 0 of at most 1)"
            ) in batch_log
    assert "(latest checkpoint step: 1; requeues in a row without a newer one: 1 of at most 1)" in batch_log
    why = ("2 attempts in a row ended without a newer checkpoint than they started from (latest checkpoint "
           "step: 1), more than slurm.max_requeues=1 allows")
    assert f"the step asked to be requeued (exit code 3), but the job stops instead: {why}" in batch_log
    plain = plain_submitit_result(logs, job_id)
    assert plain.startswith("FailedJobError") and why in plain, plain
    job = HetJob(logs, job_id)
    status = status_text(job)  # what `hpcrl status` prints
    assert f"\noutcome   hpcrl job stopped without finishing: {why}: the run does not reach" in status, status
