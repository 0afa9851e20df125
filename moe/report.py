"""The data behind `hpcrl plan`: memory per GPU, resharding bytes per rank, and modelled times.

`plan_report(spec, trainer, rollout, ...)` plans the trainer -> rollout weight sync at full scale
(virtual ranks only, no processes) and returns a JSON-ready dict; `render_text(report)` formats
it for a terminal. Memory: what each trainer rank allocates for `build` (moe.trainer_memory:
params, fp32 DDP grads, Adam state, a frozen reference model), rollout weights only (no KV cache).
Times follow the model in `moe.network`, one group per weight-sync route (`routes` in the report):
  shard route      trainer shards straight to the engines along the plan (hpcrl's reference engine
                   only): `estimate_s` and the NIC line-rate floor `lower_bound_s`;
  broadcast route  full HF tensors over SGLang's update_weights_from_distributed (SGLang and the
                   reference engine): hpcrl's multi-source broadcast `sglang_broadcast_s` (when
                   `broadcast_bucket_bytes` is given) and verl/slime's `baseline_broadcast_s`.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict
from typing import Any

import numpy as np

from moe.layouts import RolloutLayout, TrainerLayout, bytes_per_rank
from moe.network import (Topology, broadcast_baseline_seconds, estimate_seconds, lower_bound,
                         sglang_broadcast_seconds)
from moe.plan import plan
from moe.specs import MoESpec
from moe.trainer_memory import TrainerBuild, megatron_build, trainer_memory

DEFAULT_BUDGET_BYTES = 1 << 30

ROUTE_WHAT = {
    "shard": "trainer shards straight to the engines along the plan (rollout.weight_sync: shard)",
    "broadcast": "full HF tensors over SGLang's update_weights_from_distributed (rollout.weight_sync: "
                 "broadcast)",
}


def spec_dtype(spec: MoESpec) -> str:
    """The dtype most of the spec's elements have (the parameter dtype of a trainer built from it)."""
    numel: Counter[str] = Counter()
    for t in spec.tensors:
        numel[t.dtype] += t.numel
    return numel.most_common(1)[0][0]


def trainer_memory_summary(spec: MoESpec, trainer: TrainerLayout, build: TrainerBuild,
                           gpu_memory_bytes: int | None = None) -> dict[str, Any]:
    """Per-GPU trainer memory of `build` (each figure the max over GPUs), its build and `fits`."""
    mem = trainer_memory(spec, trainer, build)
    total = float(mem["total_bytes"].max())
    return {
        "build": {**asdict(build), "grad_dtype": "float32", "main_params": build.main_params,
                  "description": build.describe()},
        "params_bytes_per_gpu": float(mem["params_bytes"].max()),
        "grads_bytes_per_gpu": float(mem["grads_bytes"].max()),
        "optimizer_bytes_per_gpu": float(mem["optimizer_bytes"].max()),
        "adam_state_bytes_per_gpu": float(mem["adam_state_bytes"].max()),
        "main_params_bytes_per_gpu": float(mem["main_params_bytes"].max()),
        "reference_bytes_per_gpu": float(mem["reference_bytes"].max()),
        "critic_bytes_per_gpu": float(mem["critic_bytes"].max()),
        "total_bytes_per_gpu": total,
        "distributed_optimizer": build.distributed_optimizer,
        "fits": None if gpu_memory_bytes is None else total <= gpu_memory_bytes,
    }


