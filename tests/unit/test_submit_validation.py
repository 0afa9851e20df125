"""`hpcrl render/submit` without a cluster: the job -> Slurm layout, the cluster checks against
partition facts, the slurm config section, and the CLI's errors when Slurm's tools are missing.

The cluster checks (`check_cluster`) are pure functions of `PartitionInfo` values, so every
rejection is exercised here with hand-built partitions; tests/slurm/test_submit.py runs the same
checks against the real local cluster and proves nothing reaches the queue.
"""

from __future__ import annotations

import io
import json
import subprocess
from pathlib import Path

import pytest

from hpcrl.cli import main
from hpcrl.config import ConfigError, load_job
from launch import slurm_spec
from launch.slurm_query import (NodeInfo, PartitionInfo, SlurmError, attempt_logs, gpu_count, parse_records,
                                resolve_run, write_logs)
from launch.slurm_submit import check_cluster, default_partition, job_spec, plan_submission, resume_lines

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"


def job_with(*overrides: str):
    return load_job(EXAMPLE, ["slurm.partition=debug", *overrides])


def partition(name: str = "debug", nodes: int = 4, cpus: int = 4, gpus: int = 2, mem_mb: int = 4000,
              default: bool = True, state: str = "UP", max_time_min: int | None = None,
              max_nodes: int | None = None, extra: tuple[NodeInfo, ...] = ()) -> PartitionInfo:
    members = tuple(NodeInfo(f"n{i + 1}", cpus, gpus, mem_mb, "IDLE") for i in range(nodes)) + extra
    return PartitionInfo(name=name, default=default, state=state, max_time_min=max_time_min,
                         max_nodes=max_nodes, nodes=members)


def cluster(*parts: PartitionInfo) -> dict[str, PartitionInfo]:
    return {p.name: p for p in parts}


def spec_of(job, run_dir: Path = Path("/runs/r1")):
    return job_spec(job, run_dir, job.slurm.partition)


# ---- job -> components ------------------------------------------------------------------------

def test_colocated_job_is_one_component_with_every_rank():
    spec, roles, warnings = spec_of(job_with())
    (comp,) = spec.components
    assert (comp.nodes, comp.ntasks_per_node, comp.extra_sbatch_options) == (1, 3, ())
    assert spec.template_name == slurm_spec.SINGLE_TEMPLATE
    assert roles == ("controller + 1 trainer rank + 1 rollout rank",) and warnings == ()
    assert spec.command.endswith("-u -P -m hpcrl.worker_main /runs/r1")
    assert spec.log_dir == "/runs/r1/logs" and spec.run_dir == "/runs/r1"


def test_rollout_nodes_make_a_hetjob_with_controller_and_trainers_in_component_0():
    job = job_with("resources.rollout_nodes=1", "rollout.num_engines=2",
                   "slurm.extra_sbatch_options=[--exclusive]",
                   "slurm.rollout_extra_sbatch_options=['--constraint=fast']", "slurm.time='2-00:00:00'")
    spec, roles, warnings = spec_of(job)
    # Slurm carries none of component 0's options to component 1 (the README's example assumed it)
    assert warnings == ("slurm.extra_sbatch_options ['--exclusive'] apply to the trainer nodes only: Slurm does "
                        "not carry them to the rollout nodes' component; repeat them in "
                        "slurm.rollout_extra_sbatch_options where the rollout nodes need them too",)
    job.slurm.rollout_extra_sbatch_options.append("--exclusive")
    assert spec_of(job)[2] == ()
    head, rollout = spec.components
    assert (head.nodes, head.ntasks_per_node, head.extra_sbatch_options) == (1, 2, ("--exclusive",))
    assert (rollout.nodes, rollout.ntasks_per_node) == (1, 2)
    assert rollout.extra_sbatch_options == ("--constraint=fast",)
    assert spec.template_name == slurm_spec.HETJOB_TEMPLATE and spec.time_limit_min == 2 * 24 * 60
    assert roles == ("controller + 1 trainer rank", "2 rollout ranks")
    script = slurm_spec.render(spec)
    assert "#SBATCH hetjob" in script and "srun --het-group=0,1 --mpi=pmi2" in script


