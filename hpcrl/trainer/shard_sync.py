"""Shard-to-shard weight sync: every trainer rank sends its Megatron shards straight to the engines.

The default sync for the reference engine (`rollout.weight_sync: shard`), and SGLang's with
`rollout.weight_sync: shard`. Trainer ranks and engines form one process group (SGLang's
`init_weights_update_group` route; group rank = trainer rank, then T + engine index * tp + TP rank,
which is moe.runtime.RankMap's rank of that rollout rank); both sides compute the same `moe.plan`
from the job's layouts and the model spec, and run `moe.runtime.reshard` on it: each byte leaves
the least-loaded trainer rank that holds it and lands in the engine GPU that needs it, in bounded
rounds with per-peer checksums. Nothing is gathered on trainer rank 0, unlike the broadcast path
(hpcrl/rollout/weight_sender.py).

The trainer ranks only send. The engines receive when the controller asks them
(hpcrl/rollout/shard_requests.py): the reference server's extension route
`/hpcrl/update_weights_reshard` (hpcrl/rollout/reshard_route.py), or, for SGLang,
`/update_weights_from_tensor` naming hpcrl's `--custom-weight-loader`
(hpcrl/rollout/sglang_shard_loader.py), which runs inside every TP worker within a begin/end
weight-update session. The group is gloo on CPU and NCCL with `resources.device: cuda`.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.schema import JobConfig, engine_dtype
from hpcrl.dist import master_store, routable_host
from hpcrl.rollout.reshard_route import PlanRequest, spec_fingerprint
from hpcrl.rollout.weight_sender import init_custom_process_group
from hpcrl.trainer.model import weight_tensors
from moe.hf_megatron import is_router_bias, local_params
from moe.network import Topology
from moe.runtime import Shards, Staging, reshard
from moe.slices import Box

GROUP_NAME = "hpcrl_reshard"


def spans_hosts(job: JobConfig) -> bool:
    """Whether the job's trainer ranks and engines run on more than one host."""
    return job.resources.nodes + job.resources.rollout_nodes > 1


def sync_host(job: JobConfig) -> str:
    """The address engines reach this trainer rank at for a weight-update group."""
    return routable_host() if spans_hosts(job) else "127.0.0.1"


class LocalHFShards:
    """This rank's weights as {HF name: (global box, tensor)}: the HF-named view of its Megatron
    shards (fused qkv / fc1 cut back into q, k, v / gate, up).

    Built once: a tensor that is one piece of one parameter (most of them) is a view of that
    parameter, so nothing is copied; the others (q/k/v rows of several TP groups, a dtype change)
    get a buffer that `refresh()` fills. Megatron updates its parameters in place, so the views stay
    current; call `refresh()` before each sync. Tensors move at `dtype`, DeepSeek's router bias at
    float32 (as moe.specs lists it, and as the engines keep it).
    """

    def __init__(self, params: dict[str, torch.Tensor], dims: Any, coords: Any, dtype: torch.dtype) -> None:
        pieces: dict[str, list[tuple[torch.Tensor, Box]]] = {}
        for lp in local_params(dims, coords):
            param = params[lp.name]
            for pc in lp.pieces:
                pieces.setdefault(pc.hf_name, []).append((param.detach()[pc.local_box.index], pc.hf_box))
        self.shards: Shards = {}
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, parts in pieces.items():
            boxes = [b for _, b in parts]
            lo = tuple(min(b.offsets[d] for b in boxes) for d in range(len(boxes[0].offsets)))
            hi = tuple(max(b.end[d] for b in boxes) for d in range(len(lo)))
            union = Box(lo, tuple(h - o for o, h in zip(lo, hi)))
            assert union.numel == sum(b.numel for b in boxes), f"{name}: this rank's pieces do not tile a box"
            want = torch.float32 if is_router_bias(name) else dtype
            if len(parts) == 1 and parts[0][0].dtype == want:
                self.shards[name] = (union, parts[0][0])
                continue
            buf = torch.empty(union.shape, dtype=want, device=parts[0][0].device)
            self._copies += [(buf[box.relative_to(union)], view) for view, box in parts]
            self.shards[name] = (union, buf)

    def refresh(self) -> Shards:
        for dst, src in self._copies:
            dst.copy_(src)
        return self.shards


