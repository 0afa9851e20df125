"""The storage seam: a narrow `ShardStore` protocol and its local-filesystem and memory stores.

The writer and reader never touch paths; they ask a store to durably put a shard (HDF5 datasets),
open a shard for reading, atomically put or get a small text file (done markers, the manifest,
`latest`), list steps and names, and remove files. `LocalFSStore` implements it on a POSIX
filesystem (local disk, NFS, Lustre): files are written under a temporary name, fsync'ed and
renamed into place, so a crash leaves either the old file or the new one. Shards and done markers
skip the directory fsync: the manifest's durable rename, in the same directory, flushes their
entries too, and a marker need not survive a power loss at all (rank 0 reads it before the
manifest exists). `MemoryStore` keeps everything in a dict (HDF5 images built in memory) for fast
tests and records which shards were opened. Paths are plain `str` names relative to the store root:

    ROOT/latest                     text: the step number of the newest committed checkpoint
    ROOT/step_000120/rank00003.h5   shard written by rank 3
    ROOT/step_000120/rank00003.done done marker of rank 3 (its RankIndex, JSON)
    ROOT/step_000120/manifest.json  present only once the checkpoint is committed
"""

from __future__ import annotations

import io
import os
import re
import shutil
import threading
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple, Protocol, runtime_checkable

import h5py
import numpy as np

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


def step_dirname(step: int) -> str:
    return f"step_{step:06d}"


def shard_filename(rank: int) -> str:
    return f"rank{rank:05d}.h5"


def marker_name(rank: int) -> str:
    return f"rank{rank:05d}.done"


MANIFEST = "manifest.json"
LATEST = "latest"


class ShardItem(NamedTuple):
    """One dataset of a shard file: its name, the C-contiguous data and string/int attributes."""

    dataset: str
    array: np.ndarray
    attrs: dict[str, str | int]


@runtime_checkable
class ShardStore(Protocol):
    """Where checkpoints live. `step=None` in the text methods addresses the store root."""

    def put_shard(self, step: int, filename: str, items: Iterable[ShardItem]) -> int:
        """Write the items as one HDF5 file and make its data durable, replacing any old file
        atomically. Its directory entry need only become durable with the next durable
        `put_text` into the same step (the manifest). `items` is consumed lazily, one array at a
        time. Returns the bytes of array data written.
        """
        ...

    def open_shard(self, step: int, filename: str) -> h5py.File:
        """Open a shard read-only (the caller closes it). FileNotFoundError if it is absent."""
        ...

    def put_text(self, step: int | None, name: str, text: str, *, durable: bool = True) -> None:
        """Atomically create or replace a small text file; with `durable`, also make it and every
        earlier entry of its directory survive a power loss before returning."""
        ...

    def get_text(self, step: int | None, name: str) -> str | None:
        """The text of a small file, or None if it does not exist."""
        ...

    def list_names(self, step: int) -> list[str]:
        """The file names in a step's directory (empty if the directory does not exist)."""
        ...

    def list_steps(self) -> list[int]:
        """Every step that has a directory, complete or not, ascending."""
        ...

    def remove(self, step: int, name: str | None = None) -> None:
        """Remove one file of a step, or (name None) the whole step, its manifest first."""
        ...

    def location(self, step: int | None, name: str) -> str:
        """A human-readable location of a file for error messages (a path or a URL)."""
        ...


