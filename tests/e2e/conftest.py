"""Shared e2e runs: the tiny example's 8-step reference run is made once per session and reused by
every test that compares against it (test_resume, test_eval_run)."""

import pytest
from e2e_util import EXAMPLE, hpcrl

REFERENCE_ARGS = ["--set", "algorithm.num_steps=8", "--set", "checkpoint.interval_steps=3", "--set",
                  "logging.progress=false", "--set", "resources.cpu_bind=auto"]
"""The reference run's settings: 8 steps, checkpoints after steps 2, 5 and 7, ranks bound to cores
(test_cpu_bind_run; binding changes no number, which the runs compared against this one show)."""


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """(run dir, REFERENCE_ARGS) of the uninterrupted tiny example (no evaluation)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *REFERENCE_ARGS, timeout_s=500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return run_dir, REFERENCE_ARGS
