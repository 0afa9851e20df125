"""GPU placement: which GPUs of its node each rank's process uses (resources.device: cuda).

Per node, the ranks that run there take GPUs in world-rank order: the controller none, a trainer
rank one, a rollout rank `rollout.tp_per_engine / rollout.nodes_per_engine` consecutive ones (its
engine's TP ranks on that node: all of them for an engine of one node). Indices
are into the GPUs the process sees (CUDA_VISIBLE_DEVICES order, which Slurm sets per step from the
job's `--gpus-per-node`), and every process keeps seeing the whole node so that NCCL between
trainer and engine GPUs of one node can use NVLink. The engine is pointed at its first GPU:
SGLang with `--base-gpu-id` (its TP ranks take base, base+1, ...), the reference engine with
`--device cuda:N`; a trainer rank calls `torch.cuda.set_device`.

A node whose ranks need more GPUs than it has is an error naming the job keys, unless
`resources.share_gpus` is true (then GPUs are dealt round robin, an engine's block kept contiguous).
Under a per-task GPU binding (the step run with `--gpus-per-task`, so Slurm sets
SLURM_GPUS_PER_TASK and each task sees only its own GPUs) a rank uses the GPUs it sees, from 0.

Shared GPUs and NCCL: NCCL refuses a communicator with two ranks on one GPU ("Duplicate GPU
detected", NCCL 2.28.9 on an H200: a trainer rank and its engine sharing GPU 0 could not form the
weight-update group). With `resources.share_gpus` on CUDA every rank process therefore takes its
own NCCL_HOSTID (`share_gpu_host_id`), which its engine inherits: NCCL then treats the processes as
separate hosts and connects them over its network transport (slower than NVLink or shared memory,
and only in this debug mode; a NCCL_HOSTID the user set is kept).

    gpus = rank_gpus(world, job)                   # in the rank's process
    sglang_gpu_args(gpus) -> ["--base-gpu-id", "2"]
    node_plan([(0, "controller"), (1, "trainer"), (2, "rollout")], tp_per_engine=2, num_gpus=4)
        -> {0: (), 1: (0,), 2: (1, 2)}
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from hpcrl.config.schema import rollout_ranks

__all__ = ["PlacementError", "check_engine_hosts", "engine_node_gpus", "gpus_needed", "node_plan",
           "rank_gpus", "set_shared_gpu_host", "sglang_gpu_args", "share_gpu_host_id", "slurm_node_roles",
           "visible_gpu_count"]

FIX = ("use fewer trainer.num_procs / rollout.num_engines / rollout.tp_per_engine per node, more "
       "resources.nodes / resources.rollout_nodes, or set resources.share_gpus: true to let ranks share GPUs")


class PlacementError(ValueError):
    """The ranks of a node do not fit its GPUs; the message names the keys to change."""


def share_gpu_host_id(tag: str) -> str:
    """A NCCL_HOSTID unique to one process of this host (`tag`: e.g. its world rank)."""
    import socket

    return f"{socket.gethostname()}-hpcrl-{tag}"


def set_shared_gpu_host(job: Any, tag: str, env: dict[str, str] | None = None) -> bool:
    """Give this process its own NCCL_HOSTID when `resources.share_gpus` is on with CUDA (see the
    module docstring), unless NCCL_HOSTID is set already. Call before any NCCL communicator exists;
    processes started afterwards (the engines) inherit it. Returns whether it set one."""
    env = os.environ if env is None else env
    if not (job.resources.share_gpus and job.resources.device == "cuda") or "NCCL_HOSTID" in env:
        return False
    env["NCCL_HOSTID"] = share_gpu_host_id(tag)
    return True


def engine_node_gpus(job: Any) -> int:
    """GPUs of one rollout rank: its engine's TP ranks on its node (tp_per_engine / nodes_per_engine)."""
    return job.rollout.tp_per_engine // job.rollout.nodes_per_engine


def gpus_needed(role: str, engine_gpus: int) -> int:
    """GPUs one rank of `role` uses: controller 0, trainer 1, rollout `engine_gpus` (engine_node_gpus)."""
    return {"controller": 0, "trainer": 1, "rollout": engine_gpus}[role]


def node_plan(ranks: Sequence[tuple[int, str]], engine_gpus: int, num_gpus: int, share: bool = False,
              where: str = "this node") -> dict[int, tuple[int, ...]]:
    """GPU indices of every rank of one node, `ranks` being (world rank, role) of the ranks there,
    a rollout rank taking `engine_gpus` (engine_node_gpus).

    Without `share`, GPUs are given out in world-rank order and no two ranks get the same GPU;
    raises PlacementError if the node has fewer than the ranks need. With `share`, they are dealt
    round robin (an engine's block restarts at GPU 0 rather than wrap); an engine still needs
    `engine_gpus <= num_gpus` distinct GPUs.
    """
    ordered = sorted(ranks)
    need = sum(gpus_needed(role, engine_gpus) for _, role in ordered)
    if need and num_gpus < 1:
        raise PlacementError(f"{where} has no GPU but its ranks need {need} (resources.device: cuda); run "
                             "where GPUs are visible (CUDA_VISIBLE_DEVICES), or use resources.device: cpu")
    if engine_gpus > num_gpus and any(role == "rollout" for _, role in ordered):
        raise PlacementError(f"an engine node's {engine_gpus} GPUs (rollout.tp_per_engine / "
                             f"nodes_per_engine) are more than the {num_gpus} of {where}; an engine runs on "
                             "one node unless rollout.nodes_per_engine spreads it: use tp_per_engine / "
                             f"nodes_per_engine <= {num_gpus}")
    if need > num_gpus and not share:
        roles = ", ".join(f"rank {r} ({role}: {gpus_needed(role, engine_gpus)})" for r, role in ordered)
        raise PlacementError(f"{where} has {num_gpus} GPU(s) but its ranks need {need} (one per trainer "
                             f"rank, {engine_gpus} per rollout rank: rollout.tp_per_engine / "
                             f"nodes_per_engine): {roles}; {FIX}")
    out: dict[int, tuple[int, ...]] = {}
    cursor = 0
    for rank, role in ordered:
        n = gpus_needed(role, engine_gpus)
        if n and cursor + n > num_gpus:
            cursor = 0  # only reached with share: start over at GPU 0
        out[rank] = tuple(range(cursor, cursor + n))
        cursor = (cursor + n) % num_gpus if num_gpus else 0
    return out


