"""Puts tests/ on sys.path so that every test folder can import the shared builders in tests/
(hf_fixtures: small HF model directories and tokenizers made on the spot), and removes MPICH
shared-memory segments that no live process maps before the session (ranks killed by earlier
runs' fault and timeout tests leave them in /dev/shm; see dev/LOG.md)."""

import glob
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))


def _remove_stale_mpich_segments() -> None:
    segments = glob.glob("/dev/shm/mpich_shm_*")
    if not segments:
        return
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split()[-1] for line in f if "/dev/shm/mpich_shm_" in line)
        except OSError:
            continue
    for seg in segments:
        if seg not in mapped:
            try:
                os.unlink(seg)
            except OSError:
                pass


_remove_stale_mpich_segments()
