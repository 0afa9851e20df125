"""Writing one checkpoint step from every rank, with a collective-free commit.

Each rank opens a `CheckpointWriter` for the step, calls `write(name, tensor, box, global_shape)`
for every slice it owns (parameters, Adam moments, step counters) and `write_blob` for per-rank
bytes (RNG states), then `commit()`. Commit protocol, with no communication between ranks:

    every rank:  shard -> tmp file, fsync, rename to rank{r:05d}.h5 -> done marker (its index)
    rank 0:      wait (deadline) for N markers of this attempt -> merge and check the slices ->
                 manifest.json (tmp, fsync, rename: the checkpoint is now visible) ->
                 latest (tmp, fsync, rename) -> retention

`attempt_id` (the same on every rank, new for every run attempt) lets rank 0 ignore markers a
crashed earlier attempt left in the same step directory. With `async_save=True`, `write` copies
each tensor to host memory and `commit` returns at once; a background thread writes, and
`wait()` joins it and re-raises its error. Call `wait()` before opening the next writer.
"""

from __future__ import annotations

import os
import re
import threading
import time
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from moe.slices import Box

from . import _dtypes
from .catalog import apply_retention
from .errors import CheckpointExistsError, CommitError, CommitTimeoutError
from .manifest import (BlobRecord, Manifest, RankIndex, SliceRecord, TensorRecord, build_manifest,
                       normalize_metadata)
from .store import (LATEST, MANIFEST, ShardItem, ShardStore, as_store, marker_name, shard_filename)

DEFAULT_BLOCK_BYTES = 16 << 20
_ATTEMPT = re.compile(r"^[A-Za-z0-9_.:-]{1,128}$")


@dataclass(frozen=True, slots=True)
class SaveResult:
    """What one rank's save did. `committed` is True once this rank saw the manifest in place
    (always on rank 0; on other ranks only after `wait(for_commit=True)`). `blocked_s` is the time
    the caller spent inside write/write_blob/commit; `total_s` runs from the first call to done."""

    step: int
    rank: int
    shard: str
    nbytes: int
    committed: bool
    blocked_s: float
    total_s: float


@dataclass(slots=True)
class _Pending:
    name: str
    data: torch.Tensor | bytes
    box: Box | None = None
    global_shape: tuple[int, ...] = ()