def test_uneven_ranks_are_pinned_with_ntasks_and_spread_by_slurm():
    # 1 controller + 2 trainer ranks on 2 nodes: at most 2 per node, 3 in all
    spec, _, _ = spec_of(job_with("resources.nodes=2", "trainer.num_procs=2", "resources.rollout_nodes=1"))
    head = spec.components[0]
    assert (head.nodes, head.ntasks_per_node, head.extra_sbatch_options) == (2, 2, ("--ntasks=3",))
    assert "#SBATCH --ntasks=3" in slurm_spec.render(spec)


def test_rollout_options_without_rollout_nodes_warn():
    _, _, warnings = spec_of(job_with("slurm.rollout_extra_sbatch_options=[--exclusive]"))
    assert len(warnings) == 1 and "rollout_extra_sbatch_options is ignored" in warnings[0]


@pytest.mark.parametrize("overrides, key, value", [
    (["resources.nodes=4"], "resources.nodes", 4),
    (["resources.rollout_nodes=2"], "resources.rollout_nodes", 2),
])
def test_more_nodes_than_ranks_is_rejected(overrides, key, value):
    with pytest.raises(SlurmError) as err:
        spec_of(job_with(*overrides))
    assert (err.value.path, err.value.value) == (key, value)
    assert "cannot fill" in err.value.hint and f"use {key} <=" in err.value.hint


def test_run_dir_slurm_cannot_quote_is_rejected():
    with pytest.raises(SlurmError) as err:
        spec_of(job_with(), Path("/runs/my run"))
    assert err.value.path == "--run-dir" and "without whitespace" in err.value.hint


@pytest.mark.parametrize("resume, first", [("none", "none"), ("7", "7")])
def test_resume_flags_reach_the_first_attempt_only(resume, first):
    spec, _, _ = job_spec(job_with("slurm.env_setup=['echo user line']"), Path("/runs/r1"), "debug", resume)
    assert spec.env_setup == (*resume_lines(resume), "echo user line")
    assert resume_lines(resume)[0] in slurm_spec.render(spec)
    for restarts, expected in (("", first), ("0", first), ("1", "auto"), ("3", "auto")):
        env = {"PATH": "/usr/bin:/bin"} | ({"SLURM_RESTART_COUNT": restarts} if restarts else {})
        out = subprocess.run(["bash", "-c", f'{resume_lines(resume)[0]}\necho "$HPCRL_RESUME"'], env=env,
                             capture_output=True, text=True, timeout=10, check=True).stdout
        assert out == f"{expected}\n", (restarts, out)
    assert resume_lines("auto") == ()


# ---- the cluster checks -----------------------------------------------------------------------

def test_a_job_that_fits_passes_and_the_default_partition_is_found():
    job = job_with("resources.rollout_nodes=1")
    spec, roles, _ = spec_of(job)
    parts = cluster(partition(), partition("high", default=False))
    check_cluster(job, spec, roles, parts)
    assert default_partition(parts) == "debug"


def reject(job, parts: dict[str, PartitionInfo]) -> SlurmError:
    spec, roles, _ = spec_of(job)
    with pytest.raises(SlurmError) as err:
        check_cluster(job, spec, roles, parts)
    return err.value


def test_unknown_partition_names_the_known_ones():
    err = reject(job_with("slurm.partition=hihg"), cluster(partition(), partition("high", default=False)))
    assert (err.path, err.value) == ("slurm.partition", "hihg")
    assert "did you mean 'high'" in err.hint and "debug (default), high" in err.hint


def test_partition_that_is_down():
    err = reject(job_with(), cluster(partition(state="DOWN")))
    assert err.path == "slurm.partition" and "is DOWN" in err.hint


def test_time_over_max_time():
    err = reject(job_with("slurm.time='02:00:00'"), cluster(partition(max_time_min=30)))
    assert (err.path, err.value) == ("slurm.time", "02:00:00") and "MaxTime=00:30:00" in err.hint