class ShardSync:
    """Trainer side of the shard-to-shard sync; every trainer rank holds one (collective calls).

    `clients` are the engines' EngineClients on trainer rank 0 (None elsewhere), which asks them to
    join the group at `connect`. The pushes' requests to the engines are the controller's
    (hpcrl/rollout/shard_requests.py, from `engine_request`); the trainer ranks only send.
    """

    def __init__(self, policy: Any, job: JobConfig, clients: list | None, timeout_s: float) -> None:
        from hpcrl.models.job_model import build_layouts, build_spec

        self.policy, self.job, self.clients, self.timeout_s = policy, job, clients, timeout_s
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.spec = build_spec(job)
        trainer, rollout = build_layouts(job, self.spec)
        trainer = dataclasses.replace(trainer, vocab_divisible_by=1)  # hpcrl's Megatron does not pad the vocab
        # On one host every engine takes its bytes straight from the trainer ranks (no on-node
        # relays, fewer rounds: benchmarks/RESULTS.md, reshard_cpu --colocated).
        self.request = PlanRequest(trainer, rollout, memory_budget_bytes=max(job.rollout.bucket_mb << 20, 1 << 20),
                                   topology=Topology(colocated=not spans_hosts(job)))
        self.plan = self.request.build(self.spec)
        self.fingerprint = spec_fingerprint(self.spec)
        self.sglang = job.rollout.backend == "sglang"
        self.backend = "nccl" if job.resources.device == "cuda" else "gloo"
        self.request_json = {**self.request.to_json(), "group_name": GROUP_NAME,
                             "spec_sha256": self.fingerprint, "verify": job.rollout.sync_checksum}
        self.dtype = getattr(torch, engine_dtype(job))
        self.group: dist.ProcessGroup | None = None
        self.staging = Staging()
        self.local = LocalHFShards(weight_tensors(policy.gpt), policy.dims, policy.coords, self.dtype)
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clients or [])), thread_name_prefix="reshard")
        self._check_layout_matches_megatron()

    def _check_layout_matches_megatron(self) -> None:
        """The plan's trainer layout must give this rank exactly the boxes Megatron holds here."""
        want = dict(self.plan.src.shards(self.spec, self.rank))
        got = {n: b for n, (b, _) in self.local.shards.items()}
        if got != want:
            diff = sorted(n for n in set(got) | set(want) if got.get(n) != want.get(n))
            raise RuntimeError(
                f"trainer rank {self.rank}: moe.layouts' {self.plan.src} disagrees with Megatron's shards "
                f"on {len(diff)} tensors, e.g. {diff[0]}: layout {want.get(diff[0])}, Megatron "
                f"{got.get(diff[0])}; use rollout.weight_sync: broadcast and report this layout")

    def connect(self) -> None:
        """Form the trainer + engines group (collective over the trainer ranks)."""
        tp = self.plan.dst.tp
        world = self.world + self.plan.dst.world_size  # one group rank per engine GPU
        addr: list[Any] = [None]
        store = None
        if self.rank == 0:
            host = sync_host(self.job)
            store = master_store(host, world, self.timeout_s + 60)
            addr[0] = (host, store.port)
        dist.broadcast_object_list(addr, src=0)
        host, port = addr[0]
        calls = []
        if self.rank == 0:
            calls = [self._pool.submit(c.init_weights_update_group, host, port, self.world + i * tp, world,
                                       GROUP_NAME, self.backend) for i, c in enumerate(self.clients)]
        # the group's own timeout is longer than the per-round deadline, so the deadline names the peer
        self.group = init_custom_process_group(self.backend, f"tcp://{host}:{port}", world, self.rank,
                                               GROUP_NAME, self.timeout_s + 60, store=store)
        for i, fut in enumerate(calls):
            try:
                fut.result(timeout=self.timeout_s)
            except Exception as exc:
                raise RuntimeError(f"engine {i} ({self.clients[i].base_url}) could not join the reshard group: "
                                   f"{exc}") from exc

    def engine_request(self) -> dict[str, Any]:
        """What the controller's ShardRequests (hpcrl/rollout/shard_requests.py) needs to write the
        engines' requests of every push: the plan request, the engines' TP size, SGLang or not."""
        return {"request": self.request_json, "tp": self.plan.dst.tp, "sglang": self.sglang}

    def push(self, weight_version: str) -> dict[str, float] | None:
        """Send this rank's planned slices of the current weights (collective over the trainer ranks
        and the engines, which the controller has asked to receive: ShardRequests); {"bytes",
        "seconds"} on rank 0, else None. moe.runtime.ReshardError when a round misses its deadline
        or a checksum fails."""
        if self.group is None:
            raise RuntimeError("ShardSync.push before connect()")
        t0 = time.perf_counter()
        reshard(self.plan, "trainer", self.rank, self.local.refresh(), group=self.group,
                deadline_s=self.timeout_s, verify=self.job.rollout.sync_checksum, staging=self.staging)
        if self.rank != 0:
            return None
        return {"bytes": float(self.plan.nbytes.sum()), "seconds": time.perf_counter() - t0}