def plan_report(spec: MoESpec, trainer: TrainerLayout, rollout: RolloutLayout, *,
                topology: Topology | None = None, memory_budget_bytes: int = DEFAULT_BUDGET_BYTES,
                gpu_memory_bytes: int | None = None, build: TrainerBuild | None = None,
                broadcast_bucket_bytes: int | None = None) -> dict[str, Any]:
    """Plan and summarise one weight sync. Raises ValueError for layouts that do not fit the spec.

    Keys include total_params, lower_bound_s, estimate_s, baseline_broadcast_s,
    max_recv_bytes_per_gpu and must_hold_bytes_per_gpu; `trainer`/`rollout` hold per-GPU memory and
    whether it fits `gpu_memory_bytes` (None when not given; the rollout's `weights_fit` is the
    weights' alone, which `fits` starts as and hpcrl plan narrows by the KV cache); `routes` groups
    the times by route.
    `build` defaults to `megatron_build` of the spec's dtype. With `broadcast_bucket_bytes`, also
    `sglang_broadcast_s` and `sglang_broadcast_terms` (hpcrl's broadcast in buckets of that size).
    """
    topo = topology or Topology()
    build = build or megatron_build(spec_dtype(spec))
    trainer.validate(spec)
    rollout.validate(spec)
    p = plan(trainer, rollout, spec, memory_budget_bytes, topo)
    weights = bytes_per_rank(spec, rollout.placement(spec), rollout.world_size)
    lb = lower_bound(spec, trainer.placement(spec), rollout.placement(spec), trainer.world_size,
                     rollout.world_size, topo)
    est = estimate_seconds(p)
    base = broadcast_baseline_seconds(spec, trainer, topo)
    sent, recv = p.sent_bytes(), p.received_bytes()
    nic = int(p.nbytes[~p.intra_node].sum())
    must_hold = float(weights.max())
    out = {
        "model": spec.name,
        "total_params": spec.total_params,
        "total_bytes": spec.total_bytes,
        "params_by_kind": {str(k): v for k, v in spec.params_by_kind().items()},
        "trainer": {"layout": asdict(trainer), "world_size": trainer.world_size,
                    **trainer_memory_summary(spec, trainer, build, gpu_memory_bytes)},
        "rollout": {
            "layout": asdict(rollout), "world_size": rollout.world_size,
            "weights_bytes_per_gpu": must_hold,
            "weights_fit": None if gpu_memory_bytes is None else must_hold <= gpu_memory_bytes,
            "fits": None if gpu_memory_bytes is None else must_hold <= gpu_memory_bytes,
        },
        "network": asdict(topo),
        "plan": {
            "num_transfers": len(p), "num_rounds": p.num_rounds, "memory_budget_bytes": memory_budget_bytes,
            "nic_bytes": nic, "nvlink_bytes": int(p.nbytes.sum()) - nic,
            "max_staging_bytes_per_round": float(p.staging_bytes().max()) if len(p) else 0.0,
            "planning_s": p.planning_s, "planning_cpu_s": p.planning_cpu_s,
        },
        "must_hold_bytes_per_gpu": must_hold,
        "max_recv_bytes_per_gpu": float(recv.max()) if len(recv) else 0.0,
        "max_send_bytes_per_gpu": float(sent.max()) if len(sent) else 0.0,
        "mean_send_bytes_per_gpu": float(np.mean(sent)) if len(sent) else 0.0,
        "lower_bound_s": float(lb["lower_bound_s"]),
        "estimate_s": est,
        "estimate_over_lower_bound": est / lb["lower_bound_s"] if lb["lower_bound_s"] else float("nan"),
        "baseline_broadcast_s": base["baseline_broadcast_s"],
        "speedup_vs_baseline": base["baseline_broadcast_s"] / est if est else float("nan"),
        "lower_bound_terms": {k: float(v) for k, v in lb.items()},
        "baseline_terms": base,
    }
    routes: dict[str, dict[str, Any]] = {
        "shard": {"what": ROUTE_WHAT["shard"],
                  "engines": "hpcrl reference engine; SGLang (Qwen3-MoE) through hpcrl's loader",
                  "estimate_s": est, "lower_bound_s": out["lower_bound_s"]},
        "broadcast": {"what": ROUTE_WHAT["broadcast"], "engines": "SGLang and the hpcrl reference engine",
                      "baseline_broadcast_s": out["baseline_broadcast_s"]},
    }
    if broadcast_bucket_bytes is not None:
        sglang = sglang_broadcast_seconds(spec, trainer, topo, broadcast_bucket_bytes)
        out["sglang_broadcast_s"] = sglang.pop("sglang_broadcast_s")
        out["sglang_broadcast_terms"] = sglang
        routes["broadcast"]["sglang_broadcast_s"] = out["sglang_broadcast_s"]
    out["routes"] = routes
    return out


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**24 else f"{x / 2**20:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n:,}"


def trainer_memory_line(t: dict[str, Any]) -> str:
    """'params 6.99 GiB + grads 13.97 GiB + optimizer 32.15 GiB (...) = 53.11 GiB' of a memory summary."""
    opt = f"optimizer {_gib(t['optimizer_bytes_per_gpu'])}"
    if t["main_params_bytes_per_gpu"]:
        opt += (f" (main params {_gib(t['main_params_bytes_per_gpu'])} + Adam m, v "
                f"{_gib(t['adam_state_bytes_per_gpu'])})")
    ref = f" + reference {_gib(t['reference_bytes_per_gpu'])}" if t["reference_bytes_per_gpu"] else ""
    ref += f" + critic {_gib(t['critic_bytes_per_gpu'])}" if t.get("critic_bytes_per_gpu") else ""
    ref += (f" + broadcast buffers {_gib(t['sync_buffer_bytes_per_gpu'])}" if t.get("sync_buffer_bytes_per_gpu")
            else "")
    ref += (f" + activations >= {_gib(t['activations_bytes_per_gpu'])}" if "activations_bytes_per_gpu" in t
            else "")
    return (f"params {_gib(t['params_bytes_per_gpu'])} + grads {_gib(t['grads_bytes_per_gpu'])} + {opt}{ref} "
            f"= {_gib(t['total_bytes_per_gpu'])}")


