"""The data behind `hpcrl plan`: memory per GPU, resharding bytes per rank, and modelled times.

`plan_report(spec, trainer, rollout, ...)` plans the trainer -> rollout weight sync at full scale
(virtual ranks only, no processes) and returns a JSON-ready dict; `render_text(report)` formats
it for a terminal. Times follow the model in `moe.network`: `estimate_s` for the plan,
`lower_bound_s` for the NIC line-rate floor, `baseline_broadcast_s` for verl/slime's
gather-then-broadcast. Memory: trainer params at the spec dtype, fp32 grads, Adam state (fp32
master + m + v, sharded over replicas with the distributed optimizer); rollout weights only (no
KV cache).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

import numpy as np

from moe.layouts import RolloutLayout, TrainerLayout, bytes_per_rank, trainer_memory
from moe.network import Topology, broadcast_baseline_seconds, estimate_seconds, lower_bound
from moe.plan import plan
from moe.specs import MoESpec

DEFAULT_BUDGET_BYTES = 1 << 30


def plan_report(spec: MoESpec, trainer: TrainerLayout, rollout: RolloutLayout, *,
                topology: Topology | None = None, memory_budget_bytes: int = DEFAULT_BUDGET_BYTES,
                gpu_memory_bytes: int | None = None, distributed_optimizer: bool = True) -> dict[str, Any]:
    """Plan and summarise one weight sync. Raises ValueError for layouts that do not fit the spec.

    Keys include total_params, lower_bound_s, estimate_s, baseline_broadcast_s,
    max_recv_bytes_per_gpu and must_hold_bytes_per_gpu; `trainer`/`rollout` hold per-GPU memory and
    whether it fits `gpu_memory_bytes` (None when not given).
    """
    topo = topology or Topology()
    trainer.validate(spec)
    rollout.validate(spec)
    p = plan(trainer, rollout, spec, memory_budget_bytes, topo)
    mem = trainer_memory(spec, trainer, distributed_optimizer)
    weights = bytes_per_rank(spec, rollout.placement(spec), rollout.world_size)
    lb = lower_bound(spec, trainer.placement(spec), rollout.placement(spec), trainer.world_size,
                     rollout.world_size, topo)
    est = estimate_seconds(p)
    base = broadcast_baseline_seconds(spec, trainer, topo)
    sent, recv = p.sent_bytes(), p.received_bytes()
    nic = int(p.nbytes[~p.intra_node].sum())
    trainer_total = float(mem["total_bytes"].max())
    must_hold = float(weights.max())
    return {
        "model": spec.name,
        "total_params": spec.total_params,
        "total_bytes": spec.total_bytes,
        "params_by_kind": {str(k): v for k, v in spec.params_by_kind().items()},
        "trainer": {
            "layout": asdict(trainer), "world_size": trainer.world_size,
            "params_bytes_per_gpu": float(mem["params_bytes"].max()),
            "grads_bytes_per_gpu": float(mem["grads_bytes"].max()),
            "optimizer_bytes_per_gpu": float(mem["optimizer_bytes"].max()),
            "total_bytes_per_gpu": trainer_total,
            "distributed_optimizer": distributed_optimizer,
            "fits": None if gpu_memory_bytes is None else trainer_total <= gpu_memory_bytes,
        },
        "rollout": {
            "layout": asdict(rollout), "world_size": rollout.world_size,
            "weights_bytes_per_gpu": must_hold,
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


def _gib(x: float) -> str:
    return f"{x / 2**30:.2f} GiB" if x >= 2**24 else f"{x / 2**20:.2f} MiB"


def _params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n:,}"


def render_text(r: dict[str, Any]) -> str:
    """A terminal summary of a `plan_report` dict."""
    t, ro, pl, net = r["trainer"], r["rollout"], r["plan"], r["network"]

    def fits(v: bool | None) -> str:
        return "" if v is None else ("  (fits)" if v else "  (DOES NOT FIT)")

    tl, rl = t["layout"], ro["layout"]
    lines = [
        f"model            {r['model']}: {_params(r['total_params'])} params, {_gib(r['total_bytes'])}",
        f"trainer          {t['world_size']} GPUs  tp={tl['tp']} pp={tl['pp']} ep={tl['ep']} etp={tl['etp']} "
        f"dp={tl['dp']} cp={tl['cp']}",
        f"  per GPU        params {_gib(t['params_bytes_per_gpu'])} + grads {_gib(t['grads_bytes_per_gpu'])} "
        f"+ optimizer {_gib(t['optimizer_bytes_per_gpu'])} = {_gib(t['total_bytes_per_gpu'])}{fits(t['fits'])}",
        f"rollout          {ro['world_size']} GPUs  {rl['num_engines']} engines x tp={rl['tp']} ep={rl['ep']} "
        f"dp_attention={rl['dp_attention']}",
        f"  per GPU        weights {_gib(ro['weights_bytes_per_gpu'])}{fits(ro['fits'])}",
        f"network          {net['gpus_per_node']} GPUs/node, {net['nics_per_node']} x {net['nic_gbit_per_s']:g} Gb/s "
        f"NICs/node, NVLink {net['nvlink_gbyte_per_s']:g} GB/s{', colocated' if net['colocated'] else ''}",
        f"plan             {pl['num_transfers']:,} transfers in {pl['num_rounds']} rounds "
        f"(budget {_gib(pl['memory_budget_bytes'])}/GPU/round), planned in {pl['planning_s']:.2f} s "
        f"({pl['planning_cpu_s']:.2f} s CPU)",
        f"  bytes          NIC {pl['nic_bytes'] / 1e12:.2f} TB, NVLink {pl['nvlink_bytes'] / 1e12:.2f} TB; "
        f"per GPU recv max {_gib(r['max_recv_bytes_per_gpu'])}, send max {_gib(r['max_send_bytes_per_gpu'])}",
        f"time             estimate {r['estimate_s']:.4g} s | line-rate lower bound {r['lower_bound_s']:.4g} s "
        f"(estimate x{r['estimate_over_lower_bound']:.3f}) | broadcast baseline {r['baseline_broadcast_s']:.4g} s "
        f"(x{r['speedup_vs_baseline']:.1f} the estimate)",
    ]
    return "\n".join(lines)