def test_more_nodes_than_the_partition_has():
    job = job_with("resources.rollout_nodes=1", "resources.nodes=2", "trainer.num_procs=2")
    err = reject(job, cluster(partition(nodes=2)))
    assert err.path == "resources.rollout_nodes"
    assert "resources.nodes=2 + rollout_nodes=1 = 3 nodes" in err.hint and "has 2" in err.hint


def test_more_nodes_than_max_nodes():
    err = reject(job_with("resources.nodes=2"), cluster(partition(max_nodes=1)))
    assert err.path == "resources.nodes" and "MaxNodes=1" in err.hint
    # per component, as Slurm applies it (1 + 1 nodes ran under MaxNodes=1 and were refused)
    hetjob = job_with("resources.rollout_nodes=1", "rollout.num_engines=1")
    check_cluster(hetjob, *spec_of(hetjob)[:2], cluster(partition(max_nodes=1)))
    err = reject(job_with("resources.rollout_nodes=2", "rollout.num_engines=2"), cluster(partition(max_nodes=1)))
    assert (err.path, err.value) == ("resources.rollout_nodes", 2) and "use resources.rollout_nodes <= 1" in err.hint


def test_a_cuda_job_asks_for_gpus():
    """device cuda with gpus_per_node 0 (the default) rendered a job that asked Slurm for no GPU."""
    with pytest.raises(SlurmError) as err:
        spec_of(job_with("resources.device=cuda"))
    assert err.value.path == "resources.gpus_per_node" and "--gpus-per-node" in err.value.hint


def test_more_gpus_than_a_node_has():
    err = reject(job_with("resources.device=cuda", "resources.gpus_per_node=3"), cluster(partition(gpus=2)))
    assert (err.path, err.value) == ("resources.gpus_per_node", 3) and "at most 2" in err.hint


def test_more_cpus_than_a_node_has():
    err = reject(job_with("resources.cpus_per_rank=2"), cluster(partition(cpus=4)))
    assert (err.path, err.value) == ("resources.cpus_per_rank", 2)
    assert "3 ranks on a node, 6 CPUs" in err.hint and "cpus_per_rank <= 1" in err.hint


def test_a_gpu_engine_rank_gets_cores_for_each_of_its_gpus():
    """SGLang runs a scheduler process per GPU: a rollout rank of the rollout component gets
    cpus_per_rank per GPU of its engine on its node; trainer ranks and CPU engines cpus_per_rank."""
    gpu = ("resources.device=cuda", "resources.gpus_per_node=2", "resources.rollout_nodes=2",
           "rollout.backend=sglang", "rollout.tp_per_engine=2", "rollout.num_engines=2",
           "model.dtype=bfloat16", "rollout.logprob_tolerance=1.0", "rollout.logprob_mean_tolerance=0.02")
    spec = spec_of(job_with(*gpu))[0]
    assert [c.cpus_per_task for c in spec.components] == [1, 2]
    assert [c.cpus_per_task for c in spec_of(job_with("resources.rollout_nodes=1"))[0].components] == [1, 1]
    err = reject(job_with(*gpu, "resources.cpus_per_rank=3", "resources.nodes=2"), cluster(partition(cpus=4)))
    assert (err.path, err.value) == ("resources.cpus_per_rank", 3)
    assert err.hint.endswith("component 1 (2 rollout ranks) puts up to 1 rank on a node, 6 CPUs with "
                             "cpus_per_rank=3 x 2 (its engine's GPUs on a node), but the nodes of partition "
                             "debug have at most 4; use cpus_per_rank <= 2"), err.hint


def test_more_memory_than_a_node_has():
    err = reject(job_with("slurm.mem_gb=8"), cluster(partition(mem_mb=4000)))
    assert (err.path, err.value) == ("slurm.mem_gb", 8) and "use mem_gb <= 3" in err.hint


def test_too_few_nodes_with_enough_gpus():
    # 1 node with 4 GPUs, 3 with none: a 2-node GPU job does not fit although the maxima do
    parts = cluster(partition(nodes=3, gpus=0, extra=(NodeInfo("g1", 4, 4, 4000, "IDLE"),)))
    err = reject(job_with("resources.device=cuda", "resources.gpus_per_node=2", "resources.nodes=2",
                          "trainer.num_procs=2"), parts)
    assert err.path == "resources.nodes" and "only 1 nodes" in err.hint


