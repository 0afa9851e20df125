"""The submitit side of launch/ without a cluster: result files, the hetjob executor against fake
Slurm tools (sbatch, scontrol, squeue on PATH), the local job handle, and hpcrl.jobs' checks."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import FailedJobError

from hpcrl.config import ConfigError, load_job
from hpcrl.jobs import Executor, Submission, attach
from launch.local_job import LocalRunExecutor
from launch.result import RunOutcome, result_path, write_result
from launch.slurm_executor import HetJob, HetJobExecutor
from launch.slurm_query import SlurmError
from launch.slurm_submit import plan_submission

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"


def finished_run(run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "final.json").write_text(json.dumps({"policy_sha256": "ab" * 32, "num_steps": 2}))
    rows = [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.2}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_plain_submitit_job_reads_the_run_summary(tmp_path: Path) -> None:
    run_dir = finished_run(tmp_path / "run")
    write_result(run_dir / "logs", "77", run_dir, 0)
    summary = submitit.SlurmJob(run_dir / "logs", "77").result()
    assert summary["policy_sha256"] == "ab" * 32 and summary["last_step"] == 1 and summary["num_steps"] == 2
    assert summary["metrics"]["reward/mean"] == 0.2 and summary["run_dir"] == str(run_dir)
    assert RunOutcome(str(run_dir))() == summary


def test_failed_run_raises_naming_the_rank_and_phase(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / ".failure.txt").write_text("hpcrl run failed: rank 2 (rollout, host n2) exited during phase "
                                          "'generate' of step 3\n")
    (run_dir / ".phase.json").write_text(json.dumps({"step": 3, "phase": "generate"}))
    write_result(run_dir / "logs", "78", run_dir, 1)
    with pytest.raises(FailedJobError) as err:
        submitit.SlurmJob(run_dir / "logs", "78").result()
    text = str(err.value)
    assert "rank 2 (rollout, host n2) exited during phase 'generate' of step 3" in text
    assert "controller phase: 'generate' of step 3" in text and "step exit code: 1" in text
    # exit 0 without final.json, or no report at all, is a failure too, said so
    write_result(run_dir / "logs", "79", tmp_path, 0)
    with pytest.raises(FailedJobError, match="final.json is missing"):
        submitit.SlurmJob(run_dir / "logs", "79").result()
    write_result(run_dir / "logs", "80", tmp_path, 3)  # interrupted, checkpoint saved, not requeued
    with pytest.raises(FailedJobError, match="interrupted .preempted or cancelled. and not requeued"):
        submitit.SlurmJob(run_dir / "logs", "80").result()


FAKE_SBATCH = """#!/bin/bash
# records its arguments and the script; rejects jobs named 'reject'
echo "$@" > "{out}/sbatch.args"
cp "${{@: -1}}" "{out}/sbatch.script"
if grep -q 'job-name=reject' "${{@: -1}}"; then echo "sbatch: error: invalid partition" >&2; exit 1; fi
echo "4242"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "JobId=$4 JobName=x JobState={state} Reason=None Restarts=1 ExitCode=0:0 RunTime=00:00:05 \
TimeLimit=00:10:00 Partition=debug NodeList=n1 HetJobId=$4 HetJobOffset=0"
echo "JobId=$(( $4 + 1 )) JobName=x JobState={state} Reason=None Restarts=1 ExitCode=0:0 Partition=debug \
NodeList=n2 HetJobId=$4 HetJobOffset=1"
"""


@pytest.fixture
def fake_slurm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()

    def install(state: str = "PENDING") -> Path:
        for name, text in (("sbatch", FAKE_SBATCH), ("scontrol", FAKE_SCONTROL),
                           ("squeue", "#!/bin/bash\necho 9:59\n")):
            path = bin_dir / name
            path.write_text(text.format(out=tmp_path, state=state))
            path.chmod(path.stat().st_mode | stat.S_IEXEC)
        return tmp_path

    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    return install


def plan_for(tmp_path: Path, *overrides: str):
    job = load_job(EXAMPLE, ["slurm.partition=debug", "resources.rollout_nodes=1", *overrides])
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    return plan_submission(job, run_dir, check=False)


def test_hetjob_executor_submits_the_rendered_script_and_watches_scontrol(tmp_path, fake_slurm) -> None:
    out = fake_slurm("PENDING")
    plan = plan_for(tmp_path)
    stale = result_path(Path(plan.spec.log_dir), "4242")  # an older job with the same id, before a wipe
    write_result(stale.parent, "4242", finished_run(tmp_path / "old"), 0)
    job = HetJobExecutor(plan.spec.log_dir).submit_plan(plan, after=["11", "12"])
    assert isinstance(job, HetJob) and isinstance(job, submitit.SlurmJob) and job.job_id == "4242"
    assert (out / "sbatch.script").read_text() == plan.script  # what `hpcrl render` prints
    assert (out / "sbatch.args").read_text().split()[:2] == ["--parsable", "--dependency=afterok:11:12"]
    assert job.paths.submission_file.read_text() == plan.script
    assert job.submission().function.run_dir == str(plan.run_dir)  # the pickled RunOutcome
    assert job.num_tasks == 1 and job.run_dir == plan.run_dir
    assert job.state == "PENDING" and job.restarts == 1 and not job.done(force_check=True)
    assert not stale.exists()
    info = job.get_info()
    assert info["NodeList"] == "n1,n2" and info["Reason"] == "None"


def test_hetjob_state_from_another_process_and_final_states(tmp_path, fake_slurm) -> None:
    fake_slurm("COMPLETED")
    again = HetJob(tmp_path / "logs", "5151")  # attach by folder and id, as from another process
    assert again.state == "COMPLETED" and again.done(force_check=True)


def test_job_slurm_forgot_is_done_not_pending_forever(tmp_path, fake_slurm) -> None:
    fake_slurm()
    bin_dir = tmp_path / "bin"
    for name, text in (("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"),
                       ("sacct", "exit 1")):  # no accounting
        (bin_dir / name).write_text(f"#!/bin/bash\n{text}\n")
        (bin_dir / name).chmod(0o755)
    job = HetJob(tmp_path / "logs", "6161")
    assert job.state == "GONE" and job.done(force_check=True)


def test_rejected_job_reports_sbatch_error_once(tmp_path, fake_slurm, capsys) -> None:
    fake_slurm()
    plan = plan_for(tmp_path, "name=reject")
    with pytest.raises(SlurmError, match="Slurm rejected the job: sbatch: error: invalid partition"):
        HetJobExecutor(plan.spec.log_dir).submit_plan(plan)
    assert capsys.readouterr().err == ""


def test_silent_sbatch_is_reported_as_a_timeout(tmp_path, fake_slurm, monkeypatch) -> None:
    fake_slurm()
    (tmp_path / "bin" / "sbatch").write_text("#!/bin/bash\nexit 124\n")  # what `timeout` returns
    plan = plan_for(tmp_path)
    with pytest.raises(SlurmError, match="no answer within 60 s; is the Slurm controller up"):
        HetJobExecutor(plan.spec.log_dir).submit_plan(plan)


def test_executor_folder_must_be_the_plan_log_dir(tmp_path, fake_slurm) -> None:
    fake_slurm()
    plan = plan_for(tmp_path)
    with pytest.raises(ValueError, match="is not this executor's folder"):
        HetJobExecutor(tmp_path / "elsewhere").submit_plan(plan)


@pytest.mark.timeout(60)
def test_local_job_has_the_same_handle_shape(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    write = (f"import json, pathlib; p = pathlib.Path({str(run_dir)!r}); p.mkdir(exist_ok=True); "
             "(p / 'final.json').write_text(json.dumps({'policy_sha256': 'cd', 'num_steps': 1})); "
             "print('hello')")
    job = LocalRunExecutor(run_dir / "logs").submit_command([sys.executable, "-c", write], run_dir)
    assert job.result()["policy_sha256"] == "cd" and job.state == "COMPLETED" and job.done()
    assert job.stdout() == "hello\n" and job.paths.result_pickle == result_path(run_dir / "logs", job.job_id)
    failing = LocalRunExecutor(run_dir / "logs").submit_command([sys.executable, "-c", "raise SystemExit(4)"],
                                                                tmp_path / "other")
    with pytest.raises(FailedJobError, match="step exit code: 4"):
        failing.result()
    assert failing.state == "FAILED"
    sleeper = LocalRunExecutor(run_dir / "logs").submit_command(["sleep", "60"], tmp_path / "other")
    assert sleeper.state == "RUNNING"
    sleeper.cancel()
    assert sleeper.state == "CANCELLED" and sleeper.done()


def test_jobs_api_checks_before_starting_anything(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind='pbs': choose one of slurm, local"):
        Executor(kind="pbs")
    ex = Executor(kind="local")
    with pytest.raises(ConfigError, match="every job of a batch needs its own run dir"):
        ex.submit_batch([Submission(EXAMPLE, run_dir=tmp_path / "a")] * 2)
    with pytest.raises(ConfigError, match="dependencies need Slurm"):
        ex.submit(EXAMPLE, run_dir=tmp_path / "b", after=["12"])
    # the same message as `hpcrl submit --set algorithm.num_steps=0`
    with pytest.raises(ConfigError) as err:
        ex.submit(EXAMPLE, ["algorithm.num_steps=0"], run_dir=tmp_path / "c")
    with pytest.raises(ConfigError) as want:
        load_job(EXAMPLE, ["algorithm.num_steps=0"])
    assert str(err.value) == str(want.value)
    config = load_job(EXAMPLE)
    with pytest.raises(ConfigError, match="algorithm.num_steps"):
        ex.submit(config, ["algorithm.num_steps=0"], run_dir=tmp_path / "d")
    assert not any((tmp_path / d).exists() for d in "abcd")
    with pytest.raises(ConfigError, match="holds no slurm.json or local_job.json"):
        attach(tmp_path)


def test_slurm_batch_submits_nothing_when_one_entry_is_bad(tmp_path: Path, fake_slurm) -> None:
    out = fake_slurm()
    good = Submission(EXAMPLE, ["slurm.partition=debug"], run_dir=tmp_path / "a")
    bad = Submission(EXAMPLE, ["algorithm.num_steps=0"], run_dir=tmp_path / "b")
    with pytest.raises(ConfigError, match="algorithm.num_steps"):
        Executor(kind="slurm").submit_batch([good, bad])
    assert not (out / "sbatch.args").exists() and not (tmp_path / "a").exists()


def submitted_run(tmp_path: Path, job_id: str = "4242") -> Path:
    """A run dir as `hpcrl submit` leaves it: slurm.json, config.json, a step log of attempt 0."""
    run_dir = finished_run(tmp_path / "run")
    (run_dir / "logs").mkdir(exist_ok=True)
    record = {"job_id": job_id, "submitit_folder": str(run_dir / "logs"), "log_dir": str(run_dir / "logs")}
    (run_dir / "slurm.json").write_text(json.dumps(record))
    (run_dir / "config.json").write_text(json.dumps({"algorithm": {"num_steps": 2}}))
    (run_dir / "logs" / f"{job_id}-attempt0.log").write_text("step 0\nstep 1\n")
    return run_dir


def test_status_logs_cancel_act_on_the_run_s_hetjob(tmp_path, fake_slurm, capsys) -> None:
    from hpcrl.cli import main

    out = fake_slurm("RUNNING")
    bin_dir = tmp_path / "bin"
    (bin_dir / "scancel").write_text(f"#!/bin/bash\necho \"$@\" > {out}/scancel.args\n")
    (bin_dir / "scancel").chmod(0o755)
    run_dir = submitted_run(tmp_path)
    job = attach(run_dir)
    assert isinstance(job, HetJob) and job.job_id == "4242" and job.run_dir == run_dir.resolve()
    assert job.log_record == {"job_id": "4242", "log_dir": str(run_dir.resolve() / "logs")}
    assert main(["status", str(run_dir)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:5] == [f"run dir   {run_dir}", "job       4242 RUNNING, partition debug",
                         "nodes     4242+0: n1, 4242+1: n2", "attempt   1 (1 restarts; SLURM_RESTART_COUNT)",
                         "time      00:00:05 elapsed of 00:10:00, 9:59 left"]
    assert "progress  step 2/2 done, reward/mean 0.2000" in lines
    assert f"finished  policy sha256 {'ab' * 32}" in lines
    assert main(["logs", str(run_dir)]) == 0 and capsys.readouterr().out == "step 0\nstep 1\n"
    # cancel: scancel through HetJob.cancel, which waits until Slurm reports the job ended
    (bin_dir / "scontrol").write_text(FAKE_SCONTROL.format(state="CANCELLED"))
    (bin_dir / "scontrol").chmod(0o755)
    assert main(["cancel", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == "job 4242 already ended (CANCELLED); nothing to cancel"
    assert not (out / "scancel.args").exists()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[[ -f {0}/scancel.args ]] && s=CANCELLED || s=RUNNING\n"
                                      .format(out) + FAKE_SCONTROL.replace("{state}", "$s").split("\n", 1)[1])
    assert main(["cancel", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"cancelled job 4242 (CANCELLED); run dir {run_dir}"
    assert (out / "scancel.args").read_text().split() == ["4242"]


def test_launch_public_surface_is_explicit_and_lazy() -> None:
    # a fresh interpreter: the ranks import launch.procs without submitit; every public name resolves
    code = ("import sys, launch, launch.procs; assert 'submitit' not in sys.modules; "
            "from launch import slurm_spec; "
            "missing = [n for n in launch.__all__ if getattr(launch, n, None) is None]; "
            "print(sorted(launch.__all__) == launch.__all__, missing)")
    import subprocess

    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, cwd=REPO,
                         timeout=60)
    assert out.stdout.strip() == "True []", out.stderr


# ---- pipelines: export at the end of a job, a job that starts from that export ----------------

def checkpointed_run(run_dir: Path) -> Path:
    """A finished 2-step run whose last checkpoint (step 1) holds a tiny policy."""
    import torch

    from checkpoints import CheckpointWriter
    from moe.slices import Box

    finished_run(run_dir)
    w = CheckpointWriter(run_dir / "checkpoints", 1, rank=0, world_size=1, attempt_id="a")
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    w.write("policy/lm_head.weight", t, Box.full((2, 3)), (2, 3))
    w.commit({"step": 1})
    (run_dir / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}, "model": {"path": None}}))
    (run_dir / "model_config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    return run_dir


FAKE_CLUSTER_SCONTROL = """#!/bin/bash
case "$3" in
node) for n in 1 2; do
  echo "NodeName=n$n CPUTot=4 Gres=gpu:2 RealMemory=4000 State=IDLE Partitions=debug"
