"""Lazy random access to the rows of a .jsonl or .parquet data file, without reading it whole.

    rows = open_rows(path, key="data.path")   # JsonlRows or ParquetRows
    len(rows); rows[i] -> dict; rows.where(i) -> "row 12 (line 14)"

- jsonl: `JsonlRows` scans the file once in CHUNK_BYTES chunks for '\n' and keeps a numpy int64 array
  of the byte offsets of its non-empty lines (8 bytes per row); `rows[i]` seeks there and parses one line.
  Memory: the index plus one chunk; time: one pass over the bytes, no JSON parsing.
- parquet: `ParquetRows` reads the footer only; `rows[i]` reads the row group holding row i (the last
  CACHED_GROUPS groups stay in memory as Arrow tables) and converts that one row to Python.
Rows are numbered from 1 in messages; a message also gives a jsonl row's line number. Bad files raise
ValueError starting "{key}={path!r}: " (key: data.path or data.val_path) and saying what to fix; a bad
row is a DataError, which a run stops on as on bad input (exit 2), not as on a fault.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

CHUNK_BYTES = 1 << 20
CACHED_GROUPS = 2
SUFFIXES = (".jsonl", ".parquet")


class DataError(ValueError):
    """A row of a data file cannot be used; the message names the key, the file, the row and the fix."""


class JsonlRows:
    """Rows of a JSON-lines file; empty lines are skipped (they are not rows)."""

    def __init__(self, path: Path, key: str) -> None:
        self.path, self.key = path, key
        self.offsets, self.size = _line_starts(path)
        self._fd = os.open(path, os.O_RDONLY)  # read with pread: no shared file position (threads, forks)

    def __del__(self) -> None:
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

    def __len__(self) -> int:
        return len(self.offsets)

    def where(self, i: int) -> str:
        """'row N', with the line number when it differs (empty lines above; error messages only)."""
        line = _line_number(self.path, int(self.offsets[i]))
        return f"row {i + 1}" if line == i + 1 else f"row {i + 1} (line {line})"

    def __getitem__(self, i: int) -> dict[str, Any]:
        start = int(self.offsets[i])
        end = int(self.offsets[i + 1]) if i + 1 < len(self.offsets) else self.size
        line = os.pread(self._fd, end - start, start)  # the line and any empty lines after it
        try:
            row = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            msg = exc.msg if isinstance(exc, json.JSONDecodeError) else str(exc)
            line_no = _line_number(self.path, int(self.offsets[i]))
            raise DataError(f"{self.key}={str(self.path)!r}: row {i + 1}: line {line_no} is not JSON "
                            f"({msg}); every non-empty line must be one JSON object") from None
        if not isinstance(row, dict):
            raise DataError(f"{self.key}={str(self.path)!r}: {self.where(i)} is a JSON "
                            f"{type(row).__name__}, not an object; every line must be one JSON object "
                            "such as {\"prompt\": ..., \"answer\": ...}")
        return row


def _line_starts(path: Path) -> tuple[np.ndarray, int]:
    """(int64 byte offsets of the non-empty lines of `path`, its size in bytes); "\n" and "\r\n"
    lines are empty."""
    parts = [np.zeros(1, np.int64)]  # a line starts at offset 0 and after every '\n'
    size = 0
    buf = bytearray(CHUNK_BYTES)
    with path.open("rb", buffering=0) as f:
        while n := f.readinto(buf):
            newlines = np.flatnonzero(np.frombuffer(buf, np.uint8, count=n) == 10).astype(np.int64)
            newlines += size + 1
            parts.append(newlines)
            size += n
    starts = np.concatenate(parts)
    del parts
    if starts[-1] == size:  # after the final '\n': no line
        starts = starts[:-1]
    if len(starts) == 0:
        return starts, size
    # Lines of 1 or 2 bytes are the only candidates for empty lines; there are few, so read them one by one.
    lengths = np.diff(starts, append=size)
    candidates = np.flatnonzero(lengths <= 2)
    empty = []
    with path.open("rb") as f:
        for i in candidates.tolist():
            f.seek(int(starts[i]))
            if f.read(int(lengths[i])) in (b"\n", b"\r\n"):
                empty.append(i)
    return (np.delete(starts, empty) if empty else starts), size


def _line_number(path: Path, offset: int) -> int:
    """1-based line number of the byte at `offset` (error messages only: reads up to offset)."""
    n, done = 1, 0
    with path.open("rb") as f:
        while done < offset:
            chunk = f.read(min(CHUNK_BYTES, offset - done))
            if not chunk:
                break
            n += chunk.count(b"\n")
            done += len(chunk)
    return n


class ParquetRows:
    """Rows of a parquet file, read one row group at a time on demand."""

    def __init__(self, path: Path, key: str) -> None:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"{key}={str(path)!r}: reading parquet needs pyarrow "
                             "(pip install pyarrow), or convert the file to .jsonl") from None
        self.path, self.key = path, key
        try:
            self._file = pq.ParquetFile(str(path))
        except Exception as exc:  # pyarrow raises ArrowInvalid/OSError with its own text
            raise ValueError(f"{key}={str(path)!r}: not a parquet file ({exc})") from None
        meta = self._file.metadata
        sizes = [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]
        self.group_starts = np.cumsum([0, *sizes], dtype=np.int64)
        self._groups: OrderedDict[int, Any] = OrderedDict()

    def __len__(self) -> int:
        return int(self.group_starts[-1])

    def where(self, i: int) -> str:
        return f"row {i + 1}"

    def __getitem__(self, i: int) -> dict[str, Any]:
        g = int(np.searchsorted(self.group_starts, i, side="right")) - 1
        table = self._groups.get(g)
        if table is None:
            table = self._groups[g] = self._file.read_row_group(g)
            while len(self._groups) > CACHED_GROUPS:
                self._groups.popitem(last=False)
        self._groups.move_to_end(g)
        return table.slice(i - int(self.group_starts[g]), 1).to_pylist()[0]


def open_rows(path: Path, key: str = "data.path") -> JsonlRows | ParquetRows:
    """The rows of `path` (lazy); ValueError for a missing file, an unknown suffix or an empty file."""
    if path.suffix not in SUFFIXES:
        raise ValueError(f"{key}={str(path)!r}: unsupported file type {path.suffix!r}; "
                         "use .jsonl or .parquet")
    if not path.is_file():
        raise ValueError(f"{key}={str(path)!r}: no such file; give a .jsonl or .parquet file "
                         "(relative to the job file)")
    rows = JsonlRows(path, key) if path.suffix == ".jsonl" else ParquetRows(path, key)
    if len(rows) == 0:
        raise ValueError(f"{key}={str(path)!r}: the file has no rows")
    return rows
