"""`hpcrl plan job.yaml [--json]`: the full-scale weight-sync plan of a job, before any allocation.

Reads the job file (purpose "plan": any model family of `moe.specs`, including DeepSeek-V3, and the
full-scale layout keys), turns `trainer:` into a Megatron `TrainerLayout`, `rollout:` into an
SGLang `RolloutLayout` and `network:` into a `Topology`, then asks `moe.report.plan_report` for
per-GPU memory (trainer params, grads, optimizer; rollout weights), the bytes each rank sends and
receives, and three times: the plan's estimate, the NIC line-rate lower bound and the
gather-then-broadcast baseline of verl / slime. Virtual ranks only: no process starts, no GPU is
needed. Layout problems become `ConfigError`s naming the job key to change and the nearest valid
values; a layout that does not fit `network.gpu_memory_gb` is reported and then fails (exit 2).
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any, TextIO

from hpcrl.config import ConfigError, JobConfig, load_job
from hpcrl.config.validate import read_model_config
from moe.layouts import RolloutLayout, TrainerLayout
from moe.network import Topology, sglang_broadcast_seconds
from moe.report import plan_report, render_text
from hpcrl.rollout.reshard_route import spec_at_dtype
from moe.specs import MoESpec

GIB = 2**30

# Layout field -> the job key that sets it (trainer dp is derived from trainer.num_procs).
_TRAINER_KEYS = {"tp": "trainer.tp", "pp": "trainer.pp", "ep": "trainer.ep", "etp": "trainer.etp",
                 "cp": "trainer.cp", "dp": "trainer.num_procs",
                 "first_stage_layers": "trainer.first_stage_layers",
                 "last_stage_layers": "trainer.last_stage_layers"}
_ROLLOUT_KEYS = {"num_engines": "rollout.num_engines", "tp": "rollout.tp_per_engine", "ep": "rollout.ep",
                 "dp_attention": "rollout.dp_attention"}


def build_spec(job: JobConfig) -> MoESpec:
    """The `moe.specs` spec of the job's model, at the job's `model.dtype` (ConfigError if unsupported)."""
    key, value, source, cfg = read_model_config(job)
    try:
        flavor = str(value) if key == "model.preset" else os.path.basename(str(value)).removesuffix(".json")
        return spec_at_dtype(cfg, job.model.dtype, flavor)  # the trainer's parameter dtype is what moves
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(key, value, f"{source}: {str(exc).removeprefix('config.json ')}") from None


def _layout_error(exc: ValueError, side: str, job: JobConfig) -> ConfigError:
    """A layout ValueError from moe.layouts as a ConfigError on the job key that sets the bad field."""
    msg = str(exc)
    keys = _TRAINER_KEYS if side == "trainer" else _ROLLOUT_KEYS
    cls = "TrainerLayout" if side == "trainer" else "RolloutLayout"
    m = re.match(rf"{cls}\.(\w+)=", msg)
    if m and m.group(1) in keys:
        path = keys[m.group(1)]
    elif side == "trainer" and "decoder layers do not split" in msg:
        path = "trainer.pp"
    elif side == "rollout" and "tp/ep" in msg:
        path = "rollout.ep"
    elif side == "rollout" and ("attention TP" in msg or "tp/dp_attention" in msg):
        path = "rollout.dp_attention"
    else:
        path = side
    hint = re.sub(rf"^{cls}[.:]? ?", "", msg)
    if side == "trainer":
        hint = hint.replace("_stage_layers=None", "_stage_layers=0")
    else:  # the engine's TP size is rollout.tp_per_engine in the job file
        hint = re.sub(r"\btp=", "tp_per_engine=", hint)
    if "." in path:
        return ConfigError(path, getattr(getattr(job, side), path.split(".", 1)[1]), hint)
    return ConfigError(path, _layout_summary(job, side), hint)


def _layout_summary(job: JobConfig, side: str) -> str:
    """'tp=1 pp=16 ...': the job keys of one side's layout, for messages about the whole layout."""
    leaves = ([k.split(".")[1] for k in _TRAINER_KEYS.values()] if side == "trainer"
              else [k.split(".")[1] for k in _ROLLOUT_KEYS.values()])
    section = getattr(job, side)
    return " ".join(f"{leaf}={getattr(section, leaf)}" for leaf in dict.fromkeys(leaves))


