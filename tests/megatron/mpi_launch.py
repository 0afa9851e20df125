"""Run a test worker script under real `mpiexec` with a hang guard (the tests of this directory)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"


def run_mpiexec(ranks: int, script: Path, *args: str, timeout_s: float, label: str = "") -> str:
    """`mpiexec -n ranks python script args...` (one thread per rank, warnings off); returns its output, stdout and stderr together. Fails the test with the output's tail
    when it exits non-zero, or kills the whole process group and fails after `timeout_s`."""
    # -disable-auto-cleanup: else hydra SIGKILLs ranks still running once one exits (dev/LOG.md, session 13)
    cmd = [str(MPIEXEC), "-disable-auto-cleanup", "-n", str(ranks), sys.executable, str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    label = label or " ".join(cmd[3:])
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{label}: mpiexec timed out after {timeout_s}s\n{log[-4000:]}")
    assert proc.returncode == 0, f"{label}: mpiexec rc={proc.returncode}\n{log[-6000:]}"
    return log
