"""RUN_DIR/.phase.json: the controller's current step and phase, for a launcher to name when a
rank dies without a word (launch/local.py reads it).

Written four times per step, so it is rewritten in place with one `pwrite` (a few microseconds)
instead of a temp file and a rename (about 0.35 ms each here). Each record is padded with spaces
to the longest record so far, so no tail of an older one survives; POSIX makes a `read` and a
`write` of a regular file atomic with respect to each other, so a reader sees one whole record.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


class PhaseFile:
    MIN_SIZE = 128

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        self._size = self.MIN_SIZE

    def write(self, step: int, phase: str) -> None:
        data = json.dumps({"step": step, "phase": phase}).encode()
        self._size = max(self._size, len(data))
        os.pwrite(self._fd, data.ljust(self._size), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
