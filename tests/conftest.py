"""Puts tests/ on sys.path so that every test folder can import the shared builders in tests/
(hf_fixtures: small HF model directories and tokenizers made on the spot), provides the
`one_torch_thread` fixture, and removes MPICH
shared-memory segments that no live process maps before the session (ranks killed by earlier
runs' fault and timeout tests leave them in /dev/shm; see dev/LOG.md)."""

import glob
import os
import sys
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops in this process: one intra-op thread avoids OpenMP spin contention on the shared
    2-core machine (a module asks for it with `pytest.mark.usefixtures("one_torch_thread")`)."""
    import torch

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)