class CheckpointWriter:
    """One rank's part of saving checkpoint `step` into `store` (a ShardStore or a directory).

    Raises CheckpointExistsError if the step is already committed. `attempt_id` is required when
    `world_size > 1`: pass the same string on every rank, unique per run attempt (e.g. a uuid4 hex
    broadcast once at start-up). `keep_last` (rank 0) deletes older checkpoints before and after
    the commit, so at most `keep_last + 1` complete ones exist even when saves are killed between
    their commit and the cleanup that follows it.
    """

    def __init__(self, store: ShardStore | str | os.PathLike[str], step: int, *, rank: int = 0,
                 world_size: int = 1, attempt_id: str | None = None, async_save: bool = False,
                 commit_timeout_s: float = 600.0, keep_last: int | None = None,
                 block_bytes: int = DEFAULT_BLOCK_BYTES, poll_interval_s: float = 0.02) -> None:
        if not isinstance(step, int) or step < 0:
            raise ValueError(f"step must be an int >= 0, got {step!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if attempt_id is None:
            if world_size > 1:
                raise ValueError(
                    "attempt_id is required when world_size > 1: pass the same string on every rank, "
                    "new for every run attempt (e.g. uuid.uuid4().hex broadcast once at start-up), so "
                    "that rank 0 ignores done markers left by a crashed earlier attempt")
            attempt_id = f"single-{os.getpid()}-{time.time_ns()}"
        if not isinstance(attempt_id, str) or not _ATTEMPT.match(attempt_id):
            raise ValueError(f"attempt_id must match {_ATTEMPT.pattern}, got {attempt_id!r}")
        if not commit_timeout_s > 0:
            raise ValueError(f"commit_timeout_s must be > 0, got {commit_timeout_s!r}")
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be None or an int >= 1, got {keep_last!r}")
        if not isinstance(block_bytes, int) or block_bytes < 1:
            raise ValueError(f"block_bytes must be an int >= 1, got {block_bytes!r}")
        self.store = as_store(store)
        self.step, self.rank, self.world_size, self.attempt_id = step, rank, world_size, attempt_id
        self.async_save, self.commit_timeout_s, self.keep_last = async_save, commit_timeout_s, keep_last
        self.block_bytes, self.poll_interval_s = block_bytes, poll_interval_s
        if MANIFEST in self.store.list_names(step):
            raise CheckpointExistsError(
                f"checkpoint step {step} is already committed at {self.store.location(step, MANIFEST)}; "
                f"save under a new step, or remove it first (checkpoints.discard_newer)")
        self._pending: list[_Pending] = []
        self._boxes: dict[str, list[Box]] = {}
        self._metadata: dict[str, Any] = {}
        self._state = "open"  # open -> committing -> done | failed
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._nbytes = 0
        self._blocked_s = 0.0
        self._t0: float | None = None
        self._t_done = 0.0

    # -- public guards -------------------------------------------------------------------------

    def write(self, name: str, tensor: torch.Tensor, box: Box | None = None,
              global_shape: tuple[int, ...] | list[int] | None = None) -> None:
        """Add this rank's slice `box` of global tensor `name` (the whole tensor if box is None).

        `tensor` must have shape `box.shape`; `global_shape` is required with a box. In sync mode
        the tensor is read at commit(), so do not modify it before then; in async mode it is
        copied to host memory here.
        """
        t0 = self._enter("write")
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty str, got {name!r}")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"write({name!r}): tensor must be a torch.Tensor, got {type(tensor).__name__}")
        _dtypes.dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        if box is None:
            box = Box.full(shape)
            gshape = shape if global_shape is None else tuple(global_shape)
        elif global_shape is None:
            raise ValueError(f"write({name!r}): global_shape is required when box is given")
        else:
            gshape = tuple(int(g) for g in global_shape)
        if not isinstance(box, Box):
            raise ValueError(f"write({name!r}): box must be a moe.slices.Box, got {type(box).__name__}")
        if shape != box.shape:
            raise ValueError(f"write({name!r}): tensor shape {list(shape)} != box shape {list(box.shape)}")
        if len(gshape) != len(shape) or not Box.full(gshape).contains(box):
            raise ValueError(f"write({name!r}): box {box} does not lie inside global_shape {list(gshape)}")
        for other in self._boxes.get(name, []):
            if other == box or other.intersect(box) is not None:
                raise ValueError(f"write({name!r}): box {box} overlaps {other} already written by "
                                 f"this rank; write each element once per rank")
        self._boxes.setdefault(name, []).append(box)
        data = tensor.detach()
        if self.async_save:
            data = _snapshot(data)
        self._pending.append(_Pending(name, data, box, gshape))
        self._blocked_s += time.perf_counter() - t0

    def write_blob(self, name: str, data: bytes | bytearray | memoryview) -> None:
        """Add a per-rank byte string (e.g. `pickle.dumps(rng_states)`); read it back per rank."""
        t0 = self._enter("write_blob")
        if not isinstance(name, str) or not name:
            raise ValueError(f"blob name must be a non-empty str, got {name!r}")
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise ValueError(f"write_blob({name!r}): data must be bytes, got {type(data).__name__}")
        if any(p.name == name and p.box is None for p in self._pending):
            raise ValueError(f"write_blob({name!r}): this rank already wrote a blob of that name")
        self._pending.append(_Pending(name, bytes(data)))
        self._blocked_s += time.perf_counter() - t0

    def commit(self, metadata: Mapping[str, Any] | None = None) -> None:
        """Write this rank's shard and marker; on rank 0 also commit the manifest and `latest`.

        `metadata` (rank 0 only) is a JSON-able dict stored in the manifest. Sync mode: returns
        when done (errors raise here). Async mode: returns at once; call `wait()`.
        """
        t0 = self._enter("commit")
        if metadata is not None:
            if self.rank != 0:
                raise ValueError(f"commit(metadata=...) is for rank 0 only; rank {self.rank} passed "
                                 f"keys {sorted(metadata)[:5]}; put per-rank data in write_blob")
            self._metadata = normalize_metadata(dict(metadata))
        self._state = "committing"
        if self.async_save:
            self._thread = threading.Thread(target=self._run, name=f"ckpt-save-{self.step}",
                                            daemon=True)
            self._thread.start()
            self._blocked_s += time.perf_counter() - t0
            return
        self._run()
        self._blocked_s += time.perf_counter() - t0
        self.wait()

    def done(self) -> bool:
        """True once the save finished (successfully or not)."""
        return self._state in ("done", "failed")

    def wait(self, timeout_s: float | None = None, *, for_commit: bool = False) -> SaveResult:
        """Block until this rank's save is done and return its result, re-raising its error.

        With `for_commit=True` a rank other than 0 also waits (up to commit_timeout_s) until rank
        0 committed the manifest of this attempt, e.g. before exiting for a requeue.
        """
        if self._state == "open":
            raise RuntimeError(f"wait() before commit() on the writer of step {self.step}")
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                raise TimeoutError(f"checkpoint step {self.step}: save of rank {self.rank} still "
                                   f"running after {timeout_s} s")
        if self._error is not None:
            raise self._error
        committed = self.rank == 0
        if for_commit and not committed:
            self._wait_for_manifest()
            committed = True
        return SaveResult(self.step, self.rank, self.store.location(self.step, shard_filename(self.rank)),
                          self._nbytes, committed, self._blocked_s, self._t_done - (self._t0 or 0.0))

    # -- hooks ---------------------------------------------------------------------------------

    def _enter(self, what: str) -> float:
        if self._state != "open":
            raise RuntimeError(f"{what}() after commit() on the writer of step {self.step}; open a "
                               f"new CheckpointWriter for the next save")
        now = time.perf_counter()
        if self._t0 is None:
            self._t0 = now
        return now

    def _run(self) -> None:
        try:
            index = self._write_shard()
            # Not durable: rank 0 reads markers only before the manifest exists; the manifest's
            # durable write also flushes this directory's entries (the shard's name included).
            self.store.put_text(self.step, marker_name(self.rank), index.to_text(), durable=False)
            if self.rank == 0:
                self._commit_manifest()
            self._state = "done"
        except BaseException as e:  # handed to wait(), which re-raises it in the caller's thread
            self._error = e
            self._state = "failed"
        finally:
            self._pending = []
            self._t_done = time.perf_counter()

    def _write_shard(self) -> RankIndex:
        filename = shard_filename(self.rank)
        blobs: list[BlobRecord] = []
        # crc32 releases the GIL: checksum item i on a helper thread while HDF5 writes it.
        crc_pool = ThreadPoolExecutor(1, thread_name_prefix=f"ckpt-crc-{self.step}")
        crcs: list[tuple[_Pending, str, Future[tuple[int, tuple[int, ...]]]]] = []

        def items() -> Iterator[ShardItem]:
            for i, p in enumerate(self._pending):
                if isinstance(p.data, bytes):
                    arr = np.frombuffer(p.data, dtype=np.uint8)
                    dataset = f"b{i:06d}"
                    blobs.append(BlobRecord(p.name, self.rank, filename, dataset, arr.nbytes,
                                            zlib.crc32(arr)))
                    yield ShardItem(dataset, arr, {"name": p.name})
                    continue
                assert p.box is not None
                arr = _dtypes.to_storage(p.data.cpu())
                dataset = f"t{i:06d}"
                crcs.append((p, dataset, crc_pool.submit(block_checksums, arr, self.block_bytes)))
                yield ShardItem(dataset, arr, {"name": p.name, "offsets": str(list(p.box.offsets)),
                                               "global_shape": str(list(p.global_shape))})

        try:
            self._nbytes = self.store.put_shard(self.step, filename, items())
            tensors = []
            for p, dataset, future in crcs:
                block_rows, crc = future.result()
                assert p.box is not None and isinstance(p.data, torch.Tensor)
                record = SliceRecord(p.box, filename, dataset, block_rows, crc)
                tensors.append(TensorRecord(p.name, p.global_shape, _dtypes.dtype_name(p.data.dtype),
                                            (record,)))
        finally:
            crc_pool.shutdown(wait=True, cancel_futures=True)
        return RankIndex(self.rank, self.attempt_id, filename, self._nbytes, tuple(tensors), tuple(blobs))

    def _commit_manifest(self) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        indexes: dict[int, RankIndex] = {}
        interval = self.poll_interval_s
        while True:
            present = set(self.store.list_names(self.step))  # one listing per poll, not per rank
            for r in range(self.world_size):
                if r in indexes or marker_name(r) not in present:
                    continue
                text = self.store.get_text(self.step, marker_name(r))
                if text is None:
                    continue
                try:
                    index = RankIndex.from_text(text)
                except (ValueError, KeyError) as e:
                    raise CommitError(f"checkpoint step {self.step}: unreadable done marker "
                                      f"{self.store.location(self.step, marker_name(r))} ({e})") from None
                if index.attempt_id == self.attempt_id:  # else: stale, from a crashed attempt
                    indexes[r] = index
            if len(indexes) == self.world_size:
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in indexes]
                raise CommitTimeoutError(
                    f"checkpoint step {self.step}: ranks {missing} did not finish writing within "
                    f"commit_timeout_s={self.commit_timeout_s} (no done marker of attempt "
                    f"{self.attempt_id!r}); the step stays incomplete and invisible",
                    step=self.step, missing_ranks=missing)
            time.sleep(interval)
            interval = min(interval * 1.5, 0.5)  # gentle on a shared filesystem's metadata server
        manifest = build_manifest(self.step, self.world_size, self.attempt_id, indexes.values(),
                                  self._metadata)
        # Retention also runs before the commit: a kill between commit and the cleanup below leaves
        # one checkpoint too many, and the next save's commit must not add another on top of it.
        self._retain("before commit")
        self.store.put_text(self.step, MANIFEST, manifest.to_text())
        self.store.put_text(None, LATEST, f"{self.step}\n")
        try:
            for name in self.store.list_names(self.step):
                if name.endswith(".done") or ".tmp-" in name:
                    self.store.remove(self.step, name)
        except OSError as e:  # the checkpoint is committed; cleanup can be redone next time
            warnings.warn(f"checkpoint step {self.step}: cleanup after commit failed: {e}", stacklevel=1)
        self._retain("after commit")

    def _retain(self, when: str) -> None:
        """Keep the `keep_last` newest complete checkpoints (rank 0); a failure only warns."""
        if self.keep_last is None:
            return
        try:
            apply_retention(self.store, self.keep_last, below_step=self.step)
        except OSError as e:  # cleanup can be redone at the next save
            warnings.warn(f"checkpoint step {self.step}: retention {when} failed: {e}", stacklevel=2)

    def _wait_for_manifest(self) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        interval = self.poll_interval_s
        while True:
            if MANIFEST in self.store.list_names(self.step):
                text = self.store.get_text(self.step, MANIFEST)
                if text is not None:
                    committed_by = Manifest.from_text(text).attempt_id
                    if committed_by != self.attempt_id:
                        raise CommitError(
                            f"checkpoint step {self.step} was committed by attempt {committed_by!r}, "
                            f"not this one ({self.attempt_id!r}): two runs share "
                            f"{self.store.location(None, '')}")
                    return
            if time.monotonic() > deadline:
                raise CommitTimeoutError(
                    f"checkpoint step {self.step}: rank {self.rank} wrote its shard but rank 0 did not "
                    f"commit the manifest within commit_timeout_s={self.commit_timeout_s}",
                    step=self.step, missing_ranks=[0])
            time.sleep(interval)
            interval = min(interval * 1.5, 0.5)


def block_checksums(arr: np.ndarray, block_bytes: int) -> tuple[int, tuple[int, ...]]:
    """(rows per block, crc32 of each block of rows along axis 0) of a C-contiguous array.

    A 0-d array or one with no rows is a single block.
    """
    flat = memoryview(arr.reshape(-1).view(np.uint8))
    if arr.ndim == 0 or arr.shape[0] == 0:
        return 1, (zlib.crc32(flat),)
    rows = arr.shape[0]
    row_bytes = arr.nbytes // rows
    block_rows = rows if row_bytes == 0 else max(1, min(rows, block_bytes // row_bytes))
    step = block_rows * row_bytes
    return block_rows, tuple(zlib.crc32(flat[k * step:(k + 1) * step])
                             for k in range(-(-rows // block_rows)))


def _snapshot(tensor: torch.Tensor) -> torch.Tensor:
    # Pinned host memory makes the device-to-host copy fast (and lets CUDA overlap it).
    pin = tensor.is_cuda
    out = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=pin)
    out.copy_(tensor)
    return out
