"""Trainer side of SGLang's weight-sync protocol: a private process group, then bucketed broadcasts.

The protocol (SGLang 0.5.x `init_weights_update_group` / `update_weights_from_distributed`, as slime
and verl drive it):
  1. The trainer picks a free port on `master_address`; every engine is told over HTTP to join a new
     process group `group_name` of world size 1 + sum(engine TP sizes) with rank_offset
     1 + (engines before it) * tp, each of its TP ranks taking rank rank_offset + tp_rank. The trainer
     joins as rank 0 at the same time. The group is made with torch's `_new_process_group_helper`
     over a `PrefixStore(group_name, ...)`, so it is independent of any default process group
     (`init_custom_process_group` below; both sides use it).
  2. Per update: `begin_weight_update` on every engine (SGLang >= 0.5.23 refuses weight loads outside
     such a session; older servers lack the route and the client skips it), then per bucket the
     trainer POSTs `update_weights_from_distributed` {names, dtypes, shapes, group_name, load_format,
     flush_cache, weight_version} to every engine while it broadcasts the tensors from rank 0, then
     `end_weight_update`. Names are HF checkpoint names (hf_names), dtypes torch names without
     "torch." ("bfloat16"), shapes lists of ints. An engine refuses a bad update (no session, unknown
     group, bad metadata) BEFORE posting its receive, so rank 0 watches the HTTP answers while it
     broadcasts and gives up at the first refusal or at its deadline (`WeightSender._broadcast`); a
     failed push ends every engine's session.
  3. Wire format: per tensor, one broadcast per tensor in `names` order (load_format None); or with
     load_format "flattened_bucket" one uint8 broadcast of every tensor's bytes concatenated in `names`
     order with no padding (SGLang's FlattenedTensorBucket: `tensor.flatten().view(torch.uint8)`,
     `torch.cat`), which the engine slices back with `.view(dtype).reshape(shape)`.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from hpcrl.dist import export_socket_ifname, master_store, on_loopback
from hpcrl.rollout.client import EngineClient, EngineError
from moe.fused import fused_groups

__all__ = ["WeightSender", "dtype_name", "end_sessions", "flatten_bucket", "init_custom_process_group",
           "parse_dtype", "unflatten_bucket"]

BROADCAST_POLL_S = 0.002
"""How often a bucket's broadcast is asked whether it completed while the engines' answers are awaited."""


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float = 600.0,
                              store: dist.Store | None = None) -> dist.ProcessGroup:
    """Join a new process group outside torch's default one (SGLang's `init_custom_process_group`).

    Rendezvous over `init_method` (tcp://host:port; rank 0 hosts the store), keys prefixed with
    `group_name`, group ranks equal to `rank`. Blocks until all `world_size` ranks have joined or
    `timeout_s` passes. A process can hold one group per `group_name` at a time. Rank 0 may pass the
    `store` it opened with hpcrl.dist.master_store (at the port of `init_method`) instead of letting
    the rendezvous bind it.

    No `device_id`, as SGLang 0.5.23's engines join (model_runner_components/weight_updater.py): an
    NCCL communicator is then created lazily, by every rank at the group's first collective, on the
    device of the tensors it moves (tests/conformance/test_weight_group_join.py). A side that created
    its communicator eagerly would block in NCCL's connect until the engines' first collective, which
    comes only after the join returns.
    """
    from torch.distributed.distributed_c10d import (
        Backend,
        PrefixStore,
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    export_socket_ifname(spans_hosts=not on_loopback(init_method.removeprefix("tcp://").rpartition(":")[0]))
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group's world_size {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    if store is None:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store,
                                         group_name=group_name, backend_options=None, timeout=timeout,
                                         device_id=None)
    # Lets collectives map ranks without a default group (group rank == rank).
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype spelling: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def parse_dtype(name: str) -> torch.dtype:
    """Inverse of dtype_name ("bfloat16" or "torch.bfloat16"); ValueError for anything else."""
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}; use a torch dtype name such as 'float32' or 'bfloat16'")
    return dtype


def flatten_bucket(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """All tensors' bytes concatenated in order, as one uint8 tensor (FlattenedTensorBucket layout)."""
    return torch.cat([t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors])


def unflatten_bucket(buffer: torch.Tensor, dtypes: Sequence[torch.dtype],
                     shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Slice a flattened uint8 bucket back into tensors (views where the byte offset allows it)."""
    out, start = [], 0
    for dtype, shape in zip(dtypes, shapes):
        numel = 1
        for d in shape:
            numel *= d
        end = start + numel * dtype.itemsize
        chunk = buffer[start:end]
        # view(dtype) needs the byte offset to be a multiple of the element size; copy when it is not
        # (only mixed-dtype buckets can misalign).
        if start % dtype.itemsize:
            chunk = chunk.clone()
        out.append(chunk.view(dtype).reshape(shape))
        start = end
    if start != buffer.numel():
        raise ValueError(f"bucket holds {buffer.numel()} bytes but the metadata describes {start}")
    return out


class WeightSender:
    """Rank 0 of the weight-update group: pushes HF-named tensors into every engine.

    `clients[i]` drives engine i (named `engine_ids[i]` in messages), which has `tp_per_engine` ranks.
    Use: `connect()` once, `push(...)` per sync, `close()` at the end. Works against hpcrl's reference
    server and SGLang 0.5.x.
    """

    def __init__(self, clients: list[EngineClient], backend: str = "gloo", master_address: str = "127.0.0.1",
                 tp_per_engine: int = 1, group_name: str = "weight_update_group", timeout_s: float = 600.0,
                 engine_ids: Sequence[int] | None = None):
        if not clients:
            raise ValueError("WeightSender needs at least one EngineClient")
        if tp_per_engine < 1:
            raise ValueError(f"tp_per_engine={tp_per_engine} must be >= 1")
        self.clients = clients
        self.backend = backend
        self.master_address = master_address
        self.tp_per_engine = tp_per_engine
        self.group_name = group_name
        self.timeout_s = timeout_s
        self.world_size = 1 + len(clients) * tp_per_engine
        self.engine_ids = list(range(len(clients)) if engine_ids is None else engine_ids)  # for messages
        self.group: dist.ProcessGroup | None = None
        self._pool = ThreadPoolExecutor(max_workers=len(clients), thread_name_prefix="weight-sender")

    def connect(self) -> None:
        """Create the group: HTTP init on every engine concurrently with the local rank-0 join."""
        if self.group is not None:
            raise RuntimeError(f"WeightSender already connected (group {self.group_name!r}); close() first")
        store = master_store(self.master_address, self.world_size, self.timeout_s)
        port = store.port
        calls = [self._pool.submit(c.init_weights_update_group, self.master_address, port,
                                   1 + i * self.tp_per_engine, self.world_size, self.group_name, self.backend)
                 for i, c in enumerate(self.clients)]
        local: dict = {}

        def join() -> None:
            try:
                local["group"] = init_custom_process_group(
                    self.backend, f"tcp://{self.master_address}:{port}", self.world_size, 0, self.group_name,
                    self.timeout_s, store=store)
            except BaseException as exc:  # reported to the caller below
                local["error"] = exc

        joiner = threading.Thread(target=join, name="weight-group-join", daemon=True)
        joiner.start()
        deadline = time.monotonic() + self.timeout_s
        # Fail as soon as an engine refuses instead of waiting out the rendezvous timeout.
        while joiner.is_alive() and time.monotonic() < deadline:
            for i, fut in enumerate(calls):
                if fut.done() and fut.exception() is not None:
                    raise RuntimeError(f"engine {self.engine_ids[i]} ({self.clients[i].base_url}) could not "
                                       f"join weight-update group {self.group_name!r}: {fut.exception()}"
                                       ) from fut.exception()
            joiner.join(0.05)
        if joiner.is_alive() or "error" in local:
            raise RuntimeError(f"rank 0 could not form weight-update group {self.group_name!r} of "
                               f"{self.world_size} ranks at {self.master_address}:{port} within "
                               f"{self.timeout_s:.0f} s: {local.get('error', 'timed out')}")
        self.group = local["group"]
        for i, fut in enumerate(calls):
            try:
                fut.result(timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:
                self.close()
                raise RuntimeError(f"engine {self.engine_ids[i]} ({self.clients[i].base_url}) failed to join "
                                   f"weight-update group {self.group_name!r}: {exc}") from exc

    def push(self, named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, flattened: bool = True,
             weight_version: str | None = None) -> int:
        """Send every tensor to every engine; returns the bytes broadcast (one copy).

        Tensors are cut into buckets of at most `bucket_bytes` (a larger tensor travels alone; tensors
        SGLang fuses on load travel together). Raises RuntimeError naming the engine when one refuses
        a bucket: a refusal after the receive leaves the group usable, one before it (SGLang's
        session, group and request checks) drops the group (`_broadcast`). A failed push always
        ends the engines' weight-update sessions.
        """
        if self.group is None:
            raise RuntimeError("WeightSender.push before connect()")
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes={bucket_bytes} must be > 0")
        if not named_tensors:
            raise ValueError("push() got no tensors")
        device = self._device()
        buckets = _buckets(named_tensors, bucket_bytes)
        try:
            self._on_all("begin_weight_update")
            total = sum(self._send_bucket(k, len(buckets), bucket, device, flattened, weight_version)
                        for k, bucket in enumerate(buckets))
        except BaseException:
            self.end_sessions()
            raise
        self._on_all("end_weight_update")
        return total

    def end_sessions(self) -> list[str]:
        """Best effort after a failed push: /end_weight_update on every engine at once (an engine
        whose session is not open refuses, harmlessly). Returns the failures, for messages."""
        return end_sessions(self._pool, self.clients, self.engine_ids, min(self.timeout_s, 30.0))

    def _send_bucket(self, k: int, num_buckets: int, bucket, device, flattened: bool,
                     weight_version: str | None) -> int:
        names = [n for n, _ in bucket]
        tensors = [t.detach().to(device).contiguous() for _, t in bucket]
        dtypes, shapes = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
        what = f"bucket {k + 1}/{num_buckets}"
        if flattened:
            self.send_flat(names, dtypes, shapes, flatten_bucket(tensors), k == num_buckets - 1,
                           weight_version, what)
        else:
            calls = self._announce(names, dtypes, shapes, k == num_buckets - 1, None, weight_version)
            self._broadcast(tensors, calls, f"update_weights_from_distributed ({what})")
            self._check(calls, f"update_weights_from_distributed ({what})")
        return sum(t.numel() * t.element_size() for t in tensors)

    def send_flat(self, names: list[str], dtypes: list[str], shapes: list[list[int]], flat: torch.Tensor,
                  flush_cache: bool, weight_version: str | None, what: str = "bucket") -> None:
        """One flattened bucket (uint8, tensors back to back in `names` order) into every engine.

        The caller opens and closes the engines' weight-update session (begin/end_weight_update).
        Raises RuntimeError naming the engines that refused it: at once for a refusal before the
        receive (`_broadcast`), else after the broadcast completed.
        """
        if self.group is None:
            raise RuntimeError(f"WeightSender.send_flat: weight-update group {self.group_name!r} is not "
                               f"connected (never, or dropped after a failed broadcast): connect() first")
        calls = self._announce(names, dtypes, shapes, flush_cache, "flattened_bucket", weight_version)
        self._broadcast([flat], calls, f"update_weights_from_distributed ({what})")
        self._check(calls, f"update_weights_from_distributed ({what})")

    def _broadcast(self, tensors: Sequence[torch.Tensor], calls: list, what: str) -> None:
        """Broadcast `tensors` from rank 0 while watching the engines' HTTP answers (`calls`).

        SGLang refuses a bad update before it posts its receive, so the broadcast would wait for that
        engine until the group's timeout. Here an answer that fails before the broadcast completes
        ends the wait at once, and a broadcast not complete within `timeout_s` ends it at that
        deadline; either way the group is dropped (`abandon`: the unfinished broadcast cannot be
        taken back) and RuntimeError names each engine that answered and SGLang's message.
        """
        works = [dist.broadcast(t, group=self.group, group_src=0, async_op=True) for t in tensors]
        # Polled: NCCL marks a work's future done once the broadcast is queued on the stream, not when
        # it completes (torch's Work.get_future), while is_completed() asks the GPU.
        def sent() -> bool:
            return all(w.is_completed() for w in works)

        end = time.monotonic() + self.timeout_s
        pending = set(calls)
        while not sent():
            left = end - time.monotonic()
            if left <= 0:
                break
            finished, pending = wait(pending, timeout=min(left, BROADCAST_POLL_S), return_when=FIRST_COMPLETED)
            if any(f.exception() is not None for f in finished):
                break
            if not pending:
                time.sleep(min(left, BROADCAST_POLL_S))  # every engine answered: only the broadcast is left
        if sent():
            return
        errors = [f"engine {e} ({c.base_url}): "
                  + (str(f.exception()) if f.done() and f.exception() is not None else
                     "answered success before the broadcast ended" if f.done() else "no answer")
                  for f, c, e in zip(calls, self.clients, self.engine_ids)]
        why = "refused before receiving" if any(f.done() for f in calls) else \
            f"not received within {self.timeout_s:.0f} s"
        self.abandon()
        raise RuntimeError(f"{what} {why}; broadcast abandoned and weight-update group {self.group_name!r} "
                           f"dropped: " + "; ".join(errors))

    def abandon(self) -> None:
        """Drop a group whose broadcast cannot finish: destroyed here at once (the pending broadcast
        with it) and, best effort within a few seconds, on the engines, so that `connect()` can form
        it again. An engine still inside its receive does not answer and keeps its half."""
        if self.group is None:
            return
        group, self.group = self.group, None
        dist.destroy_process_group(group)
        calls = [self._pool.submit(c.destroy_weights_update_group, self.group_name) for c in self.clients]
        wait(calls, timeout=min(self.timeout_s, 10.0))

    def _announce(self, names, dtypes, shapes, flush_cache: bool, load_format: str | None,
                  weight_version: str | None) -> list:
        return [self._pool.submit(c.update_weights_from_distributed, names, dtypes, shapes,
                                  group_name=self.group_name, flush_cache=flush_cache,
                                  load_format=load_format, weight_version=weight_version)
                for c in self.clients]

    def close(self) -> None:
        """Destroy the group on the engines (best effort) and locally; the sender can connect() again."""
        if self.group is None:
            return
        calls = [self._pool.submit(c.destroy_weights_update_group, self.group_name) for c in self.clients]
        dist.destroy_process_group(self.group)
        self.group = None
        for fut in calls:
            try:
                fut.result(timeout=self.timeout_s)
            except (EngineError, OSError):
                pass  # the engine may already be gone; its group dies with it

    def _device(self) -> torch.device:
        """Where broadcast tensors must live: the current GPU for NCCL, host memory for gloo."""
        if self.backend == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def _on_all(self, method: str) -> None:
        self._check([self._pool.submit(getattr(c, method)) for c in self.clients], method)

    def _check(self, calls, what: str) -> None:
        errors = call_failures(calls, self.clients, self.engine_ids, self.timeout_s)
        if errors:
            raise RuntimeError(f"{what} failed on {len(errors)} of {len(calls)} engines: "
                               + "; ".join(errors))


def end_sessions(pool: ThreadPoolExecutor, clients: list, engine_ids: list[int],
                 timeout_s: float) -> list[str]:
    """/end_weight_update on every engine at once (from `pool`); "engine i (url): error" for each
    that failed (an engine whose session is not open refuses, harmlessly after a failed push)."""
    return call_failures([pool.submit(c.end_weight_update) for c in clients], clients, engine_ids, timeout_s)


def call_failures(calls: list, clients: list, engine_ids: list[int], timeout_s: float) -> list[str]:
    """Wait for one call per engine (futures, in `clients` order); "engine i (url): error" for each
    that failed or did not answer within `timeout_s`."""
    errors = []
    for fut, client, engine in zip(calls, clients, engine_ids):
        try:
            fut.result(timeout=timeout_s)
        except Exception as exc:  # noqa: BLE001 - every engine's failure goes into one report
            errors.append(f"engine {engine} ({client.base_url}): {exc}")
    return errors


def _buckets(named_tensors, bucket_bytes: int) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors cut into buckets of at most `bucket_bytes` (a larger tensor alone); tensors
    SGLang fuses on load (moe.fused) travel together in the bucket of the group's first one."""
    groups = {g[0]: g for g in fused_groups([n for n, _ in named_tensors])}
    follower = {i for g in groups.values() for i in g[1:]}
    buckets: list[list[tuple[str, torch.Tensor]]] = []
    current: list[tuple[str, torch.Tensor]] = []
    size = 0
    for i in range(len(named_tensors)):
        if i in follower:
            continue
        unit = [named_tensors[j] for j in groups.get(i, [i])]
        nbytes = sum(t.numel() * t.element_size() for _, t in unit)
        if current and size + nbytes > bucket_bytes:
            buckets.append(current)
            current, size = [], 0
        current.extend(unit)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets
