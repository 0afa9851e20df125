"""Network and time model for weight resharding: where ranks sit, and how long bytes take.

`Topology` places ranks on nodes and gives link rates (default: H100 DGX, 8 GPUs per node,
8 x 400 Gb/s InfiniBand NICs per node, NVLink 450 GB/s per direction per GPU). Trainer ranks fill
nodes 0..; rollout ranks fill the following nodes (a heterogeneous job), or the same nodes as
trainer ranks 0.. when `colocated`. Each GPU owns a 1/gpus_per_node share of its node's NIC
bandwidth (rail-optimised DGX: one NIC per GPU). Links are full duplex.

Three numbers describe a resharding:
  * estimate      = sum over plan rounds of the slowest rank in that round, where a rank's time in
                    a round is max(NIC bytes out, NIC bytes in) / its NIC share and
                    max(NVLink bytes out, in) / NVLink rate, whichever is larger (+ round_latency_s).
  * lower bound   = the line-rate floor no schedule can beat: the max of
                    (a) per rollout node, the distinct bytes its GPUs must hold that no GPU on that
                        node already has, over the node's NIC rate;
                    (b) per trainer node, the bytes only that node holds times the number of rollout
                        nodes that need them, over the node's NIC rate;
                    (c) all bytes that must cross a NIC, over the NIC rate of all trainer GPUs.
                    A node's NIC rate here is the per-GPU share times the GPUs the layout uses on
                    it (the full node rate when the layout fills the node).
  * broadcast baseline = the path verl and slime take (`update_weights_from_distributed`): per
                    pipeline stage one source rank gathers full HF tensors (TP all-gather over
                    NVLink, then the expert all-gather over the EP x ETP group: NVLink when that
                    group fits in one node, else NIC), and NCCL-broadcasts every tensor to every
                    rollout rank. A pipelined broadcast delivers every byte through every
                    receiver's NIC share, so it takes total_bytes / NIC share; stages broadcast
                    concurrently but share the receivers' NICs. Gather and broadcast are not
                    overlapped within a stage, so baseline = max stage gather time
                    + total_bytes / NIC share per GPU.
  * SGLang path    = hpcrl's own broadcast for `rollout.backend: sglang` (hpcrl/trainer/broadcast_sync.py):
                    every tensor has one source (moe/sources.py, at most one per bucket's worth), the
                    sources gather their missing pieces at once (the slowest source's incoming bytes,
                    NVLink on its node, NIC otherwise), then broadcast in turns. SGLang loads whole
                    tensors on every TP rank, so every rollout GPU still receives every byte: the same
                    total_bytes / NIC share as the baseline. Only the gather term shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from moe.specs import MoESpec, Role

if TYPE_CHECKING:
    from moe.layouts import TensorPlacement, TrainerLayout
    from moe.plan import Plan


@dataclass(frozen=True, slots=True)
class Topology:
    """Node placement of ranks and link rates. Rates are per direction (links are full duplex)."""

    gpus_per_node: int = 8
    nics_per_node: int = 8
    nic_gbit_per_s: float = 400.0
    nvlink_gbyte_per_s: float = 450.0
    colocated: bool = False
    round_latency_s: float = 0.0

    def __post_init__(self) -> None:
        for n in ("gpus_per_node", "nics_per_node"):
            v = getattr(self, n)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Topology.{n}={v!r} must be a positive int")
        for n in ("nic_gbit_per_s", "nvlink_gbyte_per_s"):
            if not getattr(self, n) > 0:
                raise ValueError(f"Topology.{n}={getattr(self, n)!r} must be > 0")
        if self.round_latency_s < 0:
            raise ValueError(f"Topology.round_latency_s={self.round_latency_s} must be >= 0")

    @property
    def node_nic_bytes_per_s(self) -> float:
        return self.nics_per_node * self.nic_gbit_per_s * 1e9 / 8

    @property
    def gpu_nic_bytes_per_s(self) -> float:
        return self.node_nic_bytes_per_s / self.gpus_per_node

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbyte_per_s * 1e9

    def trainer_nodes(self, trainer_world: int) -> np.ndarray:
        return np.arange(trainer_world) // self.gpus_per_node

    def rollout_nodes(self, trainer_world: int, rollout_world: int) -> np.ndarray:
        first = 0 if self.colocated else -(-trainer_world // self.gpus_per_node)
        return first + np.arange(rollout_world) // self.gpus_per_node


def round_seconds(plan: Plan) -> np.ndarray:
    """Modelled time of every round of `plan` (see the module docstring)."""
    topo = plan.topology
    n_src, n_dst = plan.src.world_size, plan.dst.world_size
    gid_src = np.where(plan.from_rollout, plan.src_rank + n_src, plan.src_rank).astype(np.int64)
    gid_dst = plan.dst_rank.astype(np.int64) + n_src
    n = n_src + n_dst
    rounds = plan.round.astype(np.int64)
    times = np.zeros(plan.num_rounds)
    w = plan.nbytes.astype(np.float64)
    for link_mask, rate in ((~plan.intra_node, topo.gpu_nic_bytes_per_s), (plan.intra_node, topo.nvlink_bytes_per_s)):
        if not link_mask.any():
            continue
        r, ws = rounds[link_mask], w[link_mask]
        out = np.bincount(r * n + gid_src[link_mask], weights=ws, minlength=plan.num_rounds * n)
        inn = np.bincount(r * n + gid_dst[link_mask], weights=ws, minlength=plan.num_rounds * n)
        per = np.maximum(out, inn).reshape(plan.num_rounds, n).max(axis=1) / rate
        times = np.maximum(times, per)
    return times + topo.round_latency_s


def estimate_seconds(plan: Plan) -> float:
    """Sum over rounds of the slowest rank's time in that round."""
    return float(round_seconds(plan).sum())


