"""`hpcrl plan job.yaml [--json]`: the full-scale weight-sync plan of a job, before any allocation.

Reads the job file (purpose "plan": any model family of `moe.specs`, including DeepSeek-V3, and the
full-scale layout keys), builds the job's model spec, Megatron `TrainerLayout`, SGLang
`RolloutLayout` and trainer build as `hpcrl run` builds them (hpcrl/models/job_model.py), turns
`network:` into a `Topology`, then asks `moe.report.plan_report` for per-GPU memory (trainer params,
grads, optimizer, reference model, for model.dtype's build and the other dtype's; rollout weights),
the bytes each rank sends and receives, and the weight-sync times by route: the shard route's
estimate and NIC line-rate lower bound (the reference engine, and SGLang's Qwen3-MoE through hpcrl's
loader), the broadcast route's
hpcrl multi-source broadcast and verl / slime's gather-then-broadcast baseline (SGLang). The route
the job's run takes is listed first. Virtual ranks only: no process starts, no GPU is needed.
Layout problems become `ConfigError`s naming the job key to change and the nearest valid values; a
layout that does not fit `network.gpu_memory_gb` is reported and then fails (exit 2).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict
from typing import Any, TextIO

from hpcrl.config import ConfigError, JobConfig, load_job
from hpcrl.config.schema import engine_dtype, engine_routes, weight_sync_mode
from hpcrl.config.validate_data import longest_prompt
from hpcrl.models.job_model import (RUN_PARAM_DTYPES, build_layouts, build_spec, layout_summary, model_config,
                                    trainer_build)
from moe.activation_memory import StepShape, activation_memory
from moe.hf_megatron import HFModelDims
from moe.network import Topology
from moe.report import plan_report, render_text, trainer_memory_line, trainer_memory_summary
from moe.trainer_memory import PARAM_BYTES, megatron_build, memory_hint

__all__ = ["build_layouts", "build_spec", "build_topology", "longest_prompt", "plan_job", "render",
           "run_plan"]

GIB = 2**30


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
    """`plan_report` of `job` plus `job`, `weight_sync`, `mean_recv_bytes_per_gpu` and `fits`.

    The trainer memory is that of `trainer_build(job)` (what `hpcrl run` builds for model.dtype);
    `trainer.other_build` is the other dtype's build for comparison. ConfigError for bad layouts;
    does not raise for memory: `fits` is False and `memory_errors` holds one message per side.
    """
    spec = build_spec(job)
    trainer, rollout = build_layouts(job, spec)
    topology = build_topology(job)
    gpu_bytes = int(job.network.gpu_memory_gb * GIB)
    build = trainer_build(job)
    report = plan_report(spec, trainer, rollout, topology=topology,
                         memory_budget_bytes=max(1, int(job.network.memory_budget_gb * GIB)),
                         gpu_memory_bytes=gpu_bytes, build=build,
                         broadcast_bucket_bytes=max(1, job.rollout.bucket_mb << 20))
    t = report["trainer"]
    other = megatron_build("bfloat16" if build.param_dtype == "float32" else "float32", build.reference_model,
                           build.critic_model)
    t["other_build"] = trainer_memory_summary(spec, trainer, other, gpu_bytes)
    prompt, prompt_from = longest_prompt(job)  # once: a synthetic task's prompts go through the tokenizer
    shape = step_shape(job, prompt)
    for summary, b in ((t, build), (t["other_build"], other)):
        act = activation_memory(spec.dims, trainer, shape, PARAM_BYTES[b.param_dtype])
        summary["activations"] = {**act, "step": asdict(shape), "prompt_from": prompt_from}
        summary["activations_bytes_per_gpu"] = act["bytes_per_gpu"]
        summary["total_bytes_per_gpu"] += act["bytes_per_gpu"]  # at most: the maxima of two kinds of GPU
        summary["fits"] = summary["total_bytes_per_gpu"] <= gpu_bytes
    for summary, note in ((t, "what hpcrl run builds"),
                          (t["other_build"], f"what hpcrl run builds with model.dtype: {other.param_dtype}")):
        today = summary["build"]["built_by_run_today"] = summary["build"]["param_dtype"] in RUN_PARAM_DTYPES
        summary["build"]["note"] = note if today else f"{note}; not built by hpcrl run"
    report["weight_sync"] = {"rollout_backend": job.rollout.backend, "weight_sync": job.rollout.weight_sync,
                             "route": weight_sync_mode(job)}
    if report["weight_sync"]["route"] == "broadcast":  # each source keeps its gathered share on its GPU
        t["sync_buffer_bytes_per_gpu"] = report["sglang_broadcast_terms"]["source_buffer_bytes"]
        t["total_bytes_per_gpu"] += t["sync_buffer_bytes_per_gpu"]  # at most: the largest share on the fullest GPU
        t["fits"] = t["total_bytes_per_gpu"] <= gpu_bytes
    weights = report["rollout"]["weights_bytes_per_gpu"]
    report["rollout"]["nodes_per_engine"] = job.rollout.nodes_per_engine
    hf_dims = HFModelDims.from_hf_config(model_config(job)[3])  # the KV cache's and the routes' model
    report["rollout"]["kv_cache"] = kv = kv_cache_report(job, hf_dims, rollout, weights, gpu_bytes, prompt)
    if kv is not None and not kv["fits"]:
        report["rollout"]["fits"] = False
    report["routing_replay"] = routes_report(job, hf_dims, prompt)
    report["async"] = async_report(job, report["routing_replay"], prompt)
    moved = report["plan"]["nic_bytes"] + report["plan"]["nvlink_bytes"]
    report["mean_recv_bytes_per_gpu"] = moved / rollout.world_size
    errors = {}
    # the hint's layouts leave room for what the plan adds to the build's memory (about the same
    # activations under more stages: fewer layers each, more micro-batches in flight)
    extra = t.get("sync_buffer_bytes_per_gpu", 0) + t["activations_bytes_per_gpu"]
    if not t["fits"]:
        errors["trainer"] = (f"TrainerLayout needs {t['total_bytes_per_gpu'] / GIB:.1f} GiB per GPU "
                             f"({trainer_memory_line(t)}) > gpu memory {gpu_bytes / GIB:.1f} GiB; "
                             f"increase pp, ep or tp ({memory_hint(spec, trainer, build, gpu_bytes - extra)})")
    if not report["rollout"]["weights_fit"]:
        try:
            rollout.validate(spec, gpu_memory_bytes=gpu_bytes)
        except ValueError as exc:
            errors["rollout"] = str(exc)
    elif not report["rollout"]["fits"]:
        errors["rollout"] = kv["error"]
    report["fits"] = not errors
    report["memory_errors"] = errors
    return {"job": job.name, **report}


def step_shape(job: JobConfig, prompt: int) -> StepShape:
    """The training step's longest micro-batch and the micro-batches per optimizer step and DP rank
    (moe.activation_memory), for prompts of at most `prompt` tokens (`longest_prompt`)."""
    from hpcrl.config.schema import data_parallel_size
    from hpcrl.config.validate import demonstration_len, rows_per_prompt

    d, t, a = job.data, job.trainer, job.algorithm
    response = (demonstration_len(job) if a.name == "sft" else None) or job.rollout.max_new_tokens
    seq = math.ceil((prompt + response) / t.tp) * t.tp
    rows = t.max_tokens_per_micro_batch // seq if t.max_tokens_per_micro_batch else t.micro_batch_size
    per_update = a.mini_batch_size or d.num_prompts_per_step * rows_per_prompt(job)
    per_rank = math.ceil(per_update / data_parallel_size(job))
    mb = max(1, min(rows, per_rank))
    return StepShape(seq_len=seq, response_len=response, micro_batch_size=mb,
                     num_micro_batches=math.ceil(per_rank / mb), entropy_grad=a.entropy_coef > 0,
                     recompute=t.recompute_granularity, recompute_method=t.recompute_method,
                     recompute_num_layers=t.recompute_num_layers)


def kv_cache_report(job: JobConfig, hf_dims: HFModelDims, rollout: Any, weights_bytes: float, gpu_bytes: int,
                    prompt: int) -> dict[str, Any] | None:
    """rollout.backend sglang: the KV pool SGLang 0.5.23 gives each engine GPU beside `weights_bytes`
    and how a step's samples (at most `prompt` + rollout.max_new_tokens tokens each) fit it
    (hpcrl/rollout/kv_pool.py). None for the reference engine, which allocates its cache per batch."""
    if job.rollout.backend != "sglang":
        return None
    from hpcrl.rollout.kv_pool import kv_pool

    return kv_pool(dims=hf_dims, tp=rollout.tp,
                   attn_dp=rollout.dp_attention, num_engines=rollout.num_engines,
                   engine_dtype=engine_dtype(job),
                   server_args=job.rollout.server_args, weights_bytes=weights_bytes, gpu_bytes=gpu_bytes,
                   prompt=prompt, max_new_tokens=job.rollout.max_new_tokens,
                   samples=job.data.num_prompts_per_step * job.algorithm.group_size)


def routes_report(job: JobConfig, hf_dims: HFModelDims, prompt: int) -> dict[str, Any] | None:
    """rollout.routing_replay's extra memory: the routes of one step's samples (uint8/int16 [tokens,
    MoE layers, top_k] per sample, at most `prompt` (`longest_prompt`) + rollout.max_new_tokens - 1
    tokens), and who holds them (`held_by`): the engines'
    (observe, r3) the controller and trainer rank 0; r2's, recorded by the trainer's old forward, every
    trainer rank (put together from every rank's layers and rows). None without routing replay."""
    if job.rollout.routing_replay == "none":
        return None
    from hpcrl.controller.routes import RouteFormat

    fmt = RouteFormat.of(hf_dims)
    tokens = prompt + job.rollout.max_new_tokens - 1
    per_sample = fmt.bytes_per_token() * tokens
    samples = job.data.num_prompts_per_step * job.algorithm.group_size
    held_by = "the controller and trainer rank 0" if engine_routes(job) else "every trainer rank (r2)"
    return {"bytes_per_token": fmt.bytes_per_token(), "max_tokens_per_sample": tokens,
            "bytes_per_sample": per_sample, "bytes_per_step": per_sample * samples, "held_by": held_by}


def async_report(job: JobConfig, routes: dict[str, Any] | None, prompt: int) -> dict[str, Any] | None:
    """rollout.max_staleness's extra memory: the k batches sampled ahead, held by the controller and
    saved in every checkpoint (hpcrl/controller/pipeline.py: 8-byte token ids of prompt, at most
    `prompt` tokens, and response,
    8-byte engine log-probs of the response, and the routes with routing replay), at their largest.
    None for a synchronous job."""
    k = job.rollout.max_staleness
    if not k:
        return None
    engines = routes["bytes_per_sample"] if routes and engine_routes(job) else 0  # r2's are the trainer's
    per_sample = 8 * prompt + 16 * job.rollout.max_new_tokens + engines
    per_batch = per_sample * job.data.num_prompts_per_step * job.algorithm.group_size
    return {"max_staleness": k, "bytes_per_batch": per_batch, "buffered_bytes": k * per_batch}


def _gib(x: float) -> str:
    return f"{x / GIB:.2f} GiB" if x >= 2**24 else f"{x / 2**20:.2f} MiB"


def render(report: dict[str, Any]) -> str:
    """The terminal form of `plan_job`'s report: moe.report's summary, the route this job's run
    takes listed first, then per-rank means and notes."""
    ws = report["weight_sync"]
    note = (f"this job's run takes the {ws['route']} route (rollout.backend {ws['rollout_backend']}, "
            f"rollout.weight_sync {ws['weight_sync']})")
    extra = [
        f"  per rank       shard route: trainer GPUs send max {_gib(report['max_send_bytes_per_gpu'])}, mean "
        f"{_gib(report['mean_send_bytes_per_gpu'])}; rollout GPUs receive max "
        f"{_gib(report['max_recv_bytes_per_gpu'])}, mean {_gib(report['mean_recv_bytes_per_gpu'])} "
        f"(must hold {_gib(report['must_hold_bytes_per_gpu'])})",
        "notes            shard route: estimate = per round, the slowest GPU's NIC share or NVLink time;",
        "                 lower bound = the NIC line rate, which no schedule beats. broadcast route:",
        "                 hpcrl = every tensor's source gathers it (all sources at once), then every",
        "                 rollout GPU receives the whole model; baseline = verl / slime: gather per",
        "                 pipeline stage, then broadcast every tensor to every rollout GPU. Per-GPU memory",
        "                 figures are maxima over GPUs.",
    ]
    act = report["trainer"]["activations"]
    step, top, last = act["step"], max(act["per_stage"], key=lambda st: st["bytes"]), act["per_stage"][-1]
    extra.insert(0, f"  activations    at least {_gib(act['bytes_per_gpu'])} per GPU, on pipeline stage {top['stage']} "
                    f"({top['in_flight']} micro-batch(es) in flight: layer inputs {_gib(top['layer_inputs_bytes'])}"
                    f" + log-prob head {_gib(top['head_bytes'])}; the last stage's head "
                    f"{_gib(last['head_bytes'])}); micro-batches of {step['micro_batch_size']} x {step['seq_len']} "
                    f"tokens ({act['prompt_from']} + {step['response_len']} response tokens), "
                    f"{step['num_micro_batches']} per update and DP rank; not counted: {act['not_counted']}")
    routes = report.get("routing_replay")
    if routes:
        extra.insert(1, f"  routes         rollout.routing_replay: {routes['bytes_per_token']} B per token, at most "
                        f"{_gib(routes['bytes_per_sample'])} per sample ({routes['max_tokens_per_sample']} tokens), "
                        f"{_gib(routes['bytes_per_step'])} per step on {routes['held_by']}")
    buffered = report.get("async")
    if buffered:
        extra.insert(1, f"  async          rollout.max_staleness {buffered['max_staleness']}: "
                        f"{_gib(buffered['buffered_bytes'])} of batches sampled ahead at most "
                        f"({_gib(buffered['bytes_per_batch'])} per batch), on the controller and in every "
                        "checkpoint")
    lines = render_text(report, first_route=ws["route"], weight_sync_note=note).split("\n")
    at = next(i for i, line in enumerate(lines) if line.startswith("  per GPU        weights ")) + 1
    lines.insert(at, kv_cache_line(report["rollout"]))
    nodes = report["rollout"].get("nodes_per_engine", 1)
    if nodes > 1:  # the line before the weights is the layout's
        lines[at - 2] += f", each engine over {nodes} nodes (rollout.nodes_per_engine)"
    return f"job              {report['job']}\n" + "\n".join(lines) + "\n" + "\n".join(extra)


def kv_cache_line(rollout: dict[str, Any]) -> str:
    """The `KV cache` line under the rollout's weights: SGLang's pool per GPU and how a step fits it."""
    kv = rollout.get("kv_cache")
    if kv is None:
        return "  KV cache       the reference engine allocates it per batch (not planned)"
    if not kv["modelled"]:
        return (f"  KV cache       not estimated: rollout.server_args has {', '.join(kv['unmodelled'])}, "
                "with which SGLang sizes its memory otherwise")
    layout = rollout["layout"]
    fraction = (f"--mem-fraction-static {kv['mem_fraction_static']:g} from rollout.server_args"
                if kv["from_server_args"] else
                f"--mem-fraction-static {kv['mem_fraction_static']:g}, its default here, reserving "
                f"{_gib(kv['reserved_bytes'])} for activations and CUDA graphs")
    where = "per engine" if layout["dp_attention"] == 1 else "per DP-attention group"
    if not kv["fits"]:
        step = "DOES NOT FIT (the error below says why)"
    elif kv["samples_at_once"] >= kv["samples_per_scheduler"]:
        step = "all at once  (fits)"
    else:
        step = (f"{kv['samples_at_once']} at once (max_running_requests {kv['max_running_requests']}), "
                f"{kv['waves']} waves  (fits)")
    return (f"  KV cache       at most {_gib(kv['pool_bytes'])} per GPU = {kv['pool_tokens']:,} tokens of "
            f"{kv['cell_bytes']:,} B (SGLang 0.5.23: {fraction}); a step's samples of up to "
            f"{kv['sample_tokens']:,} tokens: {kv['samples_per_scheduler']} {where}, {step}")


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
        raise ConfigError(side, layout_summary(job, side), f"{hint} (network.gpu_memory_gb="
                                                           f"{job.network.gpu_memory_gb:g})")
    return 0
