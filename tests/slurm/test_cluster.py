"""Smoke tests of the real local Slurm cluster and of hpcrl's rendered sbatch scripts running on it.

Needs `tests/slurm/cluster.sh start` (skipped otherwise, see conftest.py). Covers what hpcrl relies
on: plain batch jobs, fake GPUs, a heterogeneous job whose single `srun --het-group=0,1 --mpi=pmi2`
step is one MPI world over both components (PyPI mpi4py + mpich from this venv), preemption of a
`debug` job by a `high` job (USR1 to the batch shell, requeue, restart with SLURM_RESTART_COUNT=1),
and the templates' own signal -> requeue-exit-code -> `scontrol requeue` -> resume path.
Timings on a 2-core VM: preemption restarts take 15-60 s (30 s controller timer + requeue delay).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import pytest

from launch.result import REQUEUE_EXIT_CODE
from launch.slurm_spec import SlurmComponent, SlurmJobSpec, render

pytestmark = pytest.mark.slurm
PYTHON = sys.executable  # the project venv: mpi4py + PyPI mpich, usable by jobs on this host
WORLD_DEADLINE_S = 30  # MPI_Init of the programs below takes a few seconds; see with_world_retry

WORLD_PROGRAM = """
import faulthandler, json, os, sys
faulthandler.dump_traceback_later({deadline}, exit=True)  # see with_world_retry
from mpi4py import MPI
comm = MPI.COMM_WORLD
rec = {"rank": comm.Get_rank(), "size": comm.Get_size(), "node": os.environ["SLURMD_NODENAME"],
       "sum": comm.allreduce(comm.Get_rank()), "attempt": os.environ.get("HPCRL_ATTEMPT")}
faulthandler.cancel_dump_traceback_later()
if rec["rank"] == 0:
    open(os.path.join(sys.argv[1], ".hpcrl_world_formed"), "w").close()
with open(os.path.join(sys.argv[1], f"rank-{rec['rank']}-attempt-{rec['attempt']}.json"), "w") as f:
    json.dump(rec, f)
"""

# A stand-in for hpcrl's controller and workers: on attempt 0 every rank waits for USR1 or TERM
# (forwarded by the batch script), rank 0 "checkpoints", and the step exits with the requeue code
# (hpcrl's one constant); on the next attempt every rank checks the checkpoint and exits 0.
PREEMPTABLE_PROGRAM = """
import os, signal, sys, time
from mpi4py import MPI
comm = MPI.COMM_WORLD
rank, out = comm.Get_rank(), sys.argv[1]
attempt = int(os.environ["HPCRL_ATTEMPT"])
got = []
for sig in (signal.SIGUSR1, signal.SIGTERM):
    signal.signal(sig, lambda s, f: got.append(signal.Signals(s).name))
print(f"rank={rank} size={comm.Get_size()} node={os.environ['SLURMD_NODENAME']} attempt={attempt}", flush=True)
if attempt == 0:
    open(os.path.join(out, f"ready-{rank}"), "w").close()
    deadline = time.monotonic() + 120
    while not got and time.monotonic() < deadline:
        time.sleep(0.1)
    comm.Barrier()
    if rank == 0:
        with open(os.path.join(out, "checkpoint"), "w") as f:
            f.write("step-7")
    print(f"rank={rank} signal={got[0] if got else None}", flush=True)
    sys.exit({requeue} if got else 1)
comm.Barrier()
with open(os.path.join(out, "checkpoint")) as f:
    print(f"rank={rank} resumed_from={f.read()}", flush=True)
