"""The sbatch templates and `SlurmJobSpec`: golden renders, one parameter source, strictness, bash syntax.

Golden renders live in tests/golden/slurm/*.sbatch. When a template change is intended, delete the
golden file: the next run writes the new render and fails once so that the new file gets reviewed
and committed.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import shutil
import subprocess
from pathlib import Path

import jinja2
import jinja2.meta
import pytest

from launch.result import REQUEUE_EXIT_CODE
from launch.slurm_spec import (
    HETJOB_TEMPLATE,
    SINGLE_TEMPLATE,
    TEMPLATE_DIR,
    SlurmComponent,
    SlurmJobSpec,
    environment,
    format_time_limit,
    parse_time_limit,
    render,
    spec_field_names,
)

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "slurm"


def full_hetjob_spec() -> SlurmJobSpec:
    """Every optional parameter set, including a bash line that contains `${#arr[@]}`."""
    return SlurmJobSpec(
        job_name="qwen3-grpo",
        partition="gpu",
        account="proj42",
        qos="high",
        time_limit_min=2 * 24 * 60 + 90,
        components=(
            SlurmComponent(nodes=4, ntasks_per_node=8, gpus_per_node=8, cpus_per_task=12, mem_gb=0,
                           extra_sbatch_options=("--constraint=h100", "--exclusive")),
            SlurmComponent(nodes=2, ntasks_per_node=1, gpus_per_node=8, cpus_per_task=96, mem_gb=512),
        ),
        command="python -m hpcrl.worker_main --run-dir /scratch/runs/qwen3",
        run_dir="/scratch/runs/qwen3",
        log_dir="/scratch/runs/qwen3/logs",
        env_setup=("module load cuda/12.4 nccl", "source /opt/venvs/hpcrl/bin/activate",
                   'mods=(cuda nccl); echo "loaded ${#mods[@]} modules"'),
        mpi="pmix",
        signal_delay_s=300,
        extra_srun_options=("--kill-on-bad-exit=0", "--cpu-bind=none"),
        result_command=('python -P -m launch.result /scratch/runs/qwen3 /scratch/runs/qwen3/logs '
                        '"${SLURM_JOB_ID}"'),
        export_command='python -P -m launch.export_step /scratch/runs/qwen3 /scratch/export "$rc" || rc=$?',
        world_retries=2,
        max_requeues=5,
        checkpoint_step_command="python -P -m launch.checkpoint_step /scratch/runs/qwen3/checkpoints",
    )


def minimal_single_spec() -> SlurmJobSpec:
    """Only the required parameters: one component, defaults everywhere else."""
    return SlurmJobSpec(
        job_name="tiny",
        partition="debug",
        time_limit_min=30,
        components=(SlurmComponent(nodes=1, ntasks_per_node=4),),
        command="python -m hpcrl.worker_main --run-dir /tmp/runs/tiny",
        run_dir="/tmp/runs/tiny",
        log_dir="/tmp/runs/tiny/logs",
    )


GOLDEN_CASES = {"hetjob_full": full_hetjob_spec, "single_minimal": minimal_single_spec}


@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_render_matches_golden(name: str) -> None:
    got = render(GOLDEN_CASES[name]())
    path = GOLDEN_DIR / f"{name}.sbatch"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(got)
        pytest.fail(f"golden file {path} did not exist; wrote it now: review and commit it")
    want = path.read_text()
    if got != want:
        diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), str(path), "render"))
        pytest.fail(f"render differs from {path}:\n{diff}\n"
                    f"delete the golden file if this change is intended (the next run rewrites it)")


@pytest.mark.parametrize("template_name", [HETJOB_TEMPLATE, SINGLE_TEMPLATE])
def test_template_variables_are_exactly_the_spec_fields(template_name: str) -> None:
    env = environment()
    source = (TEMPLATE_DIR / template_name).read_text()
    assert jinja2.meta.find_undeclared_variables(env.parse(source)) == spec_field_names()


def test_shared_macros_read_no_template_variable() -> None:
    env = environment()
    source = (TEMPLATE_DIR / "_common.sbatch.j2").read_text()
    assert jinja2.meta.find_undeclared_variables(env.parse(source)) == set()


@pytest.mark.parametrize("template_name", [HETJOB_TEMPLATE, SINGLE_TEMPLATE])
def test_missing_parameter_fails_loudly(template_name: str) -> None:
    spec = full_hetjob_spec()
    params = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    del params["requeue_exit_code"]
    with pytest.raises(jinja2.UndefinedError, match="requeue_exit_code"):
        environment().get_template(template_name).render(params)


def test_missing_component_attribute_fails_loudly() -> None:
    spec = minimal_single_spec()
    params = {f.name: getattr(spec, f.name) for f in dataclasses.fields(spec)}
    params["components"] = ({"nodes": 1, "ntasks_per_node": 1},)  # no cpus_per_task, ...
    with pytest.raises(jinja2.UndefinedError, match="cpus_per_task"):
        environment().get_template(SINGLE_TEMPLATE).render(params)


@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
@pytest.mark.parametrize("name", sorted(GOLDEN_CASES))
def test_render_is_valid_bash(name: str, tmp_path: Path) -> None:
    script = tmp_path / "job.sbatch"
    script.write_text(render(GOLDEN_CASES[name]()))
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def sbatch_blocks(text: str) -> list[list[str]]:
    """The #SBATCH options of each component (split at '#SBATCH hetjob')."""
    blocks: list[list[str]] = [[]]
    for line in text.splitlines():
        if line == "#SBATCH hetjob":
            blocks.append([])
        elif line.startswith("#SBATCH "):
            blocks[-1].append(line.removeprefix("#SBATCH "))
    return blocks


