"""`hpcrl submit/status/logs/cancel` against the real local Slurm cluster (tests/slurm/cluster.sh).

(a) the CPU example submitted as a heterogeneous job learns exactly as `hpcrl run` does (same
per-step rewards, same final policy hash); (e) its one MPI world spans both components: the
controller and trainer ranks run on component 0's node, the rollout rank on component 1's (read
from each live rank's environment through /proc, since all virtual nodes share this host);
(c) `hpcrl cancel` ends a running job and every rank, and `hpcrl logs -f` stops cleanly on Ctrl-C;
(d) bad inputs fail before submission with one clear line and no job reaches Slurm.
Each real job costs 20-60 s on the 2-core machine, so the tests submit as few as possible.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import submitit
from submitit.core.utils import FailedJobError

from hpcrl.cli import main
from hpcrl.config import load_job
from hpcrl.jobs import Executor, attach
from launch.procs import process_gone
from launch.slurm_query import cluster_partitions, parse_records
from launch.slurm_spec import render
from launch.slurm_submit import default_partition, job_spec

pytestmark = pytest.mark.slurm
REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
STEPS = 2
QUIET = ["--set", "logging.progress=false", "--set", "logging.tensorboard=false",
         "--set", "resources.startup_timeout_s=150"]  # a world that never forms is retried after this


def hpcrl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """The real CLI in a subprocess (what a user types), under a hard timeout."""
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def submit(slurm, *args: str) -> tuple[str, subprocess.CompletedProcess]:
    proc = hpcrl("submit", str(EXAMPLE), *args)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"^submitted job (\d+) ", proc.stdout, re.MULTILINE).group(1)
    slurm.job_ids.append(job_id)  # cancelled at teardown if a test fails half-way
    return job_id, proc


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def rank_environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def slurm_out(*args: str) -> str:
    return subprocess.run(list(args), capture_output=True, text=True, timeout=30).stdout


def jobs_named(name: str) -> list[dict[str, str]]:
    """Every job Slurm knows with this name, pending, running or finished (scontrol keeps those)."""
    return [r for r in parse_records(slurm_out("scontrol", "-o", "show", "job")) if r.get("JobName") == name]


@pytest.mark.timeout(600)
def test_submitted_hetjob_matches_hpcrl_run_and_spans_both_components(slurm, job_dir: Path) -> None:
    common = ["--set", f"algorithm.num_steps={STEPS}", *QUIET]
    local_dir, run_dir = job_dir / "local", job_dir / "slurm"
    # The local reference runs first, not beside the Slurm job: two MPI worlds starting at once on
    # this host are a suspect of the MPI_Init hangs seen in CI (dev/LOG.md).
    local = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "run", str(EXAMPLE), *common,
                              "--run-dir", str(local_dir)],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    try:
        local_out, _ = local.communicate(timeout=300)
        # the engine spans both rollout nodes (rollout.nodes_per_engine=2): node 0 on the first,
        # its follower on the second; the local run's engine has one node
        het = [*common, "--set", "resources.rollout_nodes=2", "--set", "rollout.nodes_per_engine=2",
               "--run-dir", str(run_dir)]
        job_id, sub = submit(slurm, *het)
        for line in (f"run dir: {run_dir}", f"hpcrl status {run_dir}", f"hpcrl logs {run_dir} -f",
                     f"hpcrl cancel {run_dir}"):
            assert line in sub.stdout, sub.stdout
        assert ("4 ranks; component 0: 1 node, controller + 1 trainer rank | "
                "component 1: 2 nodes, 2 rollout ranks") in sub.stdout
        record = json.loads((run_dir / "slurm.json").read_text())
        assert record["job_id"] == job_id and record["template"] == "hetjob.sbatch.j2"
        # `hpcrl render` prints exactly the script that was submitted
        assert hpcrl("render", str(EXAMPLE), *het).stdout == (run_dir / "job.sbatch").read_text()
        follower = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "logs", str(run_dir), "-f"],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            # (e) while the ranks live: which node (component) each one runs on
            ranks = slurm.wait_until("the controller to write .ranks.json",
                                     lambda: json.loads((run_dir / ".ranks.json").read_text())
                                     if (run_dir / ".ranks.json").exists() else None, 240, job_id)
            placed = {r["rank"]: (r["role"], rank_environment(r["pid"])) for r in ranks}
            status = hpcrl("status", str(run_dir), timeout=60)
            components = {int(c["HetJobOffset"]): slurm_out("scontrol", "show", "hostnames",
                                                            c["NodeList"]).split() for c in slurm.job(job_id)}
            final = slurm.wait_final(job_id, timeout_s=300)
            out, err = follower.communicate(timeout=60)
        finally:
            follower.kill()
    finally:
        local.kill()
    attempt_log = (run_dir / "logs" / f"{job_id}-attempt0.log").read_text()
    assert final["JobState"] == "COMPLETED", f"{final}\n{attempt_log}"
    assert local.returncode == 0, local_out
    # the world formed (rank 0's marker), so a failure after this point would not have been retried
    assert (run_dir / ".hpcrl_world_formed").exists() and "of 2)" in (run_dir / "job.sbatch").read_text()

    # (e) one MPI world of 4 over both components: rank 0 controller and rank 1 trainer on
    # component 0's node, rollout ranks 2 and 3 (the engine's node 0 and its follower) on component
    # 1's two nodes, all in this job's one step
    assert (len(components[0]), len(components[1])) == (1, 2)
    assert not set(components[0]) & set(components[1])
    assert {r: (role, env["SLURMD_NODENAME"], env["SLURM_PROCID"], env["SLURM_NTASKS"])
            for r, (role, env) in placed.items()} == {
        0: ("controller", components[0][0], "0", "4"), 1: ("trainer", components[0][0], "1", "4"),
        2: ("rollout", components[1][0], "2", "4"), 3: ("rollout", components[1][1], "3", "4")}
    assert {env["SLURM_JOB_ID"] for _, env in placed.values()} == {job_id}
    assert "world     4 ranks (controller 0; trainer 1; rollout 2,3)" in status.stdout, status.stdout
    node_log = (run_dir / "logs" / "engine0-node1.log").read_text()  # joined node 0 on the other node
    assert "node 1 ready on http://" in node_log and "stopped by node 0" in node_log, node_log
    assert f"job       {job_id} RUNNING" in status.stdout and " left" in status.stdout, status.stdout

    # (a) same rewards step by step and the same final policy as `hpcrl run`
    local_rewards = [m["reward/mean"] for m in metrics(local_dir)]
    slurm_rewards = [m["reward/mean"] for m in metrics(run_dir)]
    assert len(slurm_rewards) == STEPS and slurm_rewards == local_rewards
    digest = json.loads((local_dir / "final.json").read_text())["policy_sha256"]
    assert json.loads((run_dir / "final.json").read_text())["policy_sha256"] == digest

    # logs -f followed the attempt to its end and stopped by itself
    assert follower.returncode == 0, err
    assert f"==> {run_dir}/logs/{job_id}-attempt0.log <==" in out and f"policy sha256: {digest}" in out
    assert f"job {job_id} ended: COMPLETED" in err
    done = hpcrl("status", str(run_dir), timeout=60).stdout
    assert f"{job_id} COMPLETED, exit code 0:0" in done and f"step {STEPS}/{STEPS} done" in done, done
    assert f"finished  policy sha256 {digest}" in done

    # the job is a submitit job: plain submitit re-attached by folder and id gets the run's summary,
    # hpcrl.jobs.attach the same state; stdout() is the attempt's step log
    summary = submitit.SlurmJob(run_dir / "logs", job_id).result()
    assert summary["policy_sha256"] == digest and summary["last_step"] == STEPS - 1
    job = attach(run_dir)
    assert (job.job_id, job.state, job.restarts, job.done()) == (job_id, "COMPLETED", 0, True)
    assert f"policy sha256: {digest}" in job.stdout() and "step exited with code 0" in job.stderr()


@pytest.mark.timeout(300)
def test_cancel_ends_the_job_and_every_rank(slurm, job_dir: Path) -> None:
    run_dir = job_dir / "run"
    # Submitted through the Python API, to start after another job (afterok); the CLI handles it the same
    blocker = slurm.submit(None, "-o", "/dev/null", "--job-name", "hpcrl-first", "--wrap", "sleep 5")
    quiet = [o for o in QUIET if o != "--set"]
    job = Executor(kind="slurm").submit(EXAMPLE, ["algorithm.num_steps=500", *quiet], run_dir=run_dir,
                                        after=[blocker])
    job_id = job.job_id
    slurm.job_ids.append(job_id)
    waiting = slurm.job(job_id)[0]
    assert waiting["Dependency"].startswith(f"afterok:{blocker}"), waiting
    assert (waiting["JobState"], waiting["Reason"]) == ("PENDING", "Dependency") and job.state == "PENDING"
    assert json.loads((run_dir / "slurm.json").read_text())["dependency"] == [blocker]
    ranks = slurm.wait_until("the ranks to start", lambda: json.loads((run_dir / ".ranks.json").read_text())
                             if (run_dir / ".ranks.json").exists() else None, 240, job_id)
    assert [r["role"] for r in ranks] == ["controller", "trainer", "rollout"]
    # Ctrl-C of `hpcrl logs -f` ends it quietly (exit 130, no traceback) and leaves the job alone.
    # SIGINT at its default disposition, as from a terminal: a shell's background jobs (nohup ... &)
    # inherit it ignored, and a Python started so installs no KeyboardInterrupt handler.
    follower = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "logs", str(run_dir), "-f"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        header = follower.stdout.readline()  # blocks until the follower runs and found the log
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=30)
    finally:
        follower.kill()
    assert header == f"==> {run_dir}/logs/{job_id}-attempt0.log <==\n"
    assert follower.returncode == 130 and "Traceback" not in err, err
    assert slurm.state(job_id) == "RUNNING"

    cancel = hpcrl("cancel", str(run_dir), timeout=120)
    assert cancel.returncode == 0, cancel.stderr
    assert cancel.stdout.strip() == f"cancelled job {job_id} (CANCELLED); run dir {run_dir}"
    slurm.wait_until("every rank to exit", lambda: all(process_gone(r["pid"]) for r in ranks), 60, job_id)
    time.sleep(3)  # a requeue (which cancel must not cause) would show by now
    assert slurm.state(job_id) == "CANCELLED"
    assert slurm_out("squeue", "-h", "-j", job_id).strip() == ""
    job = attach(run_dir)  # the submitit view of the same job
    assert job.state == "CANCELLED" and job.done(force_check=True)
    # the batch script wrote the outcome as Slurm began to end the job (the ranks were still saving):
    # result() raises at once and names Slurm's final state
    with pytest.raises(FailedJobError, match=f"^hpcrl job {job_id} ended CANCELLED") as err:
        job.result()
    assert "it was cancelled (scancel, hpcrl cancel) or reached its time limit" in str(err.value)
    again = hpcrl("cancel", job_id, timeout=60)  # RUN may also be the job id
    assert again.returncode == 0
    assert again.stdout.strip() == f"job {job_id} already ended (CANCELLED); nothing to cancel"


WORLD_PROGRAM = """
import json, os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
rec = {"rank": comm.Get_rank(), "size": comm.Get_size(), "node": os.environ["SLURMD_NODENAME"]}
with open(os.path.join(sys.argv[1], f"rank-{rec['rank']}.json"), "w") as f:
    json.dump(rec, f)
