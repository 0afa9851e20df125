"""The per-step log-prob check can fail in the runs that matter (both tiny examples, Qwen3-MoE and
DeepSeek-V3): the engines start from other random weights than the trainer's (as SGLang's dummy load
does), so a skipped initial push fails step 0, and a push that carries one wrong tensor fails the
step that generates with it (or, in an asynchronous run, the step whose batch the engines score
with it)."""

import pytest

from e2e_util import DEEPSEEK_EXAMPLE, EXAMPLE, hpcrl, leftover_processes

pytestmark = pytest.mark.e2e


def run_with_sync_fault(run_dir, fault: str, example=EXAMPLE, *settings: str) -> str:
    out, _ = hpcrl("run", str(example), "--run-dir", str(run_dir), "--set", "algorithm.num_steps=4",
                   "--set", "logging.progress=false", *settings, env_extra={"HPCRL_SYNC_FAULT": fault},
                   timeout_s=280)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stderr
    assert not leftover_processes(str(run_dir))
    assert not (run_dir / "final.json").exists()
    return out.stdout + out.stderr


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", [EXAMPLE, DEEPSEEK_EXAMPLE], ids=["qwen3_moe", "deepseek_v3"])
def test_skipped_initial_push_fails_step_0(tmp_path, example):
    text = run_with_sync_fault(tmp_path / "skip", "skip:-1", example)
    assert "hpcrl run failed: step 0: engine and trainer log-probs differ" in text, text[-3000:]
    assert "The engine is not running the trainer's weights" in text


@pytest.mark.timeout(300)
@pytest.mark.parametrize("example", [EXAMPLE, DEEPSEEK_EXAMPLE], ids=["qwen3_moe", "deepseek_v3"])
def test_perturbed_later_push_fails_the_step_that_uses_it(tmp_path, example):
    """The push after step 1's update carries a scaled final norm: step 2 generates with it."""
    text = run_with_sync_fault(tmp_path / "perturb", "perturb:1", example)
    assert "hpcrl run failed: step 2: engine and trainer log-probs differ" in text, text[-3000:]


@pytest.mark.timeout(300)
def test_perturbed_push_fails_an_asynchronous_run_where_its_version_scores(tmp_path):
    """max_staleness 1: step 2's batch was sampled by the correct version 1, but the engines score it
    again holding the perturbed version 2 (one completion per group, rollout.rescore_per_group)."""
    text = run_with_sync_fault(tmp_path / "async", "perturb:1", EXAMPLE, "--set", "rollout.max_staleness=1")
    assert "hpcrl run failed: step 2: engine and trainer log-probs differ" in text, text[-3000:]