class LocalFSStore:
    """A `ShardStore` on a POSIX directory, with fsync'ed temp-file + rename commits."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def __repr__(self) -> str:
        return f"LocalFSStore({str(self.root)!r})"

    def _dir(self, step: int | None) -> Path:
        return self.root if step is None else self.root / step_dirname(step)

    def location(self, step: int | None, name: str) -> str:
        return str(self._dir(step) / name)

    def put_shard(self, step: int, filename: str, items: Iterable[ShardItem]) -> int:
        d = self._dir(step)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{filename}.tmp-{uuid.uuid4().hex[:12]}"
        nbytes = 0
        try:
            # locking=False: HDF5's flock fails on some NFS/Lustre mounts; the rename protocol
            # already guarantees a single writer per file.
            with h5py.File(tmp, "w", locking=False) as f:
                for item in items:
                    _write_item(f, item)
                    nbytes += item.array.nbytes
            _fsync_path(tmp)
            os.replace(tmp, d / filename)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return nbytes

    def open_shard(self, step: int, filename: str) -> h5py.File:
        path = self._dir(step) / filename
        if not path.is_file():
            raise FileNotFoundError(f"shard {path} does not exist")
        return h5py.File(path, "r", locking=False)

    def put_text(self, step: int | None, name: str, text: str, *, durable: bool = True) -> None:
        d = self._dir(step)
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f"{name}.tmp-{uuid.uuid4().hex[:12]}"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, d / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        if durable:
            _fsync_path(d)  # the rename, and the shards renamed into this directory before it

    def get_text(self, step: int | None, name: str) -> str | None:
        try:
            return (self._dir(step) / name).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    def list_names(self, step: int) -> list[str]:
        try:
            return sorted(os.listdir(self._dir(step)))
        except FileNotFoundError:
            return []

    def list_steps(self) -> list[int]:
        try:
            names = os.listdir(self.root)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _STEP_DIR.match(n)))

    def remove(self, step: int, name: str | None = None) -> None:
        d = self._dir(step)
        if name is not None:
            (d / name).unlink(missing_ok=True)
            return
        # The manifest goes first (and durably), so a half-removed step is never "complete".
        (d / MANIFEST).unlink(missing_ok=True)
        if d.exists():
            _fsync_path(d)
        shutil.rmtree(d, ignore_errors=True)


class MemoryStore:
    """A thread-safe in-memory `ShardStore` for tests; `opened` logs (step, filename) reads."""

    def __init__(self) -> None:
        self._files: dict[tuple[int | None, str], bytes | str] = {}
        self._lock = threading.Lock()
        self.opened: list[tuple[int, str]] = []

    def location(self, step: int | None, name: str) -> str:
        return f"memory://{name}" if step is None else f"memory://{step_dirname(step)}/{name}"

    def put_shard(self, step: int, filename: str, items: Iterable[ShardItem]) -> int:
        buf = io.BytesIO()
        nbytes = 0
        with h5py.File(buf, "w", locking=False) as f:
            for item in items:
                _write_item(f, item)
                nbytes += item.array.nbytes
        with self._lock:
            self._files[(step, filename)] = buf.getvalue()
        return nbytes

    def open_shard(self, step: int, filename: str) -> h5py.File:
        with self._lock:
            data = self._files.get((step, filename))
            self.opened.append((step, filename))
        if not isinstance(data, bytes):
            raise FileNotFoundError(f"shard {self.location(step, filename)} does not exist")
        return h5py.File(io.BytesIO(data), "r", locking=False)

    def put_text(self, step: int | None, name: str, text: str, *, durable: bool = True) -> None:
        with self._lock:
            self._files[(step, name)] = text

    def get_text(self, step: int | None, name: str) -> str | None:
        with self._lock:
            value = self._files.get((step, name))
        return value if isinstance(value, str) else None

    def list_names(self, step: int) -> list[str]:
        with self._lock:
            return sorted(n for s, n in self._files if s == step)

    def list_steps(self) -> list[int]:
        with self._lock:
            return sorted({s for s, _ in self._files if s is not None})

    def remove(self, step: int, name: str | None = None) -> None:
        with self._lock:
            for key in [k for k in self._files if k[0] == step and name in (None, k[1])]:
                del self._files[key]

    def corrupt(self, step: int, filename: str, offset: int) -> None:
        """Flip one byte of a stored shard (tests of checksum detection)."""
        with self._lock:
            data = bytearray(self._files[(step, filename)])  # type: ignore[arg-type]
            data[offset] ^= 0xFF
            self._files[(step, filename)] = bytes(data)


def as_store(store: ShardStore | str | os.PathLike[str]) -> ShardStore:
    """A store as given, or a `LocalFSStore` for a directory path."""
    if isinstance(store, (str, os.PathLike)):
        return LocalFSStore(store)
    if not isinstance(store, ShardStore):
        raise ValueError(f"store must be a directory path or a ShardStore, got {type(store).__name__}")
    return store


def _write_item(f: h5py.File, item: ShardItem) -> None:
    assert item.array.flags.c_contiguous, item.dataset
    ds = f.create_dataset(item.dataset, data=item.array)
    for key, value in item.attrs.items():
        ds.attrs[key] = value


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
