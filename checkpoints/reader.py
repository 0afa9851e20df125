"""Reading a committed checkpoint: any global box of any tensor, under any layout.

`open_checkpoint(store, step=None)` opens the `latest` complete checkpoint (or the given step;
incomplete steps are invisible). `reader.read(name, box)` assembles the requested region of the
global tensor from the stored slices that overlap it, so a rank of a different layout or world
size reads only what it needs: each shard file is opened once, lazily, and only the overlapping
rows are read. With `verify=True` (the default) every block of rows a read touches is checked
against its crc32 (the full width of the stored slice is read for those rows, then cut); a
mismatch, a truncated or missing file raises `CorruptCheckpointError` naming the file and step.
`verify(store, step)` checks every block of every slice and blob.
"""

from __future__ import annotations

import difflib
import os
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np
import torch

from moe.slices import Box

from . import _dtypes
from .catalog import latest_step, list_checkpoints
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .manifest import Manifest, SliceRecord, TensorRecord
from .store import MANIFEST, ShardStore, as_store


def open_checkpoint(store: ShardStore | str | os.PathLike[str], step: int | None = None, *,
                    verify: bool = True) -> CheckpointReader:
    """Open checkpoint `step` (None: the `latest` complete one) of a store or directory.

    Raises CheckpointNotFoundError (listing the complete steps) or CorruptCheckpointError (a
    damaged manifest).
    """
    s = as_store(store)
    if step is None:
        step = latest_step(s)
        if step is None:
            raise CheckpointNotFoundError(
                f"no complete checkpoint in {s.location(None, '')} (step directories without a "
                f"manifest, i.e. interrupted saves: {s.list_steps()})")
    text = s.get_text(step, MANIFEST)
    if text is None:
        raise CheckpointNotFoundError(
            f"checkpoint step {step} is not committed in {s.location(None, '')} (no {MANIFEST}); "
            f"complete steps: {list_checkpoints(s)}")
    try:
        manifest = Manifest.from_text(text)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(str(e), step=step, location=s.location(step, MANIFEST)) from None
    if manifest.step != step:
        raise CorruptCheckpointError(f"manifest says step {manifest.step}", step=step,
                                     location=s.location(step, MANIFEST))
    return CheckpointReader(s, manifest, verify=verify)