# ---- parsing Slurm's output -------------------------------------------------------------------

def test_scontrol_records_keep_values_with_spaces():
    recs = parse_records("NodeName=n1 CPUTot=4 Reason=Not responding [slurm] State=DOWN\n"
                         "NodeName=n2 CPUTot=8\n")
    assert recs == [{"NodeName": "n1", "CPUTot": "4", "Reason": "Not responding [slurm]", "State": "DOWN"},
                    {"NodeName": "n2", "CPUTot": "8"}]


@pytest.mark.parametrize("gres, n", [("gpu:2", 2), ("gpu:a100:4(S:0-1)", 4), ("gpu:a:2,gpu:b:3", 5),
                                     ("(null)", 0), ("", 0), ("gpu:h100:8(S:0,1),shard:8", 8)])
def test_gpu_count(gres, n):
    assert gpu_count(gres) == n


# ---- the slurm config section -----------------------------------------------------------------

@pytest.mark.parametrize("override, key, words", [
    ("slurm.time='1:2:3:4'", "slurm.time", "not a Slurm time limit"),
    ("slurm.time='0'", "slurm.time", "zero time limit"),
    ("slurm.mpi=openmpi", "slurm.mpi", "pmi2, pmix"),
    ("slurm.signal_delay_s=60", "slurm.signal_delay_s", "use a delay below 60 s"),
    ("slurm.mem_gb=-2", "slurm.mem_gb", "-1 for the partition's default"),
    ("slurm.partition='my part'", "slurm.partition", "without whitespace"),
    ("slurm.extra_sbatch_options=[--nodes=2]", "slurm.extra_sbatch_options[0]", "resources.nodes"),
    ("slurm.extra_sbatch_options=[-n 4]", "slurm.extra_sbatch_options[0]", "hpcrl places the ranks"),
    ("slurm.extra_sbatch_options=['#SBATCH --exclusive']", "slurm.extra_sbatch_options[0]",
     "without '#SBATCH'"),
    ("slurm.rollout_extra_sbatch_options=[exclusive]", "slurm.rollout_extra_sbatch_options[0]",
     "starting with '-'"),
    ("slurm.extra_srun_options=[--mpi=pmix]", "slurm.extra_srun_options[0]", "set slurm.mpi instead"),
    ("slurm.extra_sbatch_options=['--gres=gpu:8']", "slurm.extra_sbatch_options[0]", "resources.gpus_per_node"),
    ("slurm.extra_sbatch_options=[--mem-per-cpu=1G]", "slurm.extra_sbatch_options[0]", "slurm.mem_gb"),
    ("slurm.extra_sbatch_options=[--array=1-3]", "slurm.extra_sbatch_options[0]", "one job per run"),
    ("slurm.extra_sbatch_options=[--cpus-per-gpu=8]", "slurm.extra_sbatch_options[0]", "resources.cpus_per_rank"),
    ("slurm.extra_sbatch_options=[--ntasks-per-gpu=1]", "slurm.extra_sbatch_options[0]", "hpcrl places the ranks"),
    ("slurm.extra_sbatch_options=[--partit=x]", "slurm.extra_sbatch_options[0]",
     "an abbreviation of '--partition'"),
    ("slurm.extra_srun_options=[-n 4]", "slurm.extra_srun_options[0]", "one rank per task"),
    ("slurm.extra_srun_options=[--output=/dev/null]", "slurm.extra_srun_options[0]", "RUN_DIR/logs"),
    ("slurm.extra_srun_options=[--kill-on-bad-exit=1]", "slurm.extra_srun_options[0]", "naming the rank"),
    ("slurm.python=' '", "slurm.python", "interpreter"),
])
def test_slurm_section_errors_name_the_key(override, key, words):
    overrides = [override, "slurm.time='1'"] if key == "slurm.signal_delay_s" else [override]
    with pytest.raises(ConfigError) as err:
        load_job(EXAMPLE, overrides)
    assert err.value.path == key and words in err.value.hint, str(err.value)