done;;
partition) echo "PartitionName=debug Default=YES State=UP MaxTime=UNLIMITED MaxNodes=UNLIMITED";;
job) echo "JobId=$4 JobName=x JobState=PENDING Reason=Dependency Restarts=0 ExitCode=0:0 Partition=debug \
NodeList=(null)";;
esac
"""


def test_pipeline_second_job_starts_from_the_first_job_s_export(tmp_path: Path, fake_slurm) -> None:
    out = fake_slurm()
    (tmp_path / "bin" / "scontrol").write_text(FAKE_CLUSTER_SCONTROL)
    ex, export = Executor(kind="slurm"), tmp_path / "sft" / "export"
    quiet = ["slurm.partition=debug", "resources.rollout_nodes=1"]
    with pytest.raises(ConfigError, match="export_to=.*would overwrite the run's own files"):
        ex.submit(EXAMPLE, quiet, run_dir=tmp_path / "sft", export_to=tmp_path / "sft" / "checkpoints" / "x")
    downloaded = tmp_path / "model"  # a model directory export did not write: its weights would go
    downloaded.mkdir()
    (downloaded / "model.safetensors").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}")
    with pytest.raises(ConfigError, match="export_to=.*holds model.safetensors, which hpcrl export did not write"):
        ex.submit(EXAMPLE, quiet, run_dir=tmp_path / "sft", export_to=downloaded)
    sft = ex.submit(EXAMPLE, quiet, run_dir=tmp_path / "sft", export_to=export)
    script = (out / "sbatch.script").read_text().splitlines()
    export_line = next(line for line in script if "launch.export_step" in line)
    want = f"{sys.executable} -P -m launch.export_step {tmp_path / 'sft'} {export} \"$rc\" || rc=$?"
    assert export_line == want
    # then the result: the script's write_result runs launch.result with the job's Python
    assert script.index(export_line) < script.index('write_result "$rc" "$why"')
    result_line = next(script[i + 1] for i, line in enumerate(script) if line.startswith("write_result() {"))
    assert result_line.strip().startswith(f"{sys.executable} -P -m launch.result {tmp_path / 'sft'} ")
    assert json.loads((tmp_path / "sft" / "slurm.json").read_text())["export_dir"] == str(export)

    grpo = [*quiet, f"model.path={export}"]
    with pytest.raises(ConfigError, match="model.path=.*no such directory"):  # no dependency, no deferral
        ex.submit(EXAMPLE, grpo, run_dir=tmp_path / "rl")
    with pytest.raises(ConfigError, match="algorithm.num_steps"):  # everything else is still checked
        ex.submit(EXAMPLE, [*grpo, "algorithm.num_steps=0"], run_dir=tmp_path / "rl", after=[sft])
    with pytest.raises(ConfigError) as err:  # a check against the model says which model it used
        ex.submit(EXAMPLE, [*grpo, "trainer.tp=3"], run_dir=tmp_path / "rl", after=[sft])
    assert str(err.value).startswith("trainer.tp=3: num_attention_heads=4 of preset 'tiny-qwen3-moe' is not "
                                     "divisible by tp=3")
    assert str(err.value).endswith(f"[model.path={export} is job 4242's export, not written yet: checked as "
                                   "the model that job trains, model.preset=tiny-qwen3-moe]")
    rl = ex.submit(EXAMPLE, grpo, run_dir=tmp_path / "rl", after=[sft])
    assert (out / "sbatch.args").read_text().split()[:2] == ["--parsable", "--dependency=afterok:4242"]
    assert "launch.export_step" not in (out / "sbatch.script").read_text()
    config = json.loads((tmp_path / "rl" / "config.json").read_text())
    assert config["model"]["path"] == str(export) and rl.run_dir == (tmp_path / "rl").resolve()
    # what the export's config.json will be: the first job's model config
    assert ((tmp_path / "rl" / "model_config.json").read_text()
            == (tmp_path / "sft" / "model_config.json").read_text())


def test_rendered_finish_step_exports_then_writes_the_result(tmp_path: Path) -> None:
    import subprocess

    run_dir = checkpointed_run(tmp_path / "run")
    export = tmp_path / "export"
    job = load_job(EXAMPLE, ["slurm.partition=debug", "resources.rollout_nodes=1"])
    script = plan_submission(job, run_dir, check=False, export_dir=export).script.splitlines()
    export_line = next(line for line in script if "launch.export_step" in line)
    start = next(i for i, line in enumerate(script) if line.startswith("write_result() {"))
    write_result = "\n".join(script[start:start + 3])  # the script's result writer, as rendered

    def run_finish(step_rc: int) -> int:
        # the template's lines around them: `say`, the step's exit code in rc, `exit "$rc"`
        bash = (f'say() {{ echo "$*"; }}; rc={step_rc}\n{write_result}\n{export_line}\n'
                'write_result "$rc" ""\nexit "$rc"\n')
        env = {**os.environ, "SLURM_JOB_ID": "99", "PYTHONPATH": str(REPO)}
        return subprocess.run(["bash", "-c", bash], env=env, capture_output=True, timeout=120).returncode

    assert run_finish(0) == 0 and (export / "model.safetensors").is_file()
    assert submitit.SlurmJob(run_dir / "logs", "99").result()["export_dir"] == str(export)
    (run_dir / "final.json").write_text(json.dumps({"policy_sha256": "ab" * 32, "num_steps": 5}))
    assert run_finish(0) == 4  # no checkpoint of step 4: the export fails, and so does the job
    with pytest.raises(FailedJobError) as err:
        submitit.SlurmJob(run_dir / "logs", "99").result()
    assert (f"the run finished, but exporting its final checkpoint to {export} failed: hpcrl export exited "
            "with code 2") in str(err.value)
    assert run_finish(7) == 7  # a failed run is not exported; its own exit code stays


@pytest.mark.timeout(60)
def test_local_job_exports_too(tmp_path: Path) -> None:
    run_dir = checkpointed_run(tmp_path / "run")
    job = LocalRunExecutor(run_dir / "logs").submit_command([sys.executable, "-c", "pass"], run_dir,
                                                            tmp_path / "export")
    assert job.result()["export_dir"] == str(tmp_path / "export")
    assert "exported to" in job.stderr() and (tmp_path / "export" / "model.safetensors").is_file()


def test_submit_sweep_submits_one_job_per_point(tmp_path: Path, fake_slurm, capsys) -> None:
    from hpcrl.cli import main
    from hpcrl.jobs import sweep_dir_name, sweep_points

    out = fake_slurm()
    (tmp_path / "bin" / "scontrol").write_text(FAKE_CLUSTER_SCONTROL)
    assert sweep_points(["algorithm.lr=1e-3, 3e-3", "data.seed=1,2"]) == [
        ("algorithm.lr=1e-3", "data.seed=1"), ("algorithm.lr=1e-3", "data.seed=2"),
        ("algorithm.lr=3e-3", "data.seed=1"), ("algorithm.lr=3e-3", "data.seed=2")]
    assert sweep_dir_name(("algorithm.lr=1e-3", "data.path=a/b c")) == "lr=1e-3_path=a-b-c"
    sweep = tmp_path / "sweep"
    argv = ["submit", str(EXAMPLE), "--set", "slurm.partition=debug", "--run-dir", str(sweep)]
    # bad sweeps: nothing is submitted, one line, exit 2
    for bad, message in ((["--sweep", "algorithm.lr"],
                          "hpcrl submit: error: --sweep='algorithm.lr': expected KEY=V1,V2,..."),
                         (["--sweep", "algorithm.lrr=1"], "unknown key 'algorithm.lrr'"),
                         (["--sweep", "algorithm.num_steps=2,0"], "algorithm.num_steps=0:")):
        assert main([*argv, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) or message in err, err
        assert not (out / "sbatch.args").exists() and not sweep.exists()
    assert main([*argv, "--sweep", "algorithm.lr=1e-3,3e-3", "--sweep", "data.seed=1,2"]) == 0
    text = capsys.readouterr().out
    assert text.count("submitted job 4242 (tiny_moe_grpo algorithm.lr=") == 4, text
    assert "(tiny_moe_grpo algorithm.lr=3e-3 data.seed=1: 3 ranks; component 0: 1 node" in text
    assert text.rstrip().endswith(f"sweep: 4 jobs under {sweep}; hpcrl status / logs / cancel take each "
                                  "run dir")
    for lr in ("1e-3", "3e-3"):
        for seed in (1, 2):
            run_dir = sweep / f"lr={lr}_seed={seed}"
            config = json.loads((run_dir / "config.json").read_text())
            assert (config["algorithm"]["lr"], config["data"]["seed"]) == (float(lr), seed)
            assert f"run dir: {run_dir}" in text and (run_dir / "slurm.json").is_file()


# ---- Slurm states: one definition of final (issue 30 item 10 b), sacct's hetjob records (a) -------

@pytest.mark.parametrize(("state", "requeue", "final"), [
    ("PREEMPTED", True, False),   # with --requeue (every hpcrl job) PENDING follows
    ("NODE_FAIL", True, False),   # so does it after a node failure (seen on the local cluster)
    ("PREEMPTED", False, True),
    ("NODE_FAIL", False, True),
    ("CANCELLED by 0", True, True),  # sacct's spelling
    ("COMPLETED", True, True), ("FAILED", True, True), ("TIMEOUT", True, True),
    ("COMPLETING", True, False),  # its processes are still being killed: the result may still come
    ("REQUEUE_HOLD", True, False), ("SPECIAL_EXIT", True, False),  # held; `scontrol release` runs it
    ("RUNNING", True, False), ("PENDING", True, False), ("UNKNOWN", True, False), ("", True, False),
])
def test_which_slurm_states_are_final(state: str, requeue: bool, final: bool) -> None:
    from launch.slurm_query import is_final

    assert is_final(state, requeue) is final


def test_a_preempted_job_is_live_for_cancel_submit_and_result(tmp_path, fake_slurm, capsys) -> None:
    from hpcrl.cli import main
    from launch.slurm_submit import check_run_dir_free

    out = fake_slurm("PREEMPTED")  # scontrol prints no Requeue=: Slurm's default, requeueable
    bin_dir = tmp_path / "bin"
    # scancel is recorded; afterwards the job is CANCELLED
    (bin_dir / "scancel").write_text(f"#!/bin/bash\necho \"$@\" > {out}/scancel.args\n")
    (bin_dir / "scancel").chmod(0o755)
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[[ -f {0}/scancel.args ]] && s=CANCELLED || s=PREEMPTED\n"
                                      .format(out) + FAKE_SCONTROL.replace("{state}", "$s").split("\n", 1)[1])
    run_dir = submitted_run(tmp_path, "4343")  # an id no other test has cached in the shared watcher
    job = attach(run_dir)
    assert job.state == "PREEMPTED" and not job.done(force_check=True)
    with pytest.raises(SlurmError, match="its job 4343 is PREEMPTED; cancel it first"):
        check_run_dir_free(run_dir)  # a second submit into the live run dir is refused
    assert main(["cancel", str(run_dir)]) == 0
    assert capsys.readouterr().out.strip() == f"cancelled job 4343 (CANCELLED); run dir {run_dir}"
    assert (out / "scancel.args").read_text().split() == ["4343"]
    # it was cancelled without a result from its batch script: HetJob.cancel wrote one, so result()
    # raises at once, naming the state, also for plain submitit (which cannot see the state here)
    with pytest.raises(FailedJobError, match="(?s)hpcrl job 4343 ended CANCELLED.*the job was cancelled "
                                             r"\(Slurm state CANCELLED\) before its batch script wrote"):
        attach(run_dir).result()
    with pytest.raises(FailedJobError, match="the job was cancelled"):
        submitit.SlurmJob(run_dir / "logs", "4343").result()
    assert main(["status", str(run_dir)]) == 0
    assert ("outcome   hpcrl job stopped without finishing: the job was cancelled (Slurm state CANCELLED) "
            "before its batch script wrote a result") in capsys.readouterr().out.splitlines()


def test_a_forgotten_hetjob_s_state_comes_from_its_sacct_leader_record(tmp_path, fake_slurm) -> None:
    # sacct has no record `6262` of a hetjob, only `6262+0` and `6262+1` (what the local cluster prints)
    fake_slurm()
    bin_dir = tmp_path / "bin"
    for name, text in (("scontrol", "echo 'slurm_load_jobs error: Invalid job id specified' >&2; exit 1"),
                       ("sacct", "printf 'JobID|State|NodeList\\n6262+0|CANCELLED by 0|n1\\n"
                                 "6262+1|CANCELLED by 0|n2\\n'")):
        (bin_dir / name).write_text(f"#!/bin/bash\n{text}\n")
        (bin_dir / name).chmod(0o755)
    from launch.slurm_query import job_state

    state = job_state("6262")
    assert (state.state, state.final, state.source) == ("CANCELLED", True, "sacct")
    job = HetJob(tmp_path / "logs", "6262")
    assert job.state == "CANCELLED" and job.done(force_check=True)


def test_result_file_says_why_the_batch_script_stopped_the_job(tmp_path: Path) -> None:
    # `python -m launch.result RUN_DIR FOLDER JOB_ID RC WHY`, as the batch script runs it; RC '' while
    # the step still runs (written when Slurm starts ending the job)
    import subprocess

    from launch.result import read_outcome

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    for rc, why, job_id in (("", "Slurm ended the job while it ran (JobState=COMPLETING)", "81"),
                            ("3", "2 attempts in a row ended without a newer checkpoint", "82")):
        argv = [sys.executable, "-P", "-m", "launch.result", str(run_dir), str(run_dir / "logs"), job_id, rc,
                why]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=REPO)
        assert proc.returncode == 0, proc.stderr
        kind, text = read_outcome(run_dir / "logs", job_id)
        assert kind == "error" and text.startswith(f"hpcrl job stopped without finishing: {why}\n"), text
        assert ("step exit code" in text) is bool(rc)
    assert read_outcome(run_dir / "logs", "83") is None
    bad = subprocess.run([sys.executable, "-P", "-m", "launch.result", str(run_dir), "x", "1", "three"],
                         capture_output=True, text=True, timeout=60, cwd=REPO)
    assert bad.returncode == 2 and bad.stderr.startswith("usage: python -m launch.result")


def test_checkpoint_step_prints_the_latest_complete_step(tmp_path: Path) -> None:
    import subprocess

    def latest() -> str:
        proc = subprocess.run([sys.executable, "-P", "-m", "launch.checkpoint_step", str(tmp_path / "ckpt")],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    assert latest() == "none"
    checkpointed_run(tmp_path / "run")  # a real commit of step 1
    (tmp_path / "run" / "checkpoints").rename(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "step_000005").mkdir()  # an interrupted save: no manifest, not complete
    assert latest() == "1"


def test_an_unwritable_checkpoint_dir_is_refused_before_the_run(tmp_path):
    """checkpoint.dir under /proc cannot be created: refused when the run dir is prepared (before any
    step), not after the last step's save failed and the run's training was lost."""
    from hpcrl.config import job_from_dict
    from hpcrl.config.errors import ConfigError
    from hpcrl.runner import prepare_run_dir

    job = job_from_dict({"checkpoint": {"dir": "/proc/hpcrl-no-such-dir/ckpt"}})
    with pytest.raises(ConfigError, match=r"checkpoint.dir='/proc/hpcrl-no-such-dir/ckpt': cannot create or "
                                          r"write it .* choose a writable directory"):
        prepare_run_dir(job, tmp_path / "run")
    ok = job_from_dict({"checkpoint": {"dir": str(tmp_path / "ckpt")}})
    prepare_run_dir(ok, tmp_path / "run")
    assert (tmp_path / "ckpt").is_dir() and list((tmp_path / "ckpt").iterdir()) == []


def test_the_summary_merges_the_rows_of_the_last_step(tmp_path: Path) -> None:
    """A step whose evaluation a preemption cut short gets it as a row of its own on resume
    (docs/evaluation.md): the summary's metrics are that step's rows merged, not the evaluation's alone."""
    from launch.result import run_summary

    rows = [{"step": 0, "reward/mean": 0.1}, {"step": 1, "reward/mean": 0.5, "timing/step_s": 2.0},
            {"step": 1, "val/reward_mean": 0.75, "timing/eval_s": 1.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 2, "rew')
    (tmp_path / "final.json").write_text(json.dumps({"policy_sha256": "ab", "num_steps": 2}))
    summary = run_summary(tmp_path)
    assert summary["last_step"] == 1 and summary["metrics"] == {**rows[1], **rows[2]}