def route_lines(r: dict[str, Any], first: str = "shard") -> list[str]:
    """The weight-sync times of a report, one line per route, `first` ("shard" | "broadcast") first."""
    shard = ("  shard          trainer shards straight to the engines (reference engine; SGLang "
             "Qwen3-MoE via hpcrl's loader): "
             f"estimate {r['estimate_s']:.4g} s | line-rate lower bound {r['lower_bound_s']:.4g} s "
             f"(estimate x{r['estimate_over_lower_bound']:.3f})")
    hpcrl = ""
    if "sglang_broadcast_s" in r:
        sg = r["sglang_broadcast_terms"]
        hpcrl = (f"hpcrl {r['sglang_broadcast_s']:.4g} s ({int(sg['num_sources'])} sources gather "
                 f"{sg['gather_s']:.3g} s, then every rollout GPU receives the whole model "
                 f"{sg['broadcast_s']:.4g} s) | ")
    broadcast = ("  broadcast      SGLang's update_weights_from_distributed (SGLang and the reference "
                 f"engine): {hpcrl}verl/slime broadcast baseline {r['baseline_broadcast_s']:.4g} s "
                 f"(x{r['speedup_vs_baseline']:.1f} the shard estimate)")
    return [shard, broadcast] if first == "shard" else [broadcast, shard]


def render_text(r: dict[str, Any], first_route: str = "shard", weight_sync_note: str = "") -> str:
    """A terminal summary of a `plan_report` dict; the route `first_route` is listed first.

    Optional keys it shows when present: `trainer.other_build` (a `trainer_memory_summary` of another
    build, on its own line) and `build.note` in either summary (appended to its line).
    """
    t, ro, pl, net = r["trainer"], r["rollout"], r["plan"], r["network"]

    def fits(v: bool | None) -> str:
        return "" if v is None else ("  (fits)" if v else "  (DOES NOT FIT)")

    def note(summary: dict[str, Any]) -> str:
        return f"; {summary['build']['note']}" if summary["build"].get("note") else ""

    tl, rl = t["layout"], ro["layout"]
    lines = [
        f"model            {r['model']}: {_params(r['total_params'])} params, {_gib(r['total_bytes'])}",
        f"trainer          {t['world_size']} GPUs  tp={tl['tp']} pp={tl['pp']} ep={tl['ep']} etp={tl['etp']} "
        f"dp={tl['dp']} cp={tl['cp']}",
        f"  build          {t['build']['description']}{note(t)}",
        f"  per GPU        {trainer_memory_line(t)}{fits(t['fits'])}",
        *([f"  {o['build']['param_dtype'] + ' build':<15}{trainer_memory_line(o)}{fits(o['fits'])}{note(o)}"]
          if (o := t.get("other_build")) else []),
        f"rollout          {ro['world_size']} GPUs  {rl['num_engines']} engines x tp={rl['tp']} "
        f"ep={rl['ep']} dp_attention={rl['dp_attention']}",
        f"  per GPU        weights {_gib(ro['weights_bytes_per_gpu'])}{fits(ro['weights_fit'])}",
        f"network          {net['gpus_per_node']} GPUs/node, {net['nics_per_node']} x "
        f"{net['nic_gbit_per_s']:g} Gb/s NICs/node, NVLink {net['nvlink_gbyte_per_s']:g} GB/s"
        f"{', colocated' if net['colocated'] else ''}",
        f"plan             shard route: {pl['num_transfers']:,} transfers in {pl['num_rounds']} rounds "
        f"(budget {_gib(pl['memory_budget_bytes'])}/GPU/round), planned in {pl['planning_s']:.2f} s "
        f"({pl['planning_cpu_s']:.2f} s CPU)",
        f"  bytes          NIC {pl['nic_bytes'] / 1e12:.2f} TB, NVLink {pl['nvlink_bytes'] / 1e12:.2f} TB; "
        f"per GPU recv max {_gib(r['max_recv_bytes_per_gpu'])}, send max {_gib(r['max_send_bytes_per_gpu'])}",
        "weight sync      time per sync, by route" + (f"; {weight_sync_note}" if weight_sync_note else ""),
        *route_lines(r, first_route),
    ]
    return "\n".join(lines)
