"""What an offline W&B run wrote (WANDB_MODE=offline): the history rows of its `run-<id>.wandb`
file, read back without a W&B server.

The file is W&B's record log (the LevelDB log format: a 7-byte header ":W&B", magic 0xBEE1,
version, then 32 KiB blocks of chunks, each `crc32 u32, length u16, type u8` and its bytes; types
full 1, first 2, middle 3, last 4); each record is a `wandb_internal_pb2.Record` protobuf.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
CHUNK_HEADER = struct.Struct("<IHB")


def _records(path: Path):
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path}: not a W&B record log ({data[:7]!r})"
    pos, pending = 7, b""
    while pos + CHUNK_HEADER.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < CHUNK_HEADER.size:  # a block's tail too short for a chunk header is padding
            pos += left
            continue
        _crc, length, kind = CHUNK_HEADER.unpack_from(data, pos)
        if kind == 0:  # zeros to the block's end
            pos += left
            continue
        chunk = data[pos + CHUNK_HEADER.size:pos + CHUNK_HEADER.size + length]
        pos += CHUNK_HEADER.size + length
        if kind == 1:
            yield chunk
        elif kind == 2:
            pending = chunk
        elif kind == 3:
            pending += chunk
        elif kind == 4:
            yield pending + chunk


def offline_runs(run_dir: Path) -> list[Path]:
    """RUN_DIR/wandb/offline-run-<time>-<id>/run-<id>.wandb, the oldest attempt first (by the files'
    modification times: <time> has whole seconds)."""
    return sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"), key=lambda p: p.stat().st_mtime_ns)


def history(path: Path) -> list[dict[str, Any]]:
    """The rows W&B's `log` calls wrote, in order, without W&B's own keys (_step, _runtime, ...)."""
    from wandb.proto import wandb_internal_pb2 as pb

    rows = []
    for raw in _records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                   for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    return rows


def exit_code(path: Path) -> int | None:
    """The exit code the run's `finish` recorded, or None without an exit record."""
    from wandb.proto import wandb_internal_pb2 as pb

    codes = []
    for raw in _records(path):
        record = pb.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "exit":
            codes.append(record.exit.exit_code)
    return codes[-1] if codes else None


def run_id(path: Path) -> str:
    """The W&B run id of an offline run file (run-<id>.wandb)."""
    return path.stem.removeprefix("run-")
