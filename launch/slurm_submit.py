"""Job config -> Slurm job: where the ranks go, the cluster checks before sbatch, and the submission.

    plan = plan_submission(job, run_dir)   # SlurmJobSpec + rendered script; checks the cluster
    prepare_run_dir(job, run_dir)          # (hpcrl.runner) resolved config, logs/
    record = submit(plan)                  # RUN_DIR/job.sbatch, sbatch --parsable, RUN_DIR/slurm.json
    test_submission(plan)                  # or (hpcrl submit --dry-run): sbatch --test-only, no job

The MPI world is the one `hpcrl run` starts (rank 0 controller, then the trainer ranks, then one
rank per rollout engine), started by one srun step. With `resources.rollout_nodes > 0` the job is
heterogeneous: component 0 holds the controller and the trainer ranks on `resources.nodes` nodes,
component 1 the rollout ranks on `rollout_nodes` nodes (srun numbers component 0's tasks first, so the
ranks land where their roles belong). Otherwise one component holds every rank. A component's ranks
are spread as evenly as Slurm's block layout does (`--ntasks-per-node` = the ceiling, plus `--ntasks`
when they do not divide evenly, e.g. 1 controller + 8 trainer ranks on 2 nodes: 5 + 4).
Every check runs before anything is submitted; a problem is a `SlurmError` naming the YAML key, the
bad value and the fix. `job` is an `hpcrl.config.JobConfig`; it is read by attribute only, so this
module imports nothing from `hpcrl` (launch stays below hpcrl).
"""

from __future__ import annotations

import json
import math
import os
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from difflib import get_close_matches
from pathlib import Path
from typing import Any

from launch.checkpoint_step import checkpoint_dir, checkpoint_step_command
from launch.export_step import export_command
from launch.slurm_executor import SBATCH_TIMEOUT_S, HetJob, HetJobExecutor
from launch.slurm_query import (SUBMISSION_FILE, PartitionInfo, SlurmError, cluster_partitions, job_state,
                                require_tool, slurm_cmd)
from launch.slurm_spec import (SlurmComponent, SlurmJobSpec, format_time_limit, option_name, parse_time_limit,
                               render)

SCRIPT_NAME = "job.sbatch"
WORLD_RETRIES = 2  # step retries when the MPI world never formed (SlurmJobSpec.world_retries)
LOG_DIR_NAME = "logs"


@dataclass(frozen=True)
class SubmitPlan:
    """A checked, rendered job: `script` is exactly what `submit` writes and passes to sbatch.
    `roles[i]` says which ranks component i holds; `warnings` are settings that have no effect."""

    spec: SlurmJobSpec
    script: str
    run_dir: Path
    roles: tuple[str, ...]
    warnings: tuple[str, ...]
    export_dir: Path | None = None
    """Where the job exports its final checkpoint at the end (launch/export_step.py), or None."""


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def worker_command(job: Any, run_dir: Path) -> str:
    """The step's command line: every rank runs `python -u -m hpcrl.worker_main RUN_DIR` (unbuffered,
    so `hpcrl logs -f` shows the controller's lines as they come)."""
    python = job.slurm.python or sys.executable
    # -P: do not put the working directory on sys.path; the step runs in the run dir, whose
    # `checkpoints/` folder would otherwise shadow the `checkpoints` package on a requeued attempt.
    return f"{shlex.quote(python)} -u -P -m hpcrl.worker_main {shlex.quote(str(run_dir))}"


def result_command(job: Any, run_dir: Path) -> str:
    """The batch script's result writer (`SlurmJobSpec.result_command`; the template appends the
    step's exit code and why the job stops): the run's outcome as submitit's result file in
    RUN_DIR/logs (launch/result.py)."""
    python = job.slurm.python or sys.executable
    q = shlex.quote
    folder = run_dir / LOG_DIR_NAME
    return f'{q(python)} -P -m launch.result {q(str(run_dir))} {q(str(folder))} "${{SLURM_JOB_ID}}"'


