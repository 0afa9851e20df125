"""HF-sharded safetensors written box by box: plan the files, create them, pwrite any box of any tensor.

`plan_shards` lays tensors out into files the way `save_pretrained` does (tensors in the given
order, a new file when the next tensor would pass `max_shard_bytes`, a tensor bigger than that
alone in its file; one file is `model.safetensors`, several are `model-0000i-of-0000n.safetensors`
with `model.safetensors.index.json`). Each file is the safetensors format: an 8-byte little-endian
header length N, N bytes of JSON header (`__metadata__` and, per tensor, `dtype`, `shape`,
`data_offsets` relative to the data start) padded with spaces so the data starts 8-byte aligned,
then the tensors' bytes back to back in row-major order.

Because every tensor's byte range is known up front, writers need no coordination: `create_files`
(one process) writes the headers and sizes the files, then any number of processes write
disjoint boxes with `ShardWriter.write` (each contiguous run of a box's rows is one pwrite at its
computed offset), then `write_index`. Memory is what the caller holds: one box at a time.
Imports neither `hpcrl` nor `launch`; takes numpy arrays of the elements' raw bits.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import numpy as np

from moe.slices import Box

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# torch dtype name -> (safetensors dtype, bytes per element)
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8), "float32": ("F32", 4), "float16": ("F16", 2), "bfloat16": ("BF16", 2),
    "int64": ("I64", 8), "int32": ("I32", 4), "int16": ("I16", 2), "int8": ("I8", 1), "uint8": ("U8", 1),
    "uint16": ("U16", 2), "uint32": ("U32", 4), "uint64": ("U64", 8), "bool": ("BOOL", 1),
    "float8_e4m3fn": ("F8_E4M3", 1), "float8_e5m2": ("F8_E5M2", 1),
}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20,
          "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """Bytes of a size like transformers' `max_shard_size`: an int, "5GB" (10^9), "500MiB" (2^20)...
    ValueError for anything else or a size below 1."""
    if isinstance(size, int):
        value = size
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(size).upper())
        if m is None:
            raise ValueError(f"size {size!r} is not a number of bytes with an optional unit "
                             f"(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB), e.g. 5GB")
        value = int(float(m.group(1)) * _UNITS[m.group(2) or ""])
    if value < 1:
        raise ValueError(f"size {size!r} must be at least 1 byte")
    return value


@dataclass(frozen=True, slots=True)
class TensorSlot:
    """Where tensor `name` lives: file `file`, bytes [offset, offset + nbytes) of it."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One safetensors file: its name, its header bytes (length prefix included) and total size."""

    name: str
    header: bytes
    size: int


@dataclass(frozen=True)
class ShardPlan:
    """The files of an export and every tensor's slot in them (same inputs, same plan, on any rank)."""

    files: tuple[FilePlan, ...]
    slots: dict[str, TensorSlot]

    @property
    def total_size(self) -> int:
        return sum(s.nbytes for s in self.slots.values())

    def index_json(self) -> dict:
        """The content of model.safetensors.index.json (written only for several files)."""
        return {"metadata": {"total_size": self.total_size},
                "weight_map": {name: s.file for name, s in sorted(self.slots.items())}}


def plan_shards(tensors: Iterable[tuple[str, str, Sequence[int]]], max_shard_bytes: int,
                metadata: dict[str, str] | None = None) -> ShardPlan:
    """Lay out (name, torch dtype name, shape) tensors, in the given order, into files of at most
    `max_shard_bytes` of tensor data each (a bigger tensor gets a file of its own)."""
    groups: list[list[tuple[str, str, tuple[int, ...], int]]] = [[]]
    used = 0
    for name, dtype, shape in tensors:
        if dtype not in DTYPES:
            raise ValueError(f"tensor {name!r}: dtype {dtype!r} has no safetensors type; "
                             f"known: {sorted(DTYPES)}")
        nbytes = prod(shape) * DTYPES[dtype][1]
        if groups[-1] and used + nbytes > max_shard_bytes:
            groups.append([])
            used = 0
        groups[-1].append((name, dtype, tuple(int(s) for s in shape), nbytes))
        used += nbytes
    n = len(groups)
    files, slots = [], {}
    meta = {"format": "pt", **(metadata or {})}
    for k, group in enumerate(groups):
        fname = SINGLE if n == 1 else f"model-{k + 1:05d}-of-{n:05d}.safetensors"
        header: dict = {"__metadata__": meta}
        start = 0
        for name, dtype, shape, nbytes in group:
            header[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape),
                            "data_offsets": [start, start + nbytes]}
            start += nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        head = len(text).to_bytes(8, "little") + text
        files.append(FilePlan(fname, head, len(head) + start))
        for name, dtype, shape, nbytes in group:
            begin = header[name]["data_offsets"][0]
            slots[name] = TensorSlot(name, dtype, shape, fname, len(head) + begin, nbytes)
    return ShardPlan(tuple(files), slots)


EXPORT_TAG = "hpcrl_export"
"""The metadata key every safetensors file an hpcrl export writes carries (`hpcrl export`: the
checkpoint's step; a trainer's live export: "trainer"); `foreign_weights` looks for it."""


def foreign_weights(out_dir: str | os.PathLike[str]) -> Path | None:
    """The first of `out_dir`'s model*.safetensors files (those `remove_stale` deletes) that no hpcrl
    export wrote (no EXPORT_TAG, or hpcrl_step of the exports before the tag, in its header; or not a
    readable safetensors file), or None: what an export there would destroy."""
    from moe.hf_checkpoint import CheckpointFormatError, read_header

    for p in sorted(Path(out_dir).glob("model*.safetensors")):
        try:
            meta = read_header(p).get("__metadata__") or {}
        except CheckpointFormatError:
            return p
        if EXPORT_TAG not in meta and "hpcrl_step" not in meta:
            return p
    return None


