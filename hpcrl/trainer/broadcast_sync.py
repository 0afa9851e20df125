"""Broadcast weight sync (SGLang's `update_weights_from_distributed`) from many trainer sources at once.

SGLang 0.5.x takes new weights only as broadcasts of whole HF tensors into a weight-update group,
and an engine loads one update at a time (its writer lock). verl and slime gather the whole model
on trainer rank 0 and broadcast it from there; rank 0's link then carries everything. Here:

  1. Every tensor gets one source trainer rank (`moe.runtime.source_buckets`: a rank holding it
     whole if any, bytes balanced), so S sources own disjoint parts. S is at most one per bucket's
     worth of weights (ceil(model bytes / rollout.bucket_mb)): a source with less than a bucket
     would only add a transfer per engine, and an engine takes one at a time. So a small model has
     one source, trainer rank 0, broadcasting to all engines at once, as verl and slime do. The
     placement comes from Megatron's actual shards (every rank reports its HF boxes at connect).
  2. Sources gather the pieces they lack from the other trainer ranks, point to point and checked
     (`moe.runtime.gather_buckets`); other ranks only send.
  3. The E engines are split into P = min(S, E) blocks, engine e in block e mod P. Every source has
     one weight-update group per block: {source} + the block's engine ranks, made with SGLang's
     `init_weights_update_group` (engines keep groups by `group_name`).
  4. Turn k of P: the source at position i broadcasts all its buckets to block (i + k) mod P.
     When a block has several engines (S < E), a barrier of the trainer ranks ends each turn, so
     such a block hears from exactly one source per turn and no two broadcasts can wait on each
     other's engines. A block of one engine (S >= E) may hear from several sources in a turn, one
     after another; each of those transfers needs only its source and that engine, so no barrier.
     Every engine receives every tensor exactly once.

    trainer ranks           turn 0            turn 1          (S = 2 sources, E = 4 engines, P = 2)
    src 0: gather  --bcast--> engines 0, 2 --bcast--> engines 1, 3
    src 1: gather  --bcast--> engines 1, 3 --bcast--> engines 0, 2

With S >= E all engines receive at once; with S < E each broadcast reaches E / S engines, so no
link carries more than its share. With one trainer rank this is rank 0 broadcasting to all engines.
Trainer rank 0 opens the engines' weight-update session before the first turn and closes it after
the last, also when the push fails. Connecting takes the same turns. An engine that refuses an update
(SGLang refuses before it receives) fails the push at once on its source, which drops that group;
`connect()` again re-forms it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.schema import JobConfig, engine_dtype
from hpcrl.rollout.client import EngineClient
from hpcrl.rollout.weight_sender import WeightSender, call_failures
from hpcrl.trainer.model import weight_tensors
from hpcrl.trainer.shard_sync import LocalHFShards, sync_host
from moe.layouts import TensorPlacement
from moe.runtime import Shards, Staging, gather_buckets, source_buckets
from moe.slices import Box
from moe.sources import source_cap
from moe.specs import MoESpec


def engine_blocks(num_sources: int, num_engines: int) -> list[list[int]]:
    """The engines of each block: min(S, E) blocks, engine e in block e mod P."""
    p = max(1, min(num_sources, num_engines))
    return [list(range(j, num_engines, p)) for j in range(p)]


def turn_block(position: int, turn: int, num_blocks: int) -> int:
    """The block the source at `position` (among the sources) sends to in `turn`."""
    return (position + turn) % num_blocks


def placement_from_shards(spec: MoESpec, boxes_by_rank: list[dict[str, Box]]) -> list[TensorPlacement]:
    """Who holds what, from every rank's {HF name: box}: per spec tensor, its distinct boxes and
    the ranks holding each. Raises RuntimeError if the boxes do not tile a tensor exactly."""
    out: list[TensorPlacement] = []
    for t in spec.tensors:
        holders: dict[Box, list[int]] = {}
        for r, boxes in enumerate(boxes_by_rank):
            if t.name in boxes:
                holders.setdefault(boxes[t.name], []).append(r)
        covered = sum(b.numel for b in holders)
        if covered != t.numel or any(not Box.full(t.shape).contains(b) for b in holders):
            raise RuntimeError(f"the trainer ranks' shards of {t.name} ({sorted(map(str, holders))}) do not "
                               f"tile its shape {t.shape}: {covered} of {t.numel} elements")
        out.append([(b, tuple(rs)) for b, rs in sorted(holders.items(), key=lambda kv: kv[0].offsets)])
    return out


class BroadcastSync:
    """Trainer side of the multi-source broadcast sync; every trainer rank holds one (collective over
    the default process group, which must be exactly the trainer ranks).

    `shards()` returns this rank's current weights as {HF name: (global box, tensor)} (the same
    boxes at every call); `urls` are the engines' base URLs, the same on every rank; every engine
    has `tp_per_engine` ranks. `host` is the address the engines reach this rank at; `verify` is the
    gather's checksum mode (moe.runtime.VERIFY_MODES). Use:
    `connect()` once, then `push(version)` per sync. `for_policy` builds one for a Megatron policy.
    """

    def __init__(self, spec: MoESpec, shards: Callable[[], Shards], urls: list[str], *, bucket_bytes: int,
                 tp_per_engine: int = 1, host: str = "127.0.0.1", timeout_s: float = 600.0,
                 verify: str = "sampled", backend: str = "gloo") -> None:
        if not urls:
            raise ValueError("BroadcastSync needs at least one engine URL")
        self.rank, self.timeout_s, self.verify = dist.get_rank(), timeout_s, verify
        self.spec, self.shards, self.tp, self.host = spec, shards, tp_per_engine, host
        self.backend = backend  # of the weight-update groups: nccl on GPUs (NVLink/IB), gloo on CPU
        held = shards()
        boxes: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(boxes, {n: b for n, (b, _) in held.items()})
        self.placement = placement_from_shards(spec, boxes)
        self.buckets = source_buckets(spec, self.placement, bucket_bytes,
                                      max_sources=source_cap(spec, bucket_bytes))
        self.sources = [s for s, b in enumerate(self.buckets) if b]
        self.position = self.sources.index(self.rank) if self.rank in self.sources else None
        self.blocks = engine_blocks(len(self.sources), len(urls))
        self.clients = [EngineClient(u, timeout_s=timeout_s) for u in urls]
        self._pool = ThreadPoolExecutor(max_workers=len(urls) + 1, thread_name_prefix="broadcast-sync")
        self.senders: dict[int, WeightSender] = {}
        self._bufs: list[torch.Tensor] | None = None
        self._staging = Staging()
        # where collectives of the trainer group need their tensors (NCCL on GPUs: CUDA tensors)
        self._device = next((t.device for _, t in held.values()), torch.device("cpu"))
        self._meta = [self._bucket_meta(b) for b in self.buckets[self.rank]]

    @classmethod
    def for_policy(cls, policy: Any, job: JobConfig, urls: list[str], timeout_s: float) -> BroadcastSync:
        """For a MegatronPolicy: its shards under HF names (views, refreshed per sync), the job's
        model spec, bucket size and engine TP; the routable address when the job spans hosts."""
        from hpcrl.models.job_model import build_spec

        local = LocalHFShards(weight_tensors(policy.gpt), policy.dims, policy.coords,
                              getattr(torch, engine_dtype(job)))
        return cls(build_spec(job), local.refresh, urls, bucket_bytes=max(job.rollout.bucket_mb << 20, 1),
                   tp_per_engine=job.rollout.tp_per_engine, host=sync_host(job), timeout_s=timeout_s,
                   verify=job.rollout.sync_checksum,
                   backend="nccl" if job.resources.device == "cuda" else "gloo")

    def describe(self) -> str:
        return (f"sources {self.sources} into {len(self.clients)} engine(s) in {len(self.blocks)} turn(s), "
                f"{sum(b.nbytes for b in self.buckets[self.rank])} bytes from this rank")

    def _bucket_meta(self, bucket) -> tuple[list[str], list[str], list[list[int]]]:
        ts = [self.spec.tensors[i] for i in bucket.tensors]
        return [t.name for t in ts], [t.dtype for t in ts], [list(t.shape) for t in ts]

    def _connected(self) -> bool:
        return len(self.senders) == len(self.blocks) and all(
            x.group is not None for x in self.senders.values())

    def connect(self) -> None:
        """Form every (source, block) weight-update group, in the push's turn order. Called again
        after a failed push, forms only the groups that push dropped (collective either way)."""
        for k in range(len(self.blocks)):
            error = None
            if self.position is not None:
                j = turn_block(self.position, k, len(self.blocks))
                sender = self.senders.get(j) or WeightSender(
                    [self.clients[e] for e in self.blocks[j]], backend=self.backend, master_address=self.host,
                    tp_per_engine=self.tp, group_name=f"hpcrl_bcast_src{self.rank}_blk{j}",
                    timeout_s=self.timeout_s, engine_ids=self.blocks[j])
                try:
                    if sender.group is None:
                        sender.connect()
                    self.senders[j] = sender
                except Exception as exc:  # noqa: BLE001 - every rank's failure is reported together
                    error = str(exc)
            self._agree(error, f"connect turn {k + 1}/{len(self.blocks)}")

    def push(self, weight_version: str) -> dict[str, float] | None:
        """Move the current weights into every engine; {"bytes", "seconds"} on rank 0, else None."""
        if self.position is not None and not self._connected():
            raise RuntimeError("BroadcastSync.push before connect() (or after a failed push dropped a "
                               "weight-update group: connect() again)")
        t0 = time.perf_counter()
        opening = self._on_engines("begin_weight_update")  # rank 0's HTTP overlaps the gather
        try:
            self._bufs = gather_buckets(self.spec, self.placement, self.buckets, self.rank, self.shards(),
                                        deadline_s=self.timeout_s, verify=self.verify, into=self._bufs,
                                        staging=self._staging)
            # also the start line: no source sends before every engine's session is open
            self._agree(opening.result(), "begin_weight_update")
            self._turns(weight_version)
        except BaseException:
            opening.result()  # the begin calls have ended before the ends are sent
            self._on_engines("end_weight_update").result()  # best effort: leave no session open
            raise
        closing = self._on_engines("end_weight_update").result()
        if closing is not None:  # rank 0 only; the controller stops the job on it
            raise RuntimeError(f"broadcast weight sync failed in {closing}")
        if self.rank != 0:
            return None
        model_bytes = sum(b.nbytes for bs in self.buckets for b in bs)
        return {"bytes": float(model_bytes * len(self.clients) * self.tp),
                "seconds": time.perf_counter() - t0}

    def _turns(self, weight_version: str) -> None:
        """Every turn's broadcasts. A barrier after each turn when a block has several engines
        (module docstring); with one engine per block only the final agreement is needed."""
        turns = len(self.blocks)
        if any(len(b) > 1 for b in self.blocks):
            for k in range(turns):
                self._agree(self._send_turn(k, weight_version), f"turn {k + 1}/{turns}")
            return
        error = None
        for k in range(turns):
            error = self._send_turn(k, weight_version)
            if error is not None:
                error = f"turn {k + 1}/{turns}: {error}"
                break
        self._agree(error, f"{turns} turns")

    def _send_turn(self, k: int, weight_version: str) -> str | None:
        if self.position is None:
            return None
        sender = self.senders[turn_block(self.position, k, len(self.blocks))]
        n = len(self._meta)
        try:
            for b, ((names, dtypes, shapes), flat) in enumerate(zip(self._meta, self._bufs or [])):
                # flush the engines' prefix cache with the last bucket: nothing generates during a sync
                sender.send_flat(names, dtypes, shapes, flat, b == n - 1, weight_version,
                                 f"bucket {b + 1}/{n} from trainer rank {self.rank}")
        except Exception as exc:  # noqa: BLE001 - reported by _agree on every rank
            return str(exc)
        return None

    def _on_engines(self, method: str) -> Future[str | None]:
        """Trainer rank 0 calls `method` on every engine at once; the future's result is the
        failures as one message, or None (always None on other ranks)."""
        if self.rank != 0:
            done: Future[str | None] = Future()
            done.set_result(None)
            return done
        calls = [self._pool.submit(getattr(c, method)) for c in self.clients]

        def collect() -> str | None:
            errors = call_failures(calls, self.clients, list(range(len(self.clients))), self.timeout_s)
            return f"{method}: " + "; ".join(errors) if errors else None

        return self._pool.submit(collect)

    def _agree(self, error: str | None, what: str) -> None:
        """Barrier of the trainer ranks that also shares failures: all raise if any rank failed."""
        flag = torch.tensor([0 if error is None else 1], device=self._device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not int(flag):
            return
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raise RuntimeError(f"broadcast weight sync failed in {what}: "
                           + "; ".join(f"trainer rank {r}: {e}" for r, e in enumerate(errors) if e))