def lower_bound(spec: MoESpec, src_pl: list[TensorPlacement], dst_pl: list[TensorPlacement],
                src_world: int, dst_world: int, topo: Topology) -> dict[str, float]:
    """Line-rate lower bound (module docstring) and the byte counts behind it, from placements only."""
    src_nodes, dst_nodes = topo.trainer_nodes(src_world), topo.rollout_nodes(src_world, dst_world)
    n_nodes = int(max(src_nodes.max(), dst_nodes.max())) + 1
    # Bytes per (holder ranks, sender ranks) pair; the node arithmetic is then done once per pair.
    pair_bytes: dict[tuple[int, int], float] = {}
    pair_ranks: dict[tuple[int, int], tuple[tuple[int, ...], tuple[int, ...]]] = {}
    for t, spl, dpl in zip(spec.tensors, src_pl, dst_pl):
        for dbox, dranks in dpl:
            for sbox, sranks in spl:
                piece = sbox.intersect(dbox)
                if piece is None:
                    continue
                key = (id(dranks), id(sranks))
                if key not in pair_ranks:
                    pair_ranks[key] = (dranks, sranks)
                    pair_bytes[key] = 0.0
                pair_bytes[key] += piece.numel * t.itemsize
    unique_in = np.zeros(n_nodes)
    forced_out = np.zeros(n_nodes)
    total_cross = 0.0
    for key, b in pair_bytes.items():
        dranks, sranks = pair_ranks[key]
        dn = np.unique(dst_nodes[list(dranks)])
        sn = np.unique(src_nodes[list(sranks)])
        needing = np.setdiff1d(dn, sn) if topo.colocated else dn
        unique_in[needing] += b
        total_cross += b * len(needing)
        if len(sn) == 1:
            forced_out[sn[0]] += b * len(needing)
    # A node's usable NIC rate is its share per GPU times the GPUs this side uses on it (rail-optimised
    # NICs: a node only partly filled by a layout cannot use the NICs of its idle GPUs).
    share = topo.gpu_nic_bytes_per_s
    dst_bw = np.bincount(dst_nodes, minlength=n_nodes) * share
    src_bw = np.bincount(src_nodes, minlength=n_nodes) * share
    with np.errstate(divide="ignore", invalid="ignore"):
        in_s = np.where(unique_in > 0, unique_in / dst_bw, 0.0)
        out_s = np.where(forced_out > 0, forced_out / src_bw, 0.0)
    terms = {"dst_node_in_s": float(in_s.max()), "src_node_forced_out_s": float(out_s.max()),
             "aggregate_s": total_cross / (src_world * share)}
    return {"lower_bound_s": max(terms.values()), **terms, "cross_node_bytes": total_cross,
            "max_node_in_bytes": float(unique_in.max())}


def broadcast_baseline_seconds(spec: MoESpec, src: TrainerLayout, topo: Topology) -> dict[str, float]:
    """The gather-then-broadcast baseline of verl / slime (module docstring), and its two parts."""
    stage_of = src.stage_of_layers(spec)
    dense_b = np.zeros(src.pp)
    expert_b = np.zeros(src.pp)
    for t in spec.tensors:
        if t.role is Role.EMBED:
            p = 0
        elif t.layer is None:
            p = src.pp - 1
        else:
            p = stage_of[t.layer]
        if t.role in (Role.EXPERT_COL, Role.EXPERT_ROW):
            expert_b[p] += t.nbytes
        else:
            dense_b[p] += t.nbytes
    nvl, nic = topo.nvlink_bytes_per_s, topo.gpu_nic_bytes_per_s
    group = src.ep * src.etp
    expert_rate = nvl if group <= topo.gpus_per_node else nic
    gather = (dense_b * (src.tp - 1) / src.tp / nvl + expert_b * (group - 1) / group / expert_rate)
    bcast = spec.total_bytes / nic
    return {"baseline_broadcast_s": float(gather.max() + bcast), "gather_s": float(gather.max()),
            "broadcast_s": float(bcast)}


def sglang_broadcast_seconds(spec: MoESpec, src: TrainerLayout, topo: Topology,
                             bucket_bytes: int = 64 << 20) -> dict[str, float]:
    """hpcrl's multi-source broadcast over SGLang's routes (module docstring), and its two parts;
    `source_buffer_bytes`: the largest share one source gathers into its GPU's memory and keeps
    across syncs (hpcrl/trainer/broadcast_sync.py)."""
    from moe.sources import assign_sources, gather_holder, source_cap

    placement = src.placement(spec)
    buckets = assign_sources(spec, placement, bucket_bytes, packed=True,
                             max_sources=source_cap(spec, bucket_bytes))
    nodes = topo.trainer_nodes(src.world_size)
    near, far = np.zeros(src.world_size), np.zeros(src.world_size)
    for s, bs in enumerate(buckets):
        for b in bs:
            for ti in b.tensors:
                t = spec.tensors[ti]
                for box, ranks in placement[ti]:
                    if s in ranks:
                        continue
                    holder = gather_holder(ti, s, ranks)
                    (near if nodes[holder] == nodes[s] else far)[s] += box.numel * t.itemsize
    gather = float((near / topo.nvlink_bytes_per_s + far / topo.gpu_nic_bytes_per_s).max())
    bcast = spec.total_bytes / topo.gpu_nic_bytes_per_s
    return {"sglang_broadcast_s": gather + bcast, "gather_s": gather, "broadcast_s": float(bcast),
            "num_sources": float(sum(1 for bs in buckets if bs)),
            "source_buffer_bytes": float(max((sum(b.nbytes for b in bs) for bs in buckets), default=0))}