def test_every_option_the_templates_own_has_a_fix_in_job_terms():
    from hpcrl.slurm_section import SLURM_OWNED_OPTIONS

    assert set(slurm_spec._MANAGED_SBATCH) <= set(SLURM_OWNED_OPTIONS["sbatch"])
    assert set(slurm_spec._MANAGED_SRUN) <= set(SLURM_OWNED_OPTIONS["srun"])


# ---- without Slurm's tools --------------------------------------------------------------------

@pytest.fixture
def no_slurm_path(tmp_path, monkeypatch) -> Path:
    """PATH with only a python: no sbatch, scontrol or squeue."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_submit_without_sbatch_fails_before_creating_anything(no_slurm_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["submit", str(EXAMPLE), "--run-dir", str(run_dir)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("hpcrl submit: error: sbatch='not found': hpcrl needs Slurm's client tools on PATH")
    assert not run_dir.exists()
    with pytest.raises(SlurmError) as exc:
        plan_submission(job_with(), run_dir)
    assert exc.value.path == "sbatch"


def test_render_needs_no_cluster_when_the_partition_is_set(no_slurm_path, tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc = main(["render", str(EXAMPLE), "--set", "slurm.partition=gpu", "--set", "resources.rollout_nodes=1",
               "--run-dir", str(run_dir)])
    out = capsys.readouterr().out
    job = job_with("slurm.partition=gpu", "resources.rollout_nodes=1")
    assert rc == 0 and out == slurm_spec.render(job_spec(job, run_dir, "gpu")[0])
    assert f"#SBATCH --chdir={run_dir}" in out and not run_dir.exists()


def test_render_with_the_default_partition_needs_the_cluster(no_slurm_path, capsys):
    rc = main(["render", str(EXAMPLE), "--run-dir", "/runs/x"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("hpcrl render: error: slurm.partition=None: null means the cluster's "
                                      "default partition, but the cluster cannot be asked"), err
    assert err.endswith("set slurm.partition")


# ---- run dirs: resolving RUN and picking logs -------------------------------------------------

def test_status_of_a_dir_without_slurm_json_says_why(tmp_path, capsys):
    rc = main(["status", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "has no slurm.json: it was not submitted with hpcrl submit" in err
    with pytest.raises(SlurmError, match="no such run dir"):
        resolve_run(str(tmp_path / "missing"))


@pytest.mark.parametrize("text", ['{"job_id": ', "[]", '{"log_dir": "logs"}'], ids=["cut", "list", "no-job-id"])
def test_status_and_logs_of_a_damaged_slurm_json_exit_2_naming_it(tmp_path, capsys, text):
    (tmp_path / "slurm.json").write_text(text)
    for command in ("status", "logs"):
        assert main([command, str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert f"{tmp_path / 'slurm.json'} is not the record hpcrl submit writes" in err and "Traceback" not in err


def test_logs_pick_the_latest_attempt_numerically(tmp_path, capsys):
    (tmp_path / "logs").mkdir()
    record = {"job_id": "7", "log_dir": str(tmp_path / "logs")}
    (tmp_path / "slurm.json").write_text(json.dumps(record))
    for n in (0, 1, 2, 10):
        (tmp_path / "logs" / f"7-attempt{n}.log").write_text(f"attempt {n}\n")
    (tmp_path / "logs" / "8-attempt11.log").write_text("another job\n")
    assert [n for n, _ in attempt_logs(tmp_path, record)] == [0, 1, 2, 10]
    assert main(["logs", str(tmp_path)]) == 0
    assert capsys.readouterr().out == "attempt 10\n"
    assert main(["logs", str(tmp_path), "--attempt", "1"]) == 0
    assert capsys.readouterr().out == "attempt 1\n"
    out = io.StringIO()
    write_logs(tmp_path, record, out, every=True)
    text = out.getvalue()
    assert text.count("==> ") == 4 and text.index("attempt 2\n") < text.index("attempt 10\n")
    assert main(["logs", str(tmp_path), "--attempt", "5"]) == 2
    assert "no attempt 5 of job 7 yet (attempts with logs: [0, 1, 2, 10])" in capsys.readouterr().err