""".replace("{requeue}", str(REQUEUE_EXIT_CODE))


def read_json_records(directory: Path, pattern: str) -> list[dict]:
    return sorted((json.loads(p.read_text()) for p in directory.glob(pattern)), key=lambda r: r["rank"])


@pytest.mark.timeout(90)
def test_trivial_batch_job_completes(slurm, job_dir: Path) -> None:
    out = job_dir / "hello.out"
    job_id = slurm.submit(None, "-o", str(out), "-t", "2", "--wrap", 'echo "hello from $SLURM_JOB_ID on $SLURMD_NODENAME"')
    record = slurm.wait_final(job_id, timeout_s=60)
    assert record["JobState"] == "COMPLETED", record
    assert record["ExitCode"] == "0:0"
    text = out.read_text()
    assert text.startswith(f"hello from {job_id} on ") and text.strip().split()[-1] in slurm.nodes()


@pytest.mark.timeout(90)
def test_fake_gpus_are_bound_by_gres(slurm, job_dir: Path) -> None:
    gres = slurm.gres()
    if not any(g.startswith("gpu:") for g in gres):
        pytest.skip(f"the cluster's debug partition has no gpu gres (sinfo %G: {sorted(gres)})")
    out = job_dir / "gpus.out"
    job_id = slurm.submit(None, "-o", str(out), "-t", "2", "-N1", "-n2", "--gpus-per-task=1",
                          "--wrap", "srun -l bash -c 'echo CUDA_VISIBLE_DEVICES=$CUDA_VISIBLE_DEVICES'")
    assert slurm.wait_final(job_id, timeout_s=60)["JobState"] == "COMPLETED"
    devices = sorted(line.split("=", 1)[1] for line in out.read_text().split("\n") if "CUDA_VISIBLE_DEVICES=" in line)
    assert devices == ["0", "1"], out.read_text()


@pytest.mark.timeout(170)
def test_hetjob_step_is_one_mpi_world_over_both_components(slurm, job_dir: Path) -> None:
    (job_dir / "world.py").write_text(WORLD_PROGRAM.replace("{deadline}", str(WORLD_DEADLINE_S)))
    script = job_dir / "het.sbatch"
    # Hand-written, with with_world_retry's rule in bash: up to three tries while no world formed
    script.write_text(
        "#!/bin/bash\n"
        f"#SBATCH --nodes=1 --ntasks-per-node=2 --time=3 --output={job_dir}/het-%j.out\n"
        "#SBATCH hetjob\n"
        "#SBATCH --nodes=1 --ntasks-per-node=1 --time=3\n"
        f"{PYTHON} -c 'from hpcrl.controller.preemption import slurm_end_time as t; print(\"end time\", t())'\n"
        "for attempt in 0 1 2; do\n"
        f"  srun --het-group=0,1 --mpi=pmi2 --kill-on-bad-exit=1 {PYTHON} {job_dir}/world.py {job_dir} "
        "&& exit 0\n"
        f"  [ -e {job_dir}/.hpcrl_world_formed ] && exit 1\n"
        "done\n"
        "exit 1\n")
    job_id = slurm.submit(script)
    components = slurm.job(job_id)
    assert len(components) == 2, components
    record = slurm.wait_final(job_id, timeout_s=150)
    log = next(job_dir.glob("het-*.out")).read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{log}"
    # squeue prints a hetjob's end time once per component: it was read as None, and the save before
    # the time limit never fired for hetjobs
    end = float(log.split("end time ", 1)[1].split()[0])
    assert 0 < end - time.time() < 4 * 60, log
    nodes = {int(c["HetJobOffset"]): c["NodeList"] for c in slurm.job(job_id)}
    assert nodes[0] != nodes[1]
    ranks = read_json_records(job_dir, "rank-*.json")
    assert [r["rank"] for r in ranks] == [0, 1, 2], log
    assert {r["size"] for r in ranks} == {3}
    assert {r["sum"] for r in ranks} == {0 + 1 + 2}
    # srun places the tasks of component 0 first: ranks 0-1 on its node, rank 2 on component 1's node
    assert [r["node"] for r in ranks] == [nodes[0], nodes[0], nodes[1]]


@pytest.mark.timeout(240)
def test_preemption_signals_batch_shell_and_requeues(slurm, job_dir: Path) -> None:
    if not {"debug", "high"} <= slurm.partitions():
        pytest.skip("needs the local cluster's partitions `debug` (preemptable) and `high`")
    node = slurm.nodes()[-1]
    marker = job_dir / "marker"
    low = job_dir / "low.sbatch"
    low.write_text(
        "#!/bin/bash\n"
        f"#SBATCH -p debug -w {node} --exclusive --time=5 --requeue --signal=B:USR1@30\n"
        f"#SBATCH --output={job_dir}/low-%j.out --open-mode=append\n"
        "n=${SLURM_RESTART_COUNT:-0}\n"
        f"trap 'echo \"usr1 restart=$n\" >> {marker}' USR1\n"
        f"echo \"start restart=$n\" >> {marker}\n"
        "(( n >= 1 )) && exit 0\n"
        # keeps running after USR1: Slurm itself must kill and requeue it at the end of GraceTime
        "for i in $(seq 600); do sleep 0.2; done\n"
        "exit 1\n")
    low_id = slurm.submit(low)
    slurm.wait_until("the low-priority job to start", lambda: marker.exists(), 60, low_id)
    high_id = slurm.submit(None, "-p", "high", "-w", node, "--exclusive", "-t", "2",
                           "-o", str(job_dir / "high-%j.out"), "--wrap", "sleep 2")
    slurm.wait_until("USR1 in the preempted batch shell", lambda: "usr1 restart=0" in marker.read_text(), 30, low_id)
    record = slurm.wait_final(low_id, timeout_s=180)
    assert record["JobState"] == "COMPLETED", record
    assert record["Restarts"] == "1"
    assert marker.read_text().splitlines() == ["start restart=0", "usr1 restart=0", "start restart=1"]
    assert slurm.wait_final(high_id, timeout_s=60)["JobState"] == "COMPLETED"


def with_world_retry(spec: SlurmJobSpec) -> SlurmJobSpec:
    """`spec` retried as hpcrl submit retries a step whose MPI world never formed: srun's pmi2 plugin
    cuts a long PMI-1 put (dev/LOG.md, session 11), and then a rank aborts in MPI_Init or every rank
    waits there for good. As hpcrl's ranks do (`worker_main.join_world_within`), the programs end
    themselves when MPI_Init has not returned within WORLD_DEADLINE_S, and rank 0 writes
    .hpcrl_world_formed once it has; kill-on-bad-exit ends the step at the first rank that fails
    (these programs never exit to be requeued)."""
    return dataclasses.replace(spec, world_retries=2, extra_srun_options=("--kill-on-bad-exit=1",))


def make_spec(job_dir: Path, components: tuple[SlurmComponent, ...], command: str) -> SlurmJobSpec:
    (job_dir / "logs").mkdir(exist_ok=True)
    return SlurmJobSpec(job_name="hpcrl-test", partition="debug", time_limit_min=5, components=components,
                        command=command, run_dir=str(job_dir), log_dir=str(job_dir / "logs"), signal_delay_s=30)


@pytest.mark.timeout(240)
def test_rendered_hetjob_forwards_preemption_and_resumes(slurm, job_dir: Path) -> None:
    if not {"debug", "high"} <= slurm.partitions():
        pytest.skip("needs the local cluster's partitions `debug` (preemptable) and `high`")
    (job_dir / "prog.py").write_text(PREEMPTABLE_PROGRAM)
    spec = make_spec(job_dir, (SlurmComponent(nodes=1, ntasks_per_node=2), SlurmComponent(nodes=1, ntasks_per_node=1)),
                     f"{PYTHON} {job_dir}/prog.py {job_dir}")
    script = job_dir / "job.sbatch"
    script.write_text(render(spec))
    job_id = slurm.submit(script)
    slurm.wait_until("every rank of attempt 0 to start",
                     lambda: all((job_dir / f"ready-{r}").exists() for r in range(3)), 90, job_id)
    # Preempt through the rollout component's node: the warning must still reach the batch shell,
    # which runs in component 0.
    rollout_node = next(c["NodeList"] for c in slurm.job(job_id) if c["HetJobOffset"] == "1")
    slurm.submit(None, "-p", "high", "-w", rollout_node, "--exclusive", "-t", "2",
                 "-o", str(job_dir / "high-%j.out"), "--wrap", "sleep 2")
    record = slurm.wait_final(job_id, timeout_s=180)
    logs = job_dir / "logs"
    batch_log = (logs / f"slurm-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED", f"{record}\n{batch_log}"
    assert record["Restarts"] == "1"
    assert "received SIGUSR1; forwarding SIGUSR1 to the step's tasks" in batch_log
    assert "the step asked to be requeued (exit code 3)" in batch_log
    assert f"job {job_id} attempt 1 " in batch_log
    first = (logs / f"{job_id}-attempt0.log").read_text()
    second = (logs / f"{job_id}-attempt1.log").read_text()
    assert sorted(line for line in first.splitlines() if "signal=" in line) == [
        f"rank={r} signal=SIGUSR1" for r in range(3)]
    assert sorted(line for line in second.splitlines() if "resumed_from=" in line) == [
        f"rank={r} resumed_from=step-7" for r in range(3)]
    assert all(f"rank={r} size=3 " in second for r in range(3))


@pytest.mark.timeout(240)
def test_rendered_single_job_runs_world_and_propagates_failure(slurm, job_dir: Path) -> None:
    (job_dir / "world.py").write_text(WORLD_PROGRAM.replace("{deadline}", str(WORLD_DEADLINE_S)))
    spec = with_world_retry(make_spec(job_dir, (SlurmComponent(nodes=2, ntasks_per_node=2),),
                                      f"{PYTHON} {job_dir}/world.py {job_dir}"))
    ok = job_dir / "ok.sbatch"
    ok.write_text(render(spec))
    bad = job_dir / "bad.sbatch"
    bad.write_text(render(make_spec(job_dir, spec.components, "bash -c 'exit 5'")))
    ok_id, bad_id = slurm.submit(ok), slurm.submit(bad)
    ok_record, bad_record = slurm.wait_final(ok_id, 150), slurm.wait_final(bad_id, 90)  # 150: room for a retry
    assert ok_record["JobState"] == "COMPLETED", ok_record
    ranks = read_json_records(job_dir, "rank-*-attempt-0.json")
    assert [(r["rank"], r["size"]) for r in ranks] == [(i, 4) for i in range(4)]
    assert len({r["node"] for r in ranks}) == 2
    assert bad_record["JobState"] == "FAILED" and bad_record["ExitCode"] == "5:0", bad_record
    assert "step exited with code 5" in (job_dir / "logs" / f"slurm-{bad_id}.out").read_text()


@pytest.mark.timeout(180)
def test_rendered_single_job_forwards_term_and_resumes(slurm, job_dir: Path) -> None:
    # Clusters without preempt_send_user_signal only send TERM; the batch script must forward it to
    # the ranks without srun killing the step, and requeue on the step's requeue exit code.
    (job_dir / "prog.py").write_text(PREEMPTABLE_PROGRAM)
    spec = make_spec(job_dir, (SlurmComponent(nodes=1, ntasks_per_node=2),), f"{PYTHON} {job_dir}/prog.py {job_dir}")
    script = job_dir / "job.sbatch"
    script.write_text(render(spec))
    job_id = slurm.submit(script)
    slurm.wait_until("every rank of attempt 0 to start",
                     lambda: all((job_dir / f"ready-{r}").exists() for r in range(2)), 90, job_id)
    slurm.signal_batch(job_id, "TERM")
    record = slurm.wait_final(job_id, timeout_s=120)
    logs = job_dir / "logs"
    batch_log = (logs / f"slurm-{job_id}.out").read_text()
    assert record["JobState"] == "COMPLETED" and record["Restarts"] == "1", f"{record}\n{batch_log}"
    assert "received SIGTERM; forwarding SIGTERM to the step's tasks" in batch_log
    first = (logs / f"{job_id}-attempt0.log").read_text()
    assert sorted(line for line in first.splitlines() if "signal=" in line) == [
        f"rank={r} signal=SIGTERM" for r in range(2)], first
    second = (logs / f"{job_id}-attempt1.log").read_text()
    assert sorted(line for line in second.splitlines() if "resumed_from=" in line) == [
        f"rank={r} resumed_from=step-7" for r in range(2)]


# A step whose first try dies before the "world" forms (no .hpcrl_world_formed in the run dir, as
# when srun's pmi2 plugin garbles a PMI-1 put and a rank aborts in MPI_Init) and whose second try
# forms it and succeeds; and a step that formed its world and then failed.
UNFORMED_THEN_OK = """
import os, sys
tries = len(os.listdir(sys.argv[1] + "/tries")) if os.path.isdir(sys.argv[1] + "/tries") else 0
os.makedirs(sys.argv[1] + "/tries", exist_ok=True)
netmod = os.environ.get("MPIR_CVAR_CH4_NETMOD", "default")
open(f"{sys.argv[1]}/tries/{tries}-{os.environ['SLURM_PROCID']}-{netmod}", "w").close()
if tries == 0:
    sys.exit(7)