def remove_stale(out_dir: str | os.PathLike[str]) -> None:
    """Delete the safetensors files and index of an earlier export in `out_dir` (a new export may
    have fewer files); other files stay."""
    for p in Path(out_dir).glob("model*.safetensors"):
        p.unlink()
    (Path(out_dir) / INDEX).unlink(missing_ok=True)


def create_files(out_dir: str | os.PathLike[str], plan: ShardPlan) -> None:
    """Create every file of `plan` in `out_dir` with its header, sized to its final length (the
    data regions read as zeros until written). Run once, before any `ShardWriter` opens them."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in plan.files:
        with open(out / f.name, "wb") as fh:
            fh.write(f.header)
            fh.truncate(f.size)


def write_index(out_dir: str | os.PathLike[str], plan: ShardPlan) -> None:
    """Write model.safetensors.index.json when the plan has several files (as transformers does)."""
    if len(plan.files) > 1:
        (Path(out_dir) / INDEX).write_text(json.dumps(plan.index_json(), indent=2) + "\n")


class ShardWriter:
    """Writes boxes of tensors into the files `create_files` made; several processes may each hold
    one and write disjoint boxes at once. Close it (or use `with`) to fsync and close the files."""

    def __init__(self, out_dir: str | os.PathLike[str], plan: ShardPlan) -> None:
        self.out, self.plan = Path(out_dir), plan
        self._fds: dict[str, int] = {}
        self.nbytes = 0

    def write(self, name: str, box: Box, bits: np.ndarray) -> None:
        """Write `bits` (C-contiguous, shape `box.shape`, the raw elements of box `box` of tensor
        `name`) at its place. Each run of the box that is contiguous in the file is one pwrite."""
        slot = self.plan.slots[name]
        size = DTYPES[slot.dtype][1]
        if tuple(bits.shape) != box.shape or bits.itemsize != size or not bits.flags.c_contiguous:
            raise ValueError(f"write({name!r}): need a C-contiguous {box.shape} array of {size}-byte "
                             f"elements, got {bits.shape} x {bits.itemsize} bytes")
        if not Box.full(slot.shape).contains(box):
            raise ValueError(f"write({name!r}): box {box} is not inside the tensor's shape "
                             f"{list(slot.shape)}")
        if box.numel == 0:
            return
        g = slot.shape
        # k: the first axis after which the box spans whole trailing axes; a run = its extent there.
        k = len(g) - 1 if g else 0
        while k > 0 and box.shape[k] == g[k]:
            k -= 1
        strides = [prod(g[d + 1:]) for d in range(len(g))]
        run = box.shape[k] * strides[k] if g else 1
        flat = bits.reshape(-1, run).view(np.uint8)
        fd = self._fd(slot.file)
        base = sum(o * st for o, st in zip(box.offsets, strides)) if g else 0
        for j, outer in enumerate(np.ndindex(*box.shape[:k])):
            elem = base + sum(a * strides[d] for d, a in enumerate(outer))
            self._pwrite(fd, memoryview(flat[j]), slot.offset + elem * size)
        self.nbytes += bits.nbytes

    def _fd(self, file: str) -> int:
        if file not in self._fds:
            self._fds[file] = os.open(self.out / file, os.O_WRONLY)
        return self._fds[file]

    @staticmethod
    def _pwrite(fd: int, data: memoryview, offset: int) -> None:
        while len(data):  # pwrite may write less than asked (Linux caps one call near 2 GiB)
            n = os.pwrite(fd, data, offset)
            data, offset = data[n:], offset + n

    def close(self) -> None:
        for fd in self._fds.values():
            os.fsync(fd)
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def dir_digest(model_dir: str | os.PathLike[str], chunk_bytes: int = 1 << 24) -> str:
    """The policy hash (`moe.digest`, docs/policy_hash.md) of every tensor in a HF model directory's
    safetensors files, read `chunk_bytes` of rows at a time (never a whole large tensor)."""
    import torch
    from safetensors import safe_open

    from moe.digest import LANES, digest_box, policy_hash

    by_code = {code: name for name, (code, _) in DTYPES.items()}
    d = Path(model_dir)
    index = d / INDEX
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists()
             else sorted(p.name for p in d.glob("*.safetensors")))
    if not files:
        raise ValueError(f"{d} holds no *.safetensors files")
    entries = []
    for file in files:
        with safe_open(str(d / file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is no mapping)
                sl = f.get_slice(name)
                shape, dtype = tuple(sl.get_shape()), by_code[sl.get_dtype()]
                if not shape:
                    lanes = digest_box(name, f.get_tensor(name), Box.full(()), ())
                else:
                    lanes = torch.zeros(LANES, dtype=torch.int64)
                    row_bytes = max(1, prod(shape[1:]) * DTYPES[dtype][1])
                    step = max(1, chunk_bytes // row_bytes)
                    for r0 in range(0, shape[0], step):
                        r1 = min(shape[0], r0 + step)
                        box = Box((r0,) + (0,) * (len(shape) - 1), (r1 - r0,) + shape[1:])
                        lanes += digest_box(name, sl[r0:r1], box, shape)
                entries.append((name, dtype, shape, lanes))
    return policy_hash(entries)