def visible_gpu_count(env: Mapping[str, str] | None = None) -> int:
    """GPUs this process sees: the entries of CUDA_VISIBLE_DEVICES when set, else what torch counts."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    import torch

    return torch.cuda.device_count()


def rank_gpus(world: Any, job: Any, env: Mapping[str, str] | None = None,
              num_visible: int | None = None) -> tuple[int, ...]:
    """This rank's GPU indices (into the GPUs it sees). `world` is an hpcrl.controller.comm.World
    (its rank table names every rank's role and host), `job` the JobConfig. Raises PlacementError
    when this rank's node cannot hold its ranks' GPUs."""
    env = os.environ if env is None else env
    tp, share = engine_node_gpus(job), job.resources.share_gpus
    num_visible = visible_gpu_count(env) if num_visible is None else num_visible
    me = world.ranks[world.rank]
    need = gpus_needed(me.role, tp)
    if env.get("SLURM_GPUS_PER_TASK"):
        if need > num_visible:
            raise PlacementError(f"rank {me.rank} ({me.role}) on {me.host} needs {need} GPU(s) but its "
                                 f"task sees {num_visible} (srun --gpus-per-task="
                                 f"{env['SLURM_GPUS_PER_TASK']}); give each task at least {need}")
        return tuple(range(need))
    mates = [(r.rank, r.role) for r in world.ranks if r.host == me.host]
    return node_plan(mates, tp, num_visible, share, where=f"node {me.host}")[me.rank]


def check_engine_hosts(world: Any, job: Any) -> None:
    """SGLang engines over rollout.nodes_per_engine nodes: each engine's ranks (consecutive rollout
    ranks) on as many hosts, as SGLang starts one node's TP ranks per host (on one host two of its
    nodes would take the same ports). Every rollout rank checks every engine, so all fail alike."""
    n = job.rollout.nodes_per_engine
    if n == 1 or job.rollout.backend != "sglang":
        return
    ranks = world.ranks_of("rollout")
    for e in range(len(ranks) // n):
        hosts = [world.ranks[r].host for r in ranks[e * n:(e + 1) * n]]
        if len(set(hosts)) < n:
            raise PlacementError(f"engine {e} spans rollout.nodes_per_engine={n} nodes but its rollout ranks "
                                 f"{ranks[e * n:(e + 1) * n]} run on hosts {hosts}: give every engine node a "
                                 "host of its own (resources.rollout_nodes = num_engines x "
                                 "nodes_per_engine)")


def sglang_gpu_args(gpus: Sequence[int]) -> list[str]:
    """SGLang's flags for an engine on `gpus` (consecutive, from `rank_gpus`): its TP ranks take
    GPUs base, base+1, ... (server_args base_gpu_id, gpu_id_step 1). Empty on CPU (no GPUs)."""
    if not gpus:
        return []
    if list(gpus) != list(range(gpus[0], gpus[0] + len(gpus))):
        raise ValueError(f"an engine's GPUs must be consecutive, got {list(gpus)}")
    return ["--base-gpu-id", str(gpus[0])]


def slurm_node_roles(job: Any) -> list[tuple[str, list[tuple[int, str]]]]:
    """Where `hpcrl submit` puts the ranks, per node: (YAML key of the node's component, [(world rank,
    role)]). Component 0 holds the controller and trainer ranks (and the rollout ranks when
    resources.rollout_nodes is 0), component 1 the rollout ranks; each component's ranks are spread
    evenly over its nodes in order, the first (ranks % nodes) nodes taking one more (Slurm's block
    layout under launch/slurm_submit.py's --ntasks-per-node=ceil plus --ntasks: 9 on 2 nodes 5 + 4,
    7 on 3 nodes 3 + 2 + 2). A run places by the rank table it actually gets, whatever Slurm did."""
    res, num_trainer = job.resources, job.trainer.num_procs
    roles = ["controller"] + ["trainer"] * num_trainer + ["rollout"] * rollout_ranks(job)
    if res.rollout_nodes > 0:
        components = [("resources.nodes", res.nodes, list(range(1 + num_trainer))),
                      ("resources.rollout_nodes", res.rollout_nodes,
                       list(range(1 + num_trainer, len(roles))))]
    else:
        components = [("resources.nodes", res.nodes, list(range(len(roles))))]
    out = []
    for key, nodes, ranks in components:
        base, extra = divmod(len(ranks), nodes)
        start = 0
        for n in range(nodes):
            size = base + (n < extra)
            if size:
                out.append((key, [(r, roles[r]) for r in ranks[start:start + size]]))
            start += size
    return out