open(".hpcrl_world_formed", "w").close()
"""


@pytest.mark.timeout(180)
def test_rendered_step_is_retried_only_when_its_world_never_formed(slurm, job_dir: Path) -> None:
    from launch.slurm_spec import WORLD_FORMED_FILE

    assert WORLD_FORMED_FILE == ".hpcrl_world_formed"  # the name the template removes and checks
    (job_dir / "prog.py").write_text(UNFORMED_THEN_OK)
    one = (SlurmComponent(nodes=1, ntasks_per_node=1),)
    retried = dataclasses.replace(make_spec(job_dir, one, f"{PYTHON} {job_dir}/prog.py {job_dir}"), world_retries=2)
    (job_dir / "retried.sbatch").write_text(render(retried))
    formed_then_failed = dataclasses.replace(
        make_spec(job_dir, one, "bash -c 'touch .hpcrl_world_formed; exit 5'"), world_retries=2)
    (job_dir / "failed.sbatch").write_text(render(formed_then_failed))
    ok_id = slurm.submit(job_dir / "retried.sbatch")
    record = slurm.wait_final(ok_id, 90)
    log = (job_dir / "logs" / f"slurm-{ok_id}.out").read_text()
    assert record["JobState"] == "COMPLETED", (record, log)
    assert "step exited with code 7" in log and "starting the step again (retry 1 of 2)" in log, log
    assert sorted(os.listdir(job_dir / "tries")) == ["0-0-default", "1-0-ofi"]  # the retry on ofi
    # The world formed on ofi: a later attempt in this run dir (a requeue) starts on it.
    assert (job_dir / ".hpcrl_netmod").read_text() == "ofi\n"
    again_id = slurm.submit(job_dir / "retried.sbatch")
    again = slurm.wait_final(again_id, 90)
    again_log = (job_dir / "logs" / f"slurm-{again_id}.out").read_text()
    assert again["JobState"] == "COMPLETED", (again, again_log)
    assert "starting on MPIR_CVAR_CH4_NETMOD=ofi" in again_log, again_log
    assert sorted(os.listdir(job_dir / "tries")) == ["0-0-default", "1-0-ofi", "2-0-ofi"]
    bad_id = slurm.submit(job_dir / "failed.sbatch")
    bad = slurm.wait_final(bad_id, 90)
    bad_log = (job_dir / "logs" / f"slurm-{bad_id}.out").read_text()
    assert bad["JobState"] == "FAILED" and bad["ExitCode"] == "5:0", bad
    assert "starting the step again" not in bad_log, bad_log
    # A site's env_setup with `set -eu` and a `cd`: the script went on (it ended at the step's exit
    # code, where a 3 was not requeued) and checked the world file in the run dir (it looked in the
    # other directory and retried a step whose world had formed, twice).
    site = dataclasses.replace(
        make_spec(job_dir, one, f"bash -c 'touch {job_dir}/.hpcrl_world_formed; exit 5'"), world_retries=2,
        env_setup=("set -euo pipefail", "cd /tmp"))
    (job_dir / "site.sbatch").write_text(render(site))
    site_id = slurm.submit(job_dir / "site.sbatch")
    record = slurm.wait_final(site_id, 90)
    site_log = (job_dir / "logs" / f"slurm-{site_id}.out").read_text()
    assert record["JobState"] == "FAILED" and record["ExitCode"] == "5:0", record
    assert "step exited with code 5" in site_log and "starting the step again" not in site_log, site_log


# hpcrl's GPU placement inside a real step: every rank joins hpcrl's world (its rank table), asks
# hpcrl.rollout.placement for its GPUs among those Slurm's GRES made visible, and writes them down.
PLACEMENT_PROGRAM = """
import json, os, sys
sys.path.insert(0, sys.argv[2])
from hpcrl.config import job_from_dict
from hpcrl.rollout.placement import rank_gpus, sglang_gpu_args
from hpcrl.worker_main import join_world_within
job = job_from_dict({"trainer": {"num_procs": 1}, "resources": {"device": "cuda"},
                     "rollout": {"backend": "sglang", "num_engines": 2, "tp_per_engine": 1}})