"""


@pytest.mark.timeout(120)
def test_uneven_layout_starts_the_world_the_config_asks_for(slurm, job_dir: Path) -> None:
    # 1 controller + 2 trainer ranks on 2 nodes (2 + 1, pinned with --ntasks=3), 1 rollout rank on a
    # third node; the job's own command is swapped for a program that reports the MPI world.
    job = load_job(EXAMPLE, ["resources.nodes=2", "trainer.num_procs=2", "resources.rollout_nodes=1"])
    spec, _, _ = job_spec(job, job_dir, default_partition(cluster_partitions()))
    assert spec.components[0].extra_sbatch_options == ("--ntasks=3",)
    (job_dir / "world.py").write_text(WORLD_PROGRAM)
    (job_dir / "logs").mkdir()
    script = job_dir / "job.sbatch"
    report_world = f"{sys.executable} {job_dir}/world.py {job_dir}"
    script.write_text(render(dataclasses.replace(spec, command=report_world)))
    job_id = slurm.submit(script)
    record = slurm.wait_final(job_id, timeout_s=90)
    assert record["JobState"] == "COMPLETED", (job_dir / "logs" / f"{job_id}-attempt0.log").read_text()
    ranks = sorted((json.loads(p.read_text()) for p in job_dir.glob("rank-*.json")), key=lambda r: r["rank"])
    assert [(r["rank"], r["size"]) for r in ranks] == [(i, job.world_size) for i in range(4)]
    rollout_node = next(c["NodeList"] for c in slurm.job(job_id) if c["HetJobOffset"] == "1")
    nodes = [r["node"] for r in ranks]
    assert nodes[0] == nodes[1] != nodes[2] and rollout_node not in nodes[:3] and nodes[3] == rollout_node
    # The batch script wrote the outcome for submitit: this program is no hpcrl run (no final.json),
    # so result() raises, saying what is missing, instead of returning or waiting
    with pytest.raises(FailedJobError, match="exited with code 0 but .*final.json is missing"):
        submitit.SlurmJob(job_dir / "logs", job_id).result()


def cluster_max(field: str) -> int:
    """The largest per-node CPU or GPU count of the debug partition (`sinfo` %c / %G)."""
    out = slurm_out("sinfo", "-h", "-N", "-p", "debug", "-o", "%c %G").split("\n")
    values = []
    for line in filter(None, out):
        cpus, gres = line.split()
        values.append(int(cpus) if field == "cpus" else sum(int(g.split(":")[-1].split("(")[0])
                                                             for g in gres.split(",") if g.startswith("gpu")))
    return max(values)


BAD_INPUTS = {
    "unknown partition": (["slurm.partition=nosuch"],
                          "slurm.partition='nosuch': no such partition on this cluster"),
    "more nodes than exist": (["resources.rollout_nodes=4", "rollout.num_engines=4"],
                              "resources.rollout_nodes=4: the job needs resources.nodes=1 + "
                              "rollout_nodes=4 = 5 nodes"),
    "more gpus than exist": (["resources.device=cuda", "resources.gpus_per_node={gpus}"],
                             "resources.gpus_per_node={gpus}: no node of partition debug has {gpus} GPUs"),
    "more cpus than exist": (["resources.cpus_per_rank={cpus}"],
                             "resources.cpus_per_rank={cpus}: component 0"),
    "invalid time format": (["slurm.time='1:2:3:4'"], "slurm.time='1:2:3:4': not a Slurm time limit"),
    "unwritable run dir": ([], "--run-dir='{run_dir}': cannot create or write it"),
    "missing sbatch": ([], "sbatch='not found': hpcrl needs Slurm's client tools on PATH"),
    "resume from a missing checkpoint": ([], "--resume-from=3: no complete checkpoint at that step"),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_inputs_fail_before_submission(case, job_dir: Path, tmp_path: Path, capsys, monkeypatch) -> None:
    overrides, expected = BAD_INPUTS[case]
    name = f"hpcrl-bad-{case.replace(' ', '-')}-{uuid.uuid4().hex[:8]}"
    facts = {"gpus": cluster_max("gpus") + 1, "cpus": cluster_max("cpus") + 1}
    run_dir = job_dir / "run"
    if case == "unwritable run dir":
        (job_dir / "file").write_text("a file, not a directory")
        run_dir = job_dir / "file" / "run"
    if case == "missing sbatch":
        monkeypatch.setenv("PATH", str(tmp_path))
    argv = ["submit", str(EXAMPLE), "--set", f"name={name}", "--run-dir", str(run_dir)]
    for o in overrides:
        argv += ["--set", o.format(**facts)]
    if case == "resume from a missing checkpoint":
        argv += ["--resume-from", "3"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith("hpcrl submit: error: " + expected.format(**facts, run_dir=run_dir)), lines[0]
    monkeypatch.undo()  # Slurm's tools again, to look at the queue
    assert jobs_named(name) == []
    assert not (run_dir / "slurm.json").exists() and not (run_dir / "job.sbatch").exists()


@pytest.mark.timeout(180)
def test_dry_run_asks_slurm_and_submits_nothing(job_dir: Path, capsys) -> None:
    """`submit --dry-run` (also over a sweep): every check of submit, then Slurm's own verdict on the
    script (sbatch --test-only); no job, no run dir. A constraint no node has passes hpcrl's checks
    and is refused by Slurm: exit 2 with Slurm's reason."""
    name = f"hpcrl-dry-run-{uuid.uuid4().hex[:8]}"
    run_dir = job_dir / "run"
    argv = ["submit", str(EXAMPLE), "--set", f"name={name}", "--run-dir", str(run_dir), "--dry-run"]
    assert main([*argv, "--set", "resources.rollout_nodes=1", "--sweep", "algorithm.lr=1e-3,2e-3"]) == 0
    out = capsys.readouterr().out
    assert out.count(f"dry run: {name} algorithm.lr=") == 2, out
    assert "(3 ranks; component 0: 1 node, controller + 1 trainer rank | component 1: 1 node, 1 rollout rank) " \
           "to partition debug" in out, out
    assert len(re.findall(r"^  sbatch --test-only: Job \d+ to start at ", out, re.MULTILINE)) == 2, out
    assert main([*argv, "--set", 'slurm.extra_sbatch_options=["--constraint=h100"]']) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and captured.out == "", captured
    assert lines[0].startswith("hpcrl submit: error: sbatch --test-only='the job script (hpcrl render prints "
                               "it)': Slurm would refuse the job: ") and "Invalid feature specification" in lines[0]
    assert jobs_named(name) == [] and not run_dir.exists()
    # what the real submit refuses when it creates the run dir, the dry run refuses too (nothing created)
    (job_dir / "file").write_text("a file, not a directory")
    for args, refused in ((["--run-dir", str(job_dir / "file")], f"--run-dir='{job_dir / 'file'}'"),
                          (["--set", f"checkpoint.dir={job_dir / 'file' / 'ck'}"], "checkpoint.dir=")):
        assert main([*argv, *args]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"hpcrl submit: error: {refused}") and "cannot create or write it" in err, err
    assert not run_dir.exists()


