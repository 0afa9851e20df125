"""The run dir's lock (hpcrl/runner.py lock_run_dir): one `hpcrl run` at a time in a run dir, the
lock's fd inherited by the world (an mpiexec left running when `hpcrl run` was killed keeps it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_job
from hpcrl.runner import check_run_dir, lock_run_dir

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_grpo.yaml"


def test_a_locked_run_dir_is_refused_until_every_holder_is_gone(tmp_path: Path) -> None:
    job = load_job(EXAMPLE)
    run_dir = tmp_path / "run"
    fd = lock_run_dir(job, run_dir)
    check_run_dir(run_dir)  # a run dir holding only the lock is still a run dir
    # a child that inherited the fd (as mpiexec does) holds the lock after this process lets go
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], pass_fds=(fd,))
    os.close(fd)
    try:
        with pytest.raises(ConfigError) as err:
            lock_run_dir(job, run_dir)
        assert err.value.path == "--run-dir", err.value.path
        assert f"is in use by another hpcrl run (its `hpcrl run` pid {os.getpid()}" in str(err.value)
    finally:
        child.kill()
        child.wait()
    os.close(lock_run_dir(job, run_dir))  # free again
