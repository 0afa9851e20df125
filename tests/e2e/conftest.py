"""Shared e2e runs, made once per session and reused by every test that compares against them: the
tiny example's 8-step reference run (test_resume, test_eval_run) and the tiny DeepSeek-V3 example's
whole run (test_run_example: it learns; test_resume: an interrupted run ends the same)."""

import pytest
from e2e_util import DEEPSEEK_EXAMPLE, EXAMPLE, hpcrl

REFERENCE_ARGS = ["--set", "algorithm.num_steps=8", "--set", "checkpoint.interval_steps=3", "--set",
                  "logging.progress=false", "--set", "resources.cpu_bind=auto",
                  "--set", "rollout.nodes_per_engine=2"]
"""The reference run's settings: 8 steps, checkpoints after steps 2, 5 and 7, ranks bound to cores
(test_cpu_bind_run), the engine over two nodes (a follower node and its rollout rank, docs/sglang.md;
test_cpu_bind_run checks their stop). Neither changes a number, which test_resume's runs (one node
per engine, unbound) show against this one."""

DEEPSEEK_ARGS = ["--set", "logging.progress=false"]
"""The DeepSeek-V3 example as it is (80 steps, weight sync `auto` = shard on CPU), without the
progress bar."""


@pytest.fixture(scope="session")
def reference_run(tmp_path_factory):
    """(run dir, REFERENCE_ARGS) of the uninterrupted tiny example (no evaluation)."""
    run_dir = tmp_path_factory.mktemp("ref") / "run"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *REFERENCE_ARGS, timeout_s=500)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return run_dir, REFERENCE_ARGS


@pytest.fixture(scope="session")
def deepseek_example_run(tmp_path_factory):
    """(run dir, `hpcrl run`'s output, wall seconds, DEEPSEEK_ARGS) of the uninterrupted tiny
    DeepSeek-V3 example."""
    run_dir = tmp_path_factory.mktemp("deepseek") / "run"
    out, wall = hpcrl("run", str(DEEPSEEK_EXAMPLE), "--run-dir", str(run_dir), *DEEPSEEK_ARGS, timeout_s=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, out, wall, DEEPSEEK_ARGS