world = join_world_within(1, {deadline})  # see with_world_retry
if world.rank == 0:
    open(os.path.join(sys.argv[1], ".hpcrl_world_formed"), "w").close()
gpus = rank_gpus(world, job)
rec = {"rank": world.rank, "role": world.role, "node": os.environ["SLURMD_NODENAME"],
       "visible": os.environ.get("CUDA_VISIBLE_DEVICES"), "gpus": list(gpus),
       "sglang": sglang_gpu_args(gpus) if world.role == "rollout" else None}
with open(os.path.join(sys.argv[1], f"placed-{world.rank}.json"), "w") as f:
    json.dump(rec, f)
world.comm.Barrier()
"""


@pytest.mark.timeout(240)
def test_gpu_placement_under_slurm_gres(slurm, job_dir: Path) -> None:
    """Controller + trainer on one node, two 1-GPU engines on the other (2 fake GPUs each, bound by
    --gpus-per-node): the trainer takes its node's GPU 0, the engines GPUs 0 and 1 of theirs
    (SGLang's --base-gpu-id 0 and 1), and no two processes of a node share a GPU."""
    if not any(g.startswith("gpu:2") for g in slurm.gres()):
        pytest.skip(f"needs 2 gpu gres per node (sinfo %G: {sorted(slurm.gres())})")
    (job_dir / "place.py").write_text(PLACEMENT_PROGRAM.replace("{deadline}", str(WORLD_DEADLINE_S)))
    repo = Path(__file__).resolve().parents[2]
    comp = (SlurmComponent(nodes=2, ntasks_per_node=2, gpus_per_node=2),)
    spec = with_world_retry(make_spec(job_dir, comp, f"{PYTHON} {job_dir}/place.py {job_dir} {repo}"))
    (job_dir / "place.sbatch").write_text(render(spec))
    job_id = slurm.submit(job_dir / "place.sbatch")
    record = slurm.wait_final(job_id, timeout_s=150)  # room for a retry
    assert record["JobState"] == "COMPLETED", (record, (job_dir / "logs" / f"{job_id}-attempt0.log").read_text())
    placed = {r["rank"]: r for r in read_json_records(job_dir, "placed-*.json")}
    assert {r: (p["role"], p["gpus"]) for r, p in placed.items()} == {
        0: ("controller", []), 1: ("trainer", [0]), 2: ("rollout", [0]), 3: ("rollout", [1])}
    assert placed[0]["node"] == placed[1]["node"] != placed[2]["node"] == placed[3]["node"]
    assert {p["visible"] for p in placed.values()} == {"0,1"}  # Slurm's GRES binding, not ours
    assert [placed[2]["sglang"], placed[3]["sglang"]] == [["--base-gpu-id", "0"], ["--base-gpu-id", "1"]]