def test_sbatch_block_is_sorted_complete_and_extras_follow_unchanged() -> None:
    spec = full_hetjob_spec()
    blocks = sbatch_blocks(render(spec))
    assert len(blocks) == 2
    for block, comp in zip(blocks, spec.components):
        managed = block[: len(block) - len(comp.extra_sbatch_options)]
        assert managed == sorted(managed)
        assert tuple(block[len(managed):]) == comp.extra_sbatch_options
    first = blocks[0]
    for want in ("--account=proj42", "--chdir=/scratch/runs/qwen3", "--cpus-per-task=12",
                 "--error=/scratch/runs/qwen3/logs/slurm-%j.err", "--gpus-per-node=8", "--job-name=qwen3-grpo",
                 "--mem=0", "--nodes=4", "--ntasks-per-node=8", "--open-mode=append",
                 "--output=/scratch/runs/qwen3/logs/slurm-%j.out", "--partition=gpu", "--qos=high", "--requeue",
                 "--signal=B:USR1@300", "--time=2-01:30:00"):
        assert want in first, want
    for want in ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=96", "--mem=512G", "--requeue",
                 "--partition=gpu", "--time=2-01:30:00"):
        assert want in blocks[1], want


def test_single_template_has_one_component_and_omits_unset_options() -> None:
    text = render(minimal_single_spec())
    (block,) = sbatch_blocks(text)
    assert block == sorted(block)
    assert not any(opt.startswith(("--account", "--qos", "--gpus-per-node", "--mem")) for opt in block)
    assert "--het-group" not in text
    assert re.search(r"^  srun --mpi=pmi2 --kill-on-bad-exit=0 python -m hpcrl.worker_main ", text, re.M)


def test_header_step_and_passthrough_lines() -> None:
    spec = full_hetjob_spec()
    lines = render(spec).splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "generated by hpcrl" in lines[1] and "do not edit" in lines[1]
    srun_lines = [line.lstrip() for line in lines if line.lstrip().startswith("srun ")]
    assert srun_lines == [
        "srun --het-group=0,1 --mpi=pmix --kill-on-bad-exit=0 --cpu-bind=none "
        "python -m hpcrl.worker_main --run-dir /scratch/runs/qwen3 >>\"$step_log\" 2>&1 &"]
    # env setup lines appear unchanged, in order, before the step
    positions = [lines.index(line) for line in spec.env_setup]
    assert positions == sorted(positions) and positions[-1] < lines.index("  " + srun_lines[0])
    # the batch script traps the signals before the setup lines run; USR2 (submitit's) goes on as USR1
    assert lines.index("trap 'on_signal USR1 USR1' USR1") < positions[0]
    assert lines.index("trap 'on_signal USR2 USR1' USR2") < positions[0]
    assert lines.index("trap 'on_signal TERM TERM' TERM") < positions[0]
    assert f"if (( rc == {REQUEUE_EXIT_CODE} )); then" in lines


def test_delimiters_leave_bash_syntax_alone() -> None:
    env = environment()
    text = 'n=${#arr[@]}; {% raw %} {{ x }} {# c #} <{ v }>'
    assert env.from_string(text).render(v="ok") == 'n=${#arr[@]}; {% raw %} {{ x }} {# c #} ok'


def test_spec_reports_world_size_and_template() -> None:
    assert full_hetjob_spec().world_size == 4 * 8 + 2 * 1
    assert full_hetjob_spec().template_name == HETJOB_TEMPLATE
    assert minimal_single_spec().template_name == SINGLE_TEMPLATE