def check_export_dir(job: Any, run_dir: Path, export_dir: Path) -> None:
    """SlurmError unless `export_dir` is an absolute path outside the run dir's own files (the
    export writes config.json and model*.safetensors there), outside the checkpoint dir, and holds no
    safetensors an hpcrl export did not write (it replaces its own: these would be deleted)."""
    from checkpoints.hf_safetensors import foreign_weights

    ckpt = checkpoint_dir(job, run_dir)
    if not export_dir.is_absolute():
        raise SlurmError("export_to", str(export_dir), "must be an absolute path")
    if export_dir == run_dir or any(export_dir.is_relative_to(d) for d in (ckpt, run_dir / LOG_DIR_NAME)):
        raise SlurmError("export_to", str(export_dir), f"would overwrite the run's own files (run dir "
                                                       f"{run_dir}, checkpoints {ckpt}); use a directory of "
                                                       f"its own, e.g. {run_dir / 'export'}")
    foreign = foreign_weights(export_dir)
    if foreign is not None:
        raise SlurmError("export_to", str(export_dir), f"holds {foreign.name}, which hpcrl export did not "
                                                       "write: the export would delete it; use an empty or new "
                                                       "directory")


def _component(key: str, nodes: int, tasks: int, what: str, gpus: int, cpus: int, mem_gb: int | None,
               extra: list[str]) -> SlurmComponent:
    if tasks < nodes:
        raise SlurmError(key, nodes, f"{what} = {_plural(tasks, 'rank')} cannot fill {nodes} nodes (every "
                                     f"node of a component runs at least one rank); use {key} <= {tasks}")
    per_node = math.ceil(tasks / nodes)
    # --ntasks-per-node is then a maximum and Slurm spreads the ranks evenly (block layout).
    pin = () if per_node * nodes == tasks else (f"--ntasks={tasks}",)
    return SlurmComponent(nodes=nodes, ntasks_per_node=per_node, gpus_per_node=gpus, cpus_per_task=cpus,
                          mem_gb=mem_gb, extra_sbatch_options=(*pin, *extra))


