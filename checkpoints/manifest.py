"""The manifest: what a committed checkpoint holds and where, as one JSON document.

A checkpoint directory `step_{step:06d}/` holds one HDF5 shard per writing rank and
`manifest.json`. The manifest lists every tensor (global shape, dtype) with the slices that make
it up (a `Box` of the global index space, the shard file and dataset holding it, crc32 checksums
per block of rows), the per-rank blobs, and free JSON metadata (step, config, layout, sampler
position, counters, ...). Each rank's part arrives as a `RankIndex` in its done marker; rank 0
merges them with `build_manifest`, which rejects partial overlaps, inconsistent shapes or dtypes
and incomplete coverage, so that a committed checkpoint can always be assembled.

The document is `{"format": "hpcrl-checkpoint", "format_version": N, "crc32": C, "body": {...}}`
where C is the crc32 of the canonical dump of `body`. Older format versions are upgraded by the
functions in `_MIGRATIONS` (one per version step); newer ones are refused with a clear error.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from math import prod
from typing import Any

from moe.slices import Box

from .errors import CommitError

FORMAT = "hpcrl-checkpoint"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class SliceRecord:
    """One stored slice: `box` of the tensor lives in dataset `dataset` of shard `file`.

    The stored array is C-contiguous with shape `box.shape`; `crc32[k]` checks its rows
    `[k * block_rows, (k + 1) * block_rows)` along axis 0 (a 0-d slice has one block).
    """

    box: Box
    file: str
    dataset: str
    block_rows: int
    crc32: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"offsets": list(self.box.offsets), "shape": list(self.box.shape), "file": self.file,
                "dataset": self.dataset, "block_rows": self.block_rows, "crc32": list(self.crc32)}

    @staticmethod
    def from_json(d: dict[str, Any]) -> SliceRecord:
        return SliceRecord(Box(tuple(d["offsets"]), tuple(d["shape"])), d["file"], d["dataset"],
                           int(d["block_rows"]), tuple(int(c) for c in d["crc32"]))


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """A tensor: its global shape, torch dtype name and the slices that cover it."""

    name: str
    global_shape: tuple[int, ...]
    dtype: str
    slices: tuple[SliceRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {"global_shape": list(self.global_shape), "dtype": self.dtype,
                "slices": [s.to_json() for s in self.slices]}

    @staticmethod
    def from_json(name: str, d: dict[str, Any]) -> TensorRecord:
        return TensorRecord(name, tuple(d["global_shape"]), d["dtype"],
                            tuple(SliceRecord.from_json(s) for s in d["slices"]))


@dataclass(frozen=True, slots=True)
class BlobRecord:
    """A per-rank byte string (an RNG state, ...) stored as a uint8 dataset."""

    name: str
    rank: int
    file: str
    dataset: str
    nbytes: int
    crc32: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "rank": self.rank, "file": self.file, "dataset": self.dataset,
                "nbytes": self.nbytes, "crc32": self.crc32}

    @staticmethod
    def from_json(d: dict[str, Any]) -> BlobRecord:
        return BlobRecord(d["name"], int(d["rank"]), d["file"], d["dataset"], int(d["nbytes"]),
                          int(d["crc32"]))


@dataclass(frozen=True, slots=True)
class RankIndex:
    """What one rank wrote for one save attempt; the body of its done marker."""

    rank: int
    attempt_id: str
    file: str
    nbytes: int
    tensors: tuple[TensorRecord, ...]  # each with exactly the slices this rank wrote
    blobs: tuple[BlobRecord, ...]

    def to_text(self) -> str:
        return json.dumps({"rank": self.rank, "attempt_id": self.attempt_id, "file": self.file,
                           "nbytes": self.nbytes,
                           "tensors": [[t.name, t.to_json()] for t in self.tensors],
                           "blobs": [b.to_json() for b in self.blobs]})

    @staticmethod
    def from_text(text: str) -> RankIndex:
        d = json.loads(text)
        return RankIndex(int(d["rank"]), d["attempt_id"], d["file"], int(d["nbytes"]),
                         tuple(TensorRecord.from_json(n, t) for n, t in d["tensors"]),
                         tuple(BlobRecord.from_json(b) for b in d["blobs"]))


@dataclass(frozen=True)
class Manifest:
    """A committed checkpoint. `metadata` is the JSON object rank 0 passed to `commit`."""

    step: int
    world_size: int
    attempt_id: str
    tensors: dict[str, TensorRecord]
    blobs: dict[str, dict[int, BlobRecord]]
    metadata: dict[str, Any] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION

    @property
    def files(self) -> list[str]:
        """Every shard file the checkpoint references, sorted."""
        names = {s.file for t in self.tensors.values() for s in t.slices}
        names |= {b.file for per_rank in self.blobs.values() for b in per_rank.values()}
        return sorted(names)

    def to_text(self) -> str:
        body = {"step": self.step, "world_size": self.world_size, "attempt_id": self.attempt_id,
                "tensors": {n: t.to_json() for n, t in sorted(self.tensors.items())},
                "blobs": {n: [b.to_json() for _, b in sorted(per.items())]
                          for n, per in sorted(self.blobs.items())},
                "metadata": self.metadata}
        crc = zlib.crc32(_canonical(body).encode())
        return json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION, "crc32": crc,
                           "body": body}, indent=1) + "\n"

    @staticmethod
    def from_text(text: str) -> Manifest:
        """Parse and check a manifest; ValueError (with the reason) if it is damaged or foreign."""
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"manifest is not valid JSON ({e})") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise ValueError(f"manifest format is not {FORMAT!r}")
        version = doc.get("format_version")
        if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
            raise ValueError(f"manifest format_version {version!r} is not supported by this hpcrl "
                             f"(reads 1..{FORMAT_VERSION}); upgrade hpcrl to load it")
        body = doc.get("body")
        if zlib.crc32(_canonical(body).encode()) != doc.get("crc32"):
            raise ValueError("manifest checksum mismatch (the file was modified or damaged)")
        while version < FORMAT_VERSION:
            body = _MIGRATIONS[version](body)
            version += 1
        return Manifest(
            step=int(body["step"]), world_size=int(body["world_size"]),
            attempt_id=body["attempt_id"],
            tensors={n: TensorRecord.from_json(n, t) for n, t in body["tensors"].items()},
            blobs={n: {int(b["rank"]): BlobRecord.from_json(b) for b in per}
                   for n, per in body["blobs"].items()},
            metadata=body["metadata"])


# format_version v -> function upgrading a v body to v + 1. Empty while only version 1 exists.
_MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


def _canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def normalize_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    """The metadata as it will read back from JSON; ValueError naming the key that cannot be stored."""
    if not isinstance(metadata, dict):
        raise ValueError(f"metadata must be a dict of JSON values, got {type(metadata).__name__}")
    for key, value in metadata.items():
        try:
            json.dumps({key: value}, allow_nan=True)
        except (TypeError, ValueError) as e:
            raise ValueError(f"metadata[{key!r}] is not JSON-serializable ({e}); convert it to "
                             f"lists/dicts/str/numbers, or store bytes with write_blob") from None
    return json.loads(json.dumps(metadata))


def build_manifest(step: int, world_size: int, attempt_id: str, indexes: Iterable[RankIndex],
                   metadata: dict[str, Any]) -> Manifest:
    """Merge the ranks' indexes into a manifest, or raise CommitError saying what is wrong.

    Slices of one tensor must be identical (replicas: the first one is kept) or disjoint, and
    together cover the global shape; all ranks must agree on a tensor's global shape and dtype.
    """
    slices: dict[str, list[tuple[int, SliceRecord]]] = {}
    meta: dict[str, tuple[int, tuple[int, ...], str]] = {}
    blobs: dict[str, dict[int, BlobRecord]] = {}
    for index in sorted(indexes, key=lambda i: i.rank):
        for t in index.tensors:
            seen = meta.setdefault(t.name, (index.rank, t.global_shape, t.dtype))
            if seen[1:] != (t.global_shape, t.dtype):
                raise CommitError(
                    f"step {step}: tensor {t.name!r} is {list(seen[1])} {seen[2]} on rank {seen[0]} "
                    f"but {list(t.global_shape)} {t.dtype} on rank {index.rank}; every rank must pass "
                    f"the same global_shape and dtype")
            slices.setdefault(t.name, []).extend((index.rank, s) for s in t.slices)
        for b in index.blobs:
            blobs.setdefault(b.name, {})[index.rank] = b
    tensors = {}
    for name, ranked in slices.items():
        _, global_shape, dtype = meta[name]
        unique: dict[Box, tuple[int, SliceRecord]] = {}
        for rank, s in ranked:
            unique.setdefault(s.box, (rank, s))
        _check_partition(step, name, global_shape, unique)
        tensors[name] = TensorRecord(name, global_shape, dtype, tuple(s for _, s in unique.values()))
    return Manifest(step, world_size, attempt_id, tensors, blobs, metadata)


def _check_partition(step: int, name: str, global_shape: tuple[int, ...],
                     unique: dict[Box, tuple[int, SliceRecord]]) -> None:
    boxes = sorted(unique, key=lambda b: b.offsets)
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            if a.shape and b.offsets[0] >= a.end[0]:
                break  # sorted by axis-0 offset: no later box can overlap `a`
            if a.intersect(b) is not None:
                raise CommitError(
                    f"step {step}: tensor {name!r}: slice {a} (rank {unique[a][0]}) partially overlaps "
                    f"{b} (rank {unique[b][0]}); slices must be identical replicas or disjoint")
    covered = sum(b.numel for b in boxes)
    if covered != prod(global_shape):
        raise CommitError(
            f"step {step}: tensor {name!r} of shape {list(global_shape)}: the ranks' slices cover "
            f"{covered} of {prod(global_shape)} elements (boxes: {boxes[:8]}"
            f"{'...' if len(boxes) > 8 else ''}); some rank did not write its part")