@pytest.mark.parametrize(
    ("change", "field_in_message"),
    [
        ({"job_name": "has space"}, "job_name"),
        ({"partition": ""}, "partition"),
        ({"account": "a%b"}, "account"),
        ({"time_limit_min": 0}, "time_limit_min"),
        ({"components": ()}, "components"),
        ({"components": (SlurmComponent(nodes=1, ntasks_per_node=1),) * 3}, "components"),
        ({"command": "a\nb"}, "command"),
        ({"command": " "}, "command"),
        ({"run_dir": "relative/dir"}, "run_dir"),
        ({"log_dir": "/with space"}, "log_dir"),
        ({"env_setup": ("line\nbreak",)}, r"env_setup\[0\]"),
        ({"env_setup": "module load x"}, "env_setup"),
        ({"mpi": "openmpi"}, "mpi"),
        ({"signal_delay_s": 0}, "signal_delay_s"),
        ({"max_requeues": -1}, "max_requeues"),
        ({"result_command": "a\nb"}, "result_command"),
        ({"checkpoint_step_command": "a\nb"}, "checkpoint_step_command"),
        ({"extra_srun_options": ("--mpi=pmix",)}, r"extra_srun_options\[0\]"),
        ({"extra_srun_options": ("cpu-bind",)}, r"extra_srun_options\[0\]"),
    ],
)
def test_bad_spec_fields_are_rejected_with_the_field_name(change: dict, field_in_message: str) -> None:
    with pytest.raises(ValueError, match=field_in_message):
        dataclasses.replace(minimal_single_spec(), **change)


@pytest.mark.parametrize(
    ("kwargs", "field_in_message"),
    [
        ({"nodes": 0}, "nodes"),
        ({"ntasks_per_node": 0}, "ntasks_per_node"),
        ({"gpus_per_node": -1}, "gpus_per_node"),
        ({"cpus_per_task": True}, "cpus_per_task"),
        ({"mem_gb": -5}, "mem_gb"),
        ({"extra_sbatch_options": ("--time=10",)}, "time_limit_min"),
        ({"extra_sbatch_options": ("-N 2",)}, r"components\[i\]\.nodes"),
        ({"extra_sbatch_options": ("#SBATCH --exclusive",)}, "without '#SBATCH'"),
        ({"extra_sbatch_options": ("exclusive",)}, "starting with '-'"),
    ],
)
def test_bad_component_fields_are_rejected(kwargs: dict, field_in_message: str) -> None:
    base = {"nodes": 1, "ntasks_per_node": 1}
    with pytest.raises(ValueError, match=field_in_message):
        SlurmComponent(**{**base, **kwargs})


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("90", 90), ("1:30", 2), ("04:00:00", 240), ("1-00", 1440), ("1-2:30", 1590), ("2-01:30:00", 2970),
     ("0:0:59", 1)],
)
def test_parse_time_limit(text: str, minutes: int) -> None:
    assert parse_time_limit(text) == minutes


@pytest.mark.parametrize("text", ["", "abc", "1h", "1:2:3:4", "0", "00:00:00", "-5"])
def test_parse_time_limit_rejects_bad_text(text: str) -> None:
    with pytest.raises(ValueError, match="slurm.time"):
        parse_time_limit(text, "slurm.time")


def test_format_time_limit_round_trips() -> None:
    for minutes in (1, 59, 60, 1439, 1440, 2970, 10 * 1440 + 7):
        assert parse_time_limit(format_time_limit(minutes)) == minutes


def test_the_requeue_exit_code_is_one_constant() -> None:
    """Issue 30 item 10 (e): launch.result.REQUEUE_EXIT_CODE is the only definition; the spec field
    (what the template reads) is that constant and cannot be set, the controller exits with it, and
    the batch script exports no copy of it for the ranks to read instead."""
    import ast

    from hpcrl.controller.preemption import EXIT_REQUEUE

    assert EXIT_REQUEUE == REQUEUE_EXIT_CODE == minimal_single_spec().requeue_exit_code
    with pytest.raises(TypeError, match="requeue_exit_code"):
        SlurmJobSpec(**{**{f.name: getattr(minimal_single_spec(), f.name)
                           for f in dataclasses.fields(SlurmJobSpec) if f.init}, "requeue_exit_code": 5})
    assert "HPCRL_REQUEUE_EXIT_CODE" not in render(full_hetjob_spec())
    repo = Path(__file__).resolve().parents[2]
    sources = [*sorted((repo / "launch").glob("*.py")), repo / "hpcrl" / "controller" / "preemption.py",
               repo / "hpcrl" / "jobs.py", repo / "hpcrl" / "runner.py"]
    defined = []
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
                names = [t.id for t in node.targets if isinstance(t, ast.Name) and "REQUEUE" in t.id]
                defined += [(path.relative_to(repo).as_posix(), n) for n in names]
    assert defined == [("launch/result.py", "REQUEUE_EXIT_CODE")]