def rollout_cpu_factor(job: Any) -> int:
    """How many times resources.cpus_per_rank a rollout rank of its own component gets: one share per
    GPU of its engine on its node (rollout.tp_per_engine / nodes_per_engine) with device cuda, as
    SGLang runs a scheduler process per GPU; 1 on CPU."""
    r = job.rollout
    return max(1, r.tp_per_engine // r.nodes_per_engine) if job.resources.device == "cuda" else 1


def resume_lines(resume: str) -> tuple[str, ...]:
    """Batch-script lines that pass `hpcrl submit --no-resume / --resume-from STEP` (resume "none" or
    a step) to the ranks as HPCRL_RESUME for the first attempt only: a requeued attempt must resume
    from the latest checkpoint, and Slurm would replay the submit-time environment. "auto" (the
    controller's default) needs no line."""
    if resume == "auto":
        return ()
    flag = "--no-resume" if resume == "none" else f"--resume-from {int(resume)}"
    return (f'if [[ "${{SLURM_RESTART_COUNT:-0}}" == 0 ]]; then export HPCRL_RESUME={resume}; '
            f"else export HPCRL_RESUME=auto; fi  # hpcrl submit {flag}: first attempt only",)


def job_spec(job: Any, run_dir: Path, partition: str, resume: str = "auto", export_dir: Path | None = None
             ) -> tuple[SlurmJobSpec, tuple[str, ...], tuple[str, ...]]:
    """(spec, roles per component, warnings) for `job` in `run_dir` on `partition`; no cluster access.
    `resume` is "auto", "none" or a step number (see `resume_lines`); with `export_dir` the job exports
    its final checkpoint there at its end (launch/export_step.py; a failed export fails the job)."""
    res, s, t, r = job.resources, job.slurm, job.trainer, job.rollout
    if not run_dir.is_absolute():
        raise SlurmError("--run-dir", str(run_dir), "must be an absolute path")
    if export_dir is not None:
        check_export_dir(job, run_dir, export_dir)
    if any(c.isspace() or c in "'\"%\\" for c in str(run_dir)):
        raise SlurmError("--run-dir", str(run_dir), "sbatch cannot quote paths in #SBATCH lines: choose a "
                                                    "run dir without whitespace, quotes, backslashes or '%'")
    if res.device == "cuda" and res.gpus_per_node < 1:  # the job would ask Slurm for no GPU
        raise SlurmError("resources.gpus_per_node", res.gpus_per_node,
                         "resources.device is cuda: set the GPUs each node gives the job (hpcrl asks Slurm "
                         "for --gpus-per-node), e.g. 8")
    each = {"gpus": res.gpus_per_node if res.device == "cuda" else 0, "cpus": res.cpus_per_rank,
            "mem_gb": None if s.mem_gb < 0 else s.mem_gb}
    # a rollout rank's engine runs a process per GPU of its node (SGLang's TP schedulers): cores for each
    rollout_each = {**each, "cpus": res.cpus_per_rank * rollout_cpu_factor(job)}
    num_rollout = r.num_engines * r.nodes_per_engine  # a rank per engine node
    trainers, rollouts = _plural(t.num_procs, "trainer rank"), _plural(num_rollout, "rollout rank")
    warnings = []
    if res.rollout_nodes > 0:
        roles = (f"controller + {trainers}", rollouts)
        rollout_names = {option_name(o) for o in s.rollout_extra_sbatch_options}
        alone = [o for o in s.extra_sbatch_options if option_name(o) not in rollout_names]
        if alone:  # Slurm gives a hetjob's later components none of component 0's options
            warnings.append(f"slurm.extra_sbatch_options {alone} apply to the trainer nodes only: Slurm does not "
                            "carry them to the rollout nodes' component; repeat them in "
                            "slurm.rollout_extra_sbatch_options where the rollout nodes need them too")
        components = (
            _component("resources.nodes", res.nodes, 1 + t.num_procs, roles[0], **each,
                       extra=s.extra_sbatch_options),
            _component("resources.rollout_nodes", res.rollout_nodes, num_rollout,
                       f"rollout.num_engines={r.num_engines}" + (
                           f" x nodes_per_engine={r.nodes_per_engine}" if r.nodes_per_engine > 1 else ""),
                       **rollout_each, extra=s.rollout_extra_sbatch_options))
    else:
        roles = (f"controller + {trainers} + {rollouts}",)
        components = (_component("resources.nodes", res.nodes, job.world_size, roles[0], **each,
                                 extra=s.extra_sbatch_options),)
        if s.rollout_extra_sbatch_options:
            warnings.append("slurm.rollout_extra_sbatch_options is ignored: resources.rollout_nodes=0 puts "
                            "the rollout ranks into component 0 (use slurm.extra_sbatch_options)")
    python = s.python or sys.executable
    export = "" if export_dir is None else export_command(python, run_dir, export_dir)
    try:
        spec = SlurmJobSpec(
            job_name=job.name, partition=partition, account=s.account, qos=s.qos,
            time_limit_min=parse_time_limit(s.time, "slurm.time"), components=components,
            command=worker_command(job, run_dir), run_dir=str(run_dir), log_dir=str(run_dir / LOG_DIR_NAME),
            env_setup=(*resume_lines(resume), *s.env_setup), mpi=s.mpi, signal_delay_s=s.signal_delay_s,
            extra_srun_options=("--kill-on-bad-exit=0", *s.extra_srun_options),
            result_command=result_command(job, run_dir), export_command=export, world_retries=WORLD_RETRIES,
            max_requeues=s.max_requeues,
            checkpoint_step_command=checkpoint_step_command(python, str(checkpoint_dir(job, run_dir))))
    except ValueError as exc:  # validate() checks the slurm section first; this names any leftover
        raise SlurmError("slurm", "section", str(exc)) from None
    assert _world_size(spec) == job.world_size, (_world_size(spec), job.world_size)
    return spec, roles, tuple(warnings)


def default_partition(partitions: dict[str, PartitionInfo]) -> str:
    """The cluster's default partition; SlurmError when it has none."""
    for p in partitions.values():
        if p.default:
            return p.name
    raise SlurmError("slurm.partition", None, f"the cluster has no default partition; set one of: "
                                              f"{', '.join(partitions) or '(none)'}")


def check_cluster(job: Any, spec: SlurmJobSpec, roles: tuple[str, ...],
                  partitions: dict[str, PartitionInfo]) -> None:
    """SlurmError unless `spec` fits `partitions[spec.partition]`: it exists and is up, the time limit
    is within MaxTime, and enough nodes have the CPUs, GPUs and memory each component asks for."""
    name = spec.partition
    p = partitions.get(name)
    if p is None:
        close = get_close_matches(name, list(partitions), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        known = ", ".join(f"{q.name}{' (default)' if q.default else ''}" for q in partitions.values())
        raise SlurmError("slurm.partition", name, f"no such partition on this cluster{hint}; "
                                                  f"partitions: {known}")
    if p.state != "UP":
        raise SlurmError("slurm.partition", name, f"the partition is {p.state}, so the job would not start; "
                                                  "choose a partition that is UP (sinfo)")
    if p.max_time_min is not None and spec.time_limit_min > p.max_time_min:
        raise SlurmError("slurm.time", job.slurm.time,
                         f"exceeds partition {name}'s MaxTime={format_time_limit(p.max_time_min)}; use at "
                         "most that (a requeued job gets the full limit again)")
    comps = spec.components
    total = sum(c.nodes for c in comps)
    key = "resources.rollout_nodes" if len(comps) == 2 else "resources.nodes"
    need = f"{total} nodes"
    if len(comps) == 2:
        need = (f"resources.nodes={comps[0].nodes} + rollout_nodes={comps[1].nodes} = {total} nodes "
                "(the two components never share a node)")
    if total > len(p.nodes):
        raise SlurmError(key, comps[-1].nodes, f"the job needs {need} but partition {name} has "
                                               f"{len(p.nodes)}; use fewer nodes or another partition")
    for i, c in enumerate(comps):  # Slurm applies MaxNodes to each component, a job record of its own
        if p.max_nodes is not None and c.nodes > p.max_nodes:
            node_key = "resources.rollout_nodes" if i == 1 else "resources.nodes"
            raise SlurmError(node_key, c.nodes, f"partition {name} allows MaxNodes={p.max_nodes} per job "
                                                f"(per component of a heterogeneous job); use {node_key} <= "
                                                f"{p.max_nodes} or another partition")
    max_cpus = max(n.cpus for n in p.nodes)
    max_gpus = max(n.gpus for n in p.nodes)
    max_mem = max(n.memory_mb for n in p.nodes)
    usable: set[str] = set()
    for i, c in enumerate(comps):
        cpus = c.ntasks_per_node * c.cpus_per_task
        node_key = "resources.rollout_nodes" if i == 1 else "resources.nodes"
        if c.gpus_per_node > max_gpus:
            raise SlurmError("resources.gpus_per_node", c.gpus_per_node,
                             f"no node of partition {name} has {c.gpus_per_node} GPUs (at most {max_gpus}); "
                             f"use gpus_per_node <= {max_gpus} or another partition")
        if cpus > max_cpus:
            factor = rollout_cpu_factor(job) if i == 1 else 1  # see job_spec
            per = c.ntasks_per_node * factor
            shared = c.ntasks_per_node > 1  # more nodes spread the ranks
            if max_cpus >= per:
                fix = f"use cpus_per_rank <= {max_cpus // per}" + (f" or more {node_key}" if shared else "")
            else:
                fix = f"use more {node_key}" if shared else "use a partition with more CPUs per node"
            times = f" x {factor} (its engine's GPUs on a node)" if factor > 1 else ""
            raise SlurmError("resources.cpus_per_rank", job.resources.cpus_per_rank,
                             f"component {i} ({roles[i]}) puts up to {_plural(c.ntasks_per_node, 'rank')} "
                             f"on a node, {cpus} CPUs with cpus_per_rank={job.resources.cpus_per_rank}"
                             f"{times}, but the nodes of partition {name} have at most {max_cpus}; {fix}")
        if c.mem_gb and c.mem_gb * 1024 > max_mem:
            raise SlurmError("slurm.mem_gb", c.mem_gb,
                             f"no node of partition {name} has {c.mem_gb} GB (at most {max_mem} MB); use "
                             f"mem_gb <= {max_mem // 1024}, 0 (all of it) or -1 (the partition's default)")
        fits = {n.name for n in p.nodes if n.cpus >= cpus and n.gpus >= c.gpus_per_node
                and (not c.mem_gb or n.memory_mb >= c.mem_gb * 1024)}
        if len(fits) < c.nodes:
            gpus = f", {c.gpus_per_node} GPUs" if c.gpus_per_node else ""
            raise SlurmError(node_key, c.nodes, f"only {len(fits)} nodes of partition {name} have {cpus} CPUs"
                                                f"{gpus} for component {i} ({roles[i]}); use fewer nodes or "
                                                "another partition")
        usable |= fits
    if len(usable) < total:
        raise SlurmError(key, comps[-1].nodes, f"only {len(usable)} nodes of partition {name} fit the "
                                               f"components; the job needs {need}")


def check_run_dir_free(run_dir: Path) -> None:
    """SlurmError when RUN_DIR/slurm.json names a job that is still pending or running."""
    sub = run_dir / SUBMISSION_FILE
    if not sub.is_file():
        return
    job_id = json.loads(sub.read_text()).get("job_id")
    state = job_state(job_id) if job_id else None
    if state is not None and not state.final:
        raise SlurmError("--run-dir", str(run_dir), f"its job {job_id} is {state.state}; cancel it first "
                                                    f"(hpcrl cancel {run_dir}) or choose another run dir")


def plan_submission(job: Any, run_dir: Path, *, check: bool = True, resume: str = "auto",
                    export_dir: Path | None = None) -> SubmitPlan:
    """Build and render the Slurm job of `job` in `run_dir`. With `check` (what submit does): sbatch
    must be on PATH, the cluster's partition must fit the job (`check_cluster`) and the run dir must
    not hold a live job. Without it (render) the cluster is asked only for its default partition when
    `slurm.partition` is null. With `export_dir` the job exports its final checkpoint there at the
    end (launch/export_step.py). Raises SlurmError; submits and writes nothing."""
    if check:
        require_tool("sbatch")
    partitions: dict[str, PartitionInfo] = {}
    if check:
        partitions = cluster_partitions()
    elif job.slurm.partition is None:
        try:
            partitions = cluster_partitions()
        except SlurmError as exc:
            raise SlurmError("slurm.partition", None, f"null means the cluster's default partition, but "
                                                      f"the cluster cannot be asked ({exc}); set "
                                                      "slurm.partition") from None
    partition = job.slurm.partition or default_partition(partitions)
    spec, roles, warnings = job_spec(job, run_dir, partition, resume, export_dir)
    if check:
        check_cluster(job, spec, roles, partitions)
        check_run_dir_free(run_dir)
    return SubmitPlan(spec=spec, script=render(spec), run_dir=run_dir, roles=roles, warnings=warnings,
                      export_dir=export_dir)


def _world_size(spec: SlurmJobSpec) -> int:
    """Ranks the step starts: a component's `--ntasks=N` pin wins over nodes * ntasks_per_node."""
    total = 0
    for c in spec.components:
        pins = [int(o.split("=", 1)[1]) for o in c.extra_sbatch_options if o.startswith("--ntasks=")]
        total += pins[0] if pins else c.num_tasks
    return total


def layout(plan: SubmitPlan) -> dict[str, Any]:
    """The plan's world size and components (nodes, tasks per node, which ranks), as RUN_DIR/slurm.json
    records them."""
    return {"world_size": _world_size(plan.spec),
            "components": [{"nodes": c.nodes, "ntasks_per_node": c.ntasks_per_node, "ranks": role}
                           for c, role in zip(plan.spec.components, plan.roles, strict=True)]}


def test_submission(plan: SubmitPlan) -> str:
    """Slurm's own verdict on the rendered script, `sbatch --test-only` (when and where the job would
    start; nothing is submitted): its line, or SlurmError with Slurm's reason when it would refuse it."""
    with tempfile.NamedTemporaryFile("w", prefix="hpcrl-dry-run-", suffix=".sbatch") as script:
        script.write(plan.script)
        script.flush()
        proc = slurm_cmd(["sbatch", "--test-only", script.name], timeout_s=SBATCH_TIMEOUT_S, check=False)
    said = [line.strip().removeprefix("sbatch: ") for line in (proc.stderr + proc.stdout).splitlines()
            if line.strip()]
    if proc.returncode != 0:
        why = said[-1] if said else f"exit code {proc.returncode}"
        raise SlurmError("sbatch --test-only", "the job script (hpcrl render prints it)",
                         f"Slurm would refuse the job: {why}; change the resources.* or slurm.* settings "
                         "that ask for it")
    return said[-1] if said else "accepted"


def submit_run(plan: SubmitPlan, after: Sequence[Any] = ()) -> tuple[HetJob, dict]:
    """Submit `plan` through `HetJobExecutor` (job folder RUN_DIR/logs) once every job in `after`
    (HetJobs or job ids) has completed (afterok); write RUN_DIR/job.sbatch (the script, as `hpcrl
    render` prints it) and RUN_DIR/slurm.json; return the submitit job and that record.

    The run dir must exist (hpcrl.runner.prepare_run_dir). SlurmError when sbatch rejects the job.
    """
    run_dir = plan.run_dir
    script = run_dir / SCRIPT_NAME
    script.write_text(plan.script)
    Path(plan.spec.log_dir).mkdir(parents=True, exist_ok=True)  # Slurm does not create it
    executor = HetJobExecutor(plan.spec.log_dir, python=None)
    job = executor.submit_plan(plan, after=after)
    previous = []
    old = run_dir / SUBMISSION_FILE
    if old.is_file():
        old_rec = json.loads(old.read_text())
        previous = [*old_rec.get("previous_job_ids", []), old_rec.get("job_id")]
    record = {
        "job_id": job.job_id,
        "submitted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "script": str(script),
        "sbatch": [*executor.last_sbatch[:-1], str(job.paths.submission_file)],
        "submitit_folder": str(job.paths.folder),
        "log_dir": plan.spec.log_dir,
        "partition": plan.spec.partition,
        "template": plan.spec.template_name,
        **layout(plan),
        "dependency": [j if isinstance(j, str) else j.job_id for j in after],
        "export_dir": None if plan.export_dir is None else str(plan.export_dir),
        "previous_job_ids": previous,
    }
    tmp = run_dir / f"{SUBMISSION_FILE}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, run_dir / SUBMISSION_FILE)
    return job, record


def submit(plan: SubmitPlan) -> dict:
    """`submit_run(plan)`'s record (what `hpcrl submit` prints from)."""
    return submit_run(plan)[1]
