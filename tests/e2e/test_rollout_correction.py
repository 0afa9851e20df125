"""Rollout correction on a real engine/trainer mismatch on CPU: a bfloat16 reference engine against
the float32 trainer. The bf16 sync check (mean |d log-prob|) passes its rounding and still fails a
push that carries one wrong tensor; TIS truncates and MIS masks where the engine's log-probs differ."""

import json

import pytest

from e2e_util import EXAMPLE, hpcrl

pytestmark = pytest.mark.e2e

BF16 = ["--set", "rollout.dtype=bfloat16", "--set", "rollout.logprob_tolerance=1.0",
        "--set", "rollout.logprob_mean_tolerance=0.02"]


def run(run_dir, *settings: str, env_extra: dict | None = None):
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", "algorithm.num_steps=4",
                   "--set", "logging.progress=false", *settings, timeout_s=280, env_extra=env_extra)
    records = ([json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
               if (run_dir / "metrics.jsonl").exists() else [])
    return out, records


@pytest.mark.timeout(600)
def test_tis_and_mis_act_on_a_bf16_engine(tmp_path):
    out, tis = run(tmp_path / "tis", *BF16, "--set", "algorithm.rollout_correction=tis",
                   "--set", "algorithm.tis_cap=1.002")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for r in tis:  # bf16 rounding: a real mismatch, within the bf16 sync check
        assert 1e-4 < r["train/mismatch_abs_log_ratio"] < 1e-2, r
        assert 0 < r["train/tis_truncated_frac"] < 0.5, r
        assert r["sync/logprob_mean_abs_diff"] < 0.02 and r["sync/logprob_max_abs_diff"] > 1e-3, r
    out, mis = run(tmp_path / "mis", *BF16, "--set", "algorithm.rollout_correction=mis",
                   "--set", "algorithm.mis_low=0.999", "--set", "algorithm.mis_high=1.001")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert all(0 < r["train/mis_masked_frac"] < 1 for r in mis), [r["train/mis_masked_frac"] for r in mis]
    out, same = run(tmp_path / "fp32", "--set", "algorithm.rollout_correction=tis", "--set", "algorithm.tis_cap=1.002")
    assert out.returncode == 0
    assert all(r["train/mismatch_abs_log_ratio"] < 1e-5 and r["train/tis_truncated_frac"] == 0 for r in same)


@pytest.mark.timeout(300)
def test_the_bf16_sync_check_still_fails_a_wrong_tensor(tmp_path):
    out, _ = run(tmp_path / "perturb", *BF16, env_extra={"HPCRL_SYNC_FAULT": "perturb:1"})
    assert out.returncode == 1
    assert "step 2: engine and trainer log-probs differ by" in out.stderr, out.stderr[-3000:]
    assert "rollout.logprob_mean_tolerance=0.02: most tokens moved" in out.stderr


def test_a_bf16_engine_needs_the_bf16_check(tmp_path):
    out, _ = hpcrl("validate", str(EXAMPLE), "--set", "rollout.dtype=bfloat16", timeout_s=120)
    assert out.returncode == 2 and "rollout.logprob_tolerance: 1.0" in out.stderr, out.stderr