class CheckpointReader:
    """Read access to one committed checkpoint; close it (or use `with`) to close its files."""

    def __init__(self, store: ShardStore, manifest: Manifest, *, verify: bool = True) -> None:
        self.store = store
        self.manifest = manifest
        self.step = manifest.step
        self.verify = verify
        self._files: dict[str, h5py.File] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def metadata(self) -> dict[str, Any]:
        """The JSON metadata rank 0 passed to `commit`."""
        return self.manifest.metadata

    def tensor_names(self) -> list[str]:
        return sorted(self.manifest.tensors)

    def global_shape(self, name: str) -> tuple[int, ...]:
        return self._record(name).global_shape

    def dtype(self, name: str) -> torch.dtype:
        return _dtypes.dtype_from_name(self._record(name).dtype)

    def read(self, name: str, box: Box | None = None) -> torch.Tensor:
        """The region `box` of global tensor `name` (all of it if None), as a new CPU tensor."""
        rec = self._record(name)
        if box is None:
            box = Box.full(rec.global_shape)
        if not isinstance(box, Box):
            raise ValueError(f"read({name!r}): box must be a moe.slices.Box, got {type(box).__name__}")
        if len(box.shape) != len(rec.global_shape) or not Box.full(rec.global_shape).contains(box):
            raise ValueError(f"read({name!r}): box {box} does not lie inside the global shape "
                             f"{list(rec.global_shape)}")
        out = np.empty(box.shape, dtype=_dtypes.storage_dtype(self.dtype(name)))
        covered = 0
        checks: list[Future[None]] = []
        try:
            for s in rec.slices:
                piece = s.box.intersect(box)
                if piece is not None:
                    checks.extend(self._read_piece(rec, s, piece, out, box))
                    covered += piece.numel
        finally:
            for check in checks:
                check.result()  # re-raises a CorruptCheckpointError of the helper thread
        assert box.numel == 0 or covered == box.numel, (name, box, covered)  # build_manifest checked
        return _dtypes.from_storage(out, self.dtype(name))

    def blob_ranks(self, name: str) -> list[int]:
        """The ranks that wrote a blob called `name`."""
        return sorted(self.manifest.blobs.get(name, {}))

    def blob(self, name: str, rank: int = 0) -> bytes:
        """The bytes rank `rank` stored with `write_blob(name, ...)`, checksum-verified."""
        per_rank = self.manifest.blobs.get(name)
        if per_rank is None or rank not in per_rank:
            raise ValueError(f"no blob {name!r} from rank {rank} in checkpoint step {self.step}; "
                             f"blobs: { {n: sorted(p) for n, p in self.manifest.blobs.items()} }")
        b = per_rank[rank]
        ds = self._dataset(b.file, b.dataset, (b.nbytes,), np.dtype(np.uint8))
        data = np.empty(b.nbytes, np.uint8)
        if b.nbytes:
            self._h5(b.file, lambda: ds.read_direct(data))
        if self.verify and zlib.crc32(data) != b.crc32:
            raise self._corrupt(b.file, f"checksum mismatch in blob {name!r} of rank {rank}")
        return data.tobytes()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        for f in self._files.values():
            f.close()
        self._files.clear()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- hooks ---------------------------------------------------------------------------------

    def _record(self, name: str) -> TensorRecord:
        rec = self.manifest.tensors.get(name)
        if rec is None:
            close = difflib.get_close_matches(name, self.manifest.tensors, n=3)
            raise ValueError(f"no tensor {name!r} in checkpoint step {self.step}"
                             f"{f'; did you mean {close}?' if close else ''} "
                             f"({len(self.manifest.tensors)} tensors: see reader.tensor_names())")
        return rec

    def _corrupt(self, file: str, message: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(message, step=self.step, location=self.store.location(self.step, file))

    def _h5(self, file: str, fn: Any) -> Any:
        try:
            return fn()
        except (OSError, KeyError, RuntimeError) as e:
            raise self._corrupt(file, f"HDF5 read failed ({e}); the file is truncated or damaged") from None

    def _dataset(self, file: str, dataset: str, shape: tuple[int, ...], dtype: np.dtype) -> h5py.Dataset:
        f = self._files.get(file)
        if f is None:
            try:
                f = self.store.open_shard(self.step, file)
            except FileNotFoundError:
                raise self._corrupt(file, "shard file is missing") from None
            except OSError as e:
                raise self._corrupt(file, f"cannot open shard ({e}); it is truncated or damaged") from None
            self._files[file] = f
        ds = self._h5(file, lambda: f[dataset])
        if ds.shape != shape or ds.dtype != dtype:
            raise self._corrupt(file, f"dataset {dataset} is {ds.shape} {ds.dtype}, manifest says "
                                      f"{shape} {dtype}")
        return ds

    def _read_piece(self, rec: TensorRecord, s: SliceRecord, piece: Box, out: np.ndarray,
                    box: Box) -> list[Future[None]]:
        """Read `piece` of stored slice `s` into `out` (which holds `box`); returns the pending
        checksum checks (crc32 releases the GIL, so they run on a helper thread during the next
        read)."""
        ds = self._dataset(s.file, s.dataset, s.box.shape, out.dtype)
        src = piece.relative_to(s.box)
        dst = piece.relative_to(box)
        if not self.verify:
            if out.ndim == 0:
                out[()] = self._h5(s.file, lambda: ds[()])
            else:
                self._h5(s.file, lambda: ds.read_direct(out, source_sel=src, dest_sel=dst))
            return []
        if out.ndim == 0 or s.box.shape[0] == 0:
            data = np.asarray(self._h5(s.file, lambda: ds[()]))
            out[dst] = data[src]
            return [self._submit_check(rec, s, data, 0)]
        rows, br = s.box.shape[0], s.block_rows
        k0 = src[0].start // br
        a, b = k0 * br, min(-(-src[0].stop // br) * br, rows)
        full_width = piece.shape[1:] == s.box.shape[1:] == box.shape[1:]
        if full_width and (a, b) == (src[0].start, src[0].stop):
            # The rows land contiguously in `out`: read them in place, then check them there.
            self._h5(s.file, lambda: ds.read_direct(out, source_sel=np.s_[a:b], dest_sel=dst[:1]))
            return [self._submit_check(rec, s, out[dst[0]], k0)]
        tmp = np.empty((b - a,) + s.box.shape[1:], dtype=out.dtype)
        self._h5(s.file, lambda: ds.read_direct(tmp, source_sel=np.s_[a:b]))
        out[dst] = tmp[(slice(src[0].start - a, src[0].stop - a),) + src[1:]]
        return [self._submit_check(rec, s, tmp, k0)]

    def _submit_check(self, rec: TensorRecord, s: SliceRecord, rows_arr: np.ndarray, k0: int) -> Future[None]:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="ckpt-verify")
        return self._pool.submit(self._check, rec, s, rows_arr, k0)

    def _check(self, rec: TensorRecord, s: SliceRecord, rows_arr: np.ndarray, k0: int) -> None:
        """Compare whole blocks (starting at block k0) of a slice against the manifest's crc32s."""
        flat = memoryview(rows_arr.reshape(-1).view(np.uint8))
        if rows_arr.ndim and rows_arr.shape[0]:
            step = s.block_rows * (rows_arr.nbytes // rows_arr.shape[0])
        else:
            step = len(flat)
        for j, start in enumerate(range(0, max(1, len(flat)), max(1, step))):
            k = k0 + j
            if k >= len(s.crc32) or zlib.crc32(flat[start:start + step]) != s.crc32[k]:
                raise self._corrupt(s.file, f"checksum mismatch in tensor {rec.name!r}, slice {s.box}, "
                                            f"rows block {k} (dataset {s.dataset})")


@dataclass(frozen=True, slots=True)
class VerifyReport:
    """What `verify` checked."""

    step: int
    files: int
    slices: int
    blobs: int
    nbytes: int


def verify(store: ShardStore | str | os.PathLike[str], step: int | None = None) -> VerifyReport:
    """Check every block of every slice and blob of checkpoint `step` (None: latest).

    Raises CorruptCheckpointError naming the first damaged file (and the step); reads block by
    block, so memory stays bounded by one block of rows.
    """
    with open_checkpoint(store, step, verify=True) as reader:
        nbytes = slices = 0
        for rec in reader.manifest.tensors.values():
            sdtype = _dtypes.storage_dtype(_dtypes.dtype_from_name(rec.dtype))
            for s in rec.slices:
                slices += 1
                nbytes += s.box.numel * sdtype.itemsize
                if not s.box.shape or s.box.shape[0] == 0:
                    for check in reader._read_piece(rec, s, s.box, np.empty(s.box.shape, sdtype), s.box):
                        check.result()
                    continue
                pending: list[Future[None]] = []
                for r0 in range(0, s.box.shape[0], s.block_rows):
                    rows = Box((s.box.offsets[0] + r0,) + s.box.offsets[1:],
                               (min(s.block_rows, s.box.shape[0] - r0),) + s.box.shape[1:])
                    pending += reader._read_piece(rec, s, rows, np.empty(rows.shape, sdtype), rows)
                    while len(pending) > 2:  # bounded memory: at most a few blocks in flight
                        pending.pop(0).result()
                for check in pending:
                    check.result()
        blobs = 0
        for name, per_rank in reader.manifest.blobs.items():
            for rank, b in per_rank.items():
                reader.blob(name, rank)
                blobs += 1
                nbytes += b.nbytes
        return VerifyReport(reader.step, len(reader.manifest.files), slices, blobs, nbytes)