@pytest.mark.timeout(240)
def test_pipeline_second_job_starts_from_the_first_job_s_export(slurm, job_dir: Path) -> None:
    # about 15 s: two small single-component jobs, the second waits (afterok) on the first's export
    from checkpoints.hf_safetensors import dir_digest

    quiet = [o for o in QUIET if o != "--set"]
    ex, export = Executor(kind="slurm"), job_dir / "first_export"
    first = ex.submit(EXAMPLE, [f"algorithm.num_steps={STEPS}", *quiet], run_dir=job_dir / "first",
                      export_to=export)
    slurm.job_ids.append(first.job_id)
    assert not export.exists()  # checked and submitted before the export exists
    second = ex.submit(EXAMPLE, ["algorithm.num_steps=1", f"model.path={export}", *quiet],
                       run_dir=job_dir / "second", after=[first])
    slurm.job_ids.append(second.job_id)
    assert slurm.job(second.job_id)[0]["Dependency"].startswith(f"afterok:{first.job_id}")
    summary = first.result()
    assert summary["export_dir"] == str(export) and dir_digest(export) == summary["policy_sha256"]
    assert "[hpcrl-batch] exported to" in first.stderr()
    assert second.result()["last_step"] == 0
    assert slurm.wait_final(second.job_id, timeout_s=60)["JobState"] == "COMPLETED"  # result lands first
    assert json.loads((job_dir / "second" / "config.json").read_text())["model"]["path"] == str(export)