def build_layouts(job: JobConfig, spec: MoESpec) -> tuple[TrainerLayout, RolloutLayout]:
    """The trainer and rollout layouts of `job`, checked against `spec` (not yet against memory)."""
    t, r = job.trainer, job.rollout
    first, last = t.first_stage_layers or None, t.last_stage_layers or None
    try:  # the model-parallel sizes against the model first: they, not num_procs, are then at fault
        probe = TrainerLayout(tp=t.tp, pp=t.pp, etp=t.etp, dp=t.etp, cp=t.cp, first_stage_layers=first,
                              last_stage_layers=last)
        probe.dims_check(spec)
        probe.stage_layers(spec.dims.num_layers)
    except ValueError as exc:
        raise _layout_error(exc, "trainer", job) from None
    model_parallel = t.tp * t.cp * t.pp
    if t.num_procs % model_parallel:
        k = max(1, t.num_procs // model_parallel)
        valid = ", ".join(str(model_parallel * i) for i in (k, k + 1))
        raise ConfigError("trainer.num_procs", t.num_procs,
                          f"must be a multiple of tp*cp*pp={model_parallel} (dp = num_procs/(tp*cp*pp)); "
                          f"nearest valid: {valid}")
    try:
        trainer = TrainerLayout(tp=t.tp, pp=t.pp, ep=t.ep, etp=t.etp, dp=t.num_procs // model_parallel,
                                cp=t.cp, first_stage_layers=first, last_stage_layers=last)
        trainer.validate(spec)
    except ValueError as exc:
        raise _layout_error(exc, "trainer", job) from None
    try:
        rollout = RolloutLayout(num_engines=r.num_engines, tp=r.tp_per_engine, ep=r.ep,
                                dp_attention=r.dp_attention)
        rollout.validate(spec)
    except ValueError as exc:
        raise _layout_error(exc, "rollout", job) from None
    return trainer, rollout


def build_topology(job: JobConfig) -> Topology:
    """`network:` as a Topology; rollout shares the trainer nodes when resources.rollout_nodes is 0."""
    n, res = job.network, job.resources
    if res.gpus_per_node and res.gpus_per_node != n.gpus_per_node:
        raise ConfigError("network.gpus_per_node", n.gpus_per_node,
                          f"differs from resources.gpus_per_node={res.gpus_per_node}; the plan must place "
                          f"ranks as Slurm will: set both to the GPUs of one node")
    if res.gpus_per_node:
        gpus = res.nodes * res.gpus_per_node
        if job.trainer.num_procs > gpus:
            raise ConfigError("trainer.num_procs", job.trainer.num_procs,
                              f"exceeds resources.nodes*gpus_per_node={gpus} GPUs; use more nodes")
        rollout_gpus = job.rollout.num_engines * job.rollout.tp_per_engine
        if res.rollout_nodes and rollout_gpus > res.rollout_nodes * res.gpus_per_node:
            raise ConfigError("rollout.num_engines", job.rollout.num_engines,
                              f"num_engines*tp_per_engine={rollout_gpus} GPUs exceed resources."
                              f"rollout_nodes*gpus_per_node={res.rollout_nodes * res.gpus_per_node}; "
                              "use more rollout_nodes")
    return Topology(gpus_per_node=n.gpus_per_node, nics_per_node=n.nics_per_node,
                    nic_gbit_per_s=n.nic_gbit_per_s, nvlink_gbyte_per_s=n.nvlink_gbyte_per_s,
                    colocated=res.rollout_nodes == 0)


def plan_job(job: JobConfig) -> dict[str, Any]:
    """`plan_report` of `job` plus `job`, `mean_recv_bytes_per_gpu` and `fits`; ConfigError for bad layouts.

    Does not raise for memory: `fits` is False and `memory_errors` holds the layouts' messages.
    """
    spec = build_spec(job)
    trainer, rollout = build_layouts(job, spec)
    topology = build_topology(job)
    gpu_bytes = int(job.network.gpu_memory_gb * GIB)
    report = plan_report(spec, trainer, rollout, topology=topology,
                         memory_budget_bytes=max(1, int(job.network.memory_budget_gb * GIB)),
                         gpu_memory_bytes=gpu_bytes)
    sglang = sglang_broadcast_seconds(spec, trainer, topology, max(1, job.rollout.bucket_mb << 20))
    report["sglang_broadcast_s"] = sglang.pop("sglang_broadcast_s")
    report["sglang_broadcast_terms"] = sglang
    moved = report["plan"]["nic_bytes"] + report["plan"]["nvlink_bytes"]
    report["mean_recv_bytes_per_gpu"] = moved / rollout.world_size
    errors = {}
    for side, layout in (("trainer", trainer), ("rollout", rollout)):
        if not report[side]["fits"]:
            try:
                layout.validate(spec, gpu_memory_bytes=gpu_bytes)
            except ValueError as exc:
                errors[side] = str(exc)
    report["fits"] = not errors
    report["memory_errors"] = errors
    return {"job": job.name, **report}


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB" if x >= 2**24 else f"{x / 2**20:.2f} MiB"


def render(report: dict[str, Any]) -> str:
    """The terminal form of `plan_job`'s report: moe.report's summary plus per-rank means and notes."""
    extra = [
        f"  per rank       trainer GPUs send max {_gib(report['max_send_bytes_per_gpu'])}, mean "
        f"{_gib(report['mean_send_bytes_per_gpu'])}; rollout GPUs receive max "
        f"{_gib(report['max_recv_bytes_per_gpu'])}, mean {_gib(report['mean_recv_bytes_per_gpu'])} "
        f"(must hold {_gib(report['must_hold_bytes_per_gpu'])})",
        f"SGLang path      {report['sglang_broadcast_s']:.4g} s: hpcrl's broadcast for rollout.backend sglang "
        f"({int(report['sglang_broadcast_terms']['num_sources'])} sources gather "
        f"{report['sglang_broadcast_terms']['gather_s']:.3g} s, then every rollout GPU receives the whole "
        f"model {report['sglang_broadcast_terms']['broadcast_s']:.4g} s)",
        "notes            estimate: per round, the slowest GPU's NIC share or NVLink time; lower bound:",
        "                 the NIC line rate, which no schedule beats; baseline: gather per pipeline stage,",
        "                 then broadcast every tensor to every rollout GPU (verl / slime",
        "                 update_weights_from_distributed). Per-GPU memory figures are maxima over GPUs;",
        "                 rollout memory is weights only (no KV cache).",
    ]
    return f"job              {report['job']}\n" + render_text(report) + "\n" + "\n".join(extra)


def _json_default(obj: Any) -> Any:
    if hasattr(obj, "item"):  # numpy scalars
        return obj.item()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def run_plan(path: str | os.PathLike, overrides: list[str], as_json: bool, out: TextIO = sys.stdout) -> int:
    """Load, plan and print a job (text or JSON); 0 when it fits, ConfigError (exit 2) otherwise.

    A layout that does not fit GPU memory is printed first, then raised as a ConfigError naming the
    side, so the numbers are visible alongside the error.
    """
    job = load_job(path, overrides, purpose="plan")
    report = plan_job(job)
    text = json.dumps(report, indent=2, default=_json_default) if as_json else render(report)
    out.write(text + "\n")
    out.flush()
    for side, msg in report["memory_errors"].items():
        hint = re.sub(r"^(Trainer|Rollout)Layout ", "", msg)
        raise ConfigError(side, _layout_summary(job, side), f"{hint} (network.gpu_memory_gb="
                                                            f"{job.network.gpu_memory_gb:g})")
    return 0
