"""bfloat16 training end to end on CPU (`model.dtype: bfloat16`): a bf16 Megatron trainer with fp32
main parameters in the distributed optimizer against a bf16 reference engine. The bf16 sync check
holds at every step and still stops a push that carries one wrong tensor; the export is bf16 and
hashes to the run's policy_sha256; a run interrupted between checkpoints resumes bit-identical.
The same job runs on GPUs (tests/gpu/test_gpu_example.py, test_sglang_example.py)."""

import json

import pytest
from e2e_util import EXAMPLE, hpcrl, preempt_then_resume

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

BF16 = ["--set", "model.dtype=bfloat16", "--set", "rollout.logprob_tolerance=1.0",
        "--set", "rollout.logprob_mean_tolerance=0.02", "--set", "logging.progress=false"]
ARGS = [*BF16, "--set", "algorithm.num_steps=8", "--set", "checkpoint.interval_steps=3"]


def _result(run_dir) -> tuple[list[dict], str]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return records, json.loads((run_dir / "final.json").read_text())["policy_sha256"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bf16") / "run"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, timeout_s=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return run_dir, *_result(run_dir)


def test_bf16_run_checks_every_sync_and_exports_what_it_hashed(uninterrupted, tmp_path):
    from safetensors import safe_open

    from checkpoints.hf_safetensors import dir_digest

    run_dir, records, sha = uninterrupted
    assert len(records) == 8
    for r in records:  # engine and trainer both bf16, rounding apart: a real mismatch, inside the check
        assert r["sync/logprob_mean_abs_diff"] < 0.02 and r["sync/logprob_max_abs_diff"] < 1.0, r
    assert max(r["sync/logprob_max_abs_diff"] for r in records) > 1e-3
    exported = tmp_path / "hf"
    out, _ = hpcrl("export", str(run_dir), "--out", str(exported), timeout_s=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = sorted(exported.glob("*.safetensors"))
    with safe_open(str(files[0]), "pt") as f:
        assert {str(f.get_slice(k).get_dtype()) for k in f.keys()} == {"BF16"}
    assert dir_digest(exported) == sha
    assert json.loads((exported / "config.json").read_text())["dtype"] == "bfloat16"  # from_pretrained's "auto"


def test_bf16_resume_after_a_signal_is_bit_identical(uninterrupted, tmp_path):
    _, records, sha = uninterrupted
    run_dir = tmp_path / "run"
    preempt_then_resume(run_dir, ARGS, at_step=5)
    again, sha_again = _result(run_dir)
    assert sha_again == sha
    assert [(r["step"], r["reward/mean"]) for r in again] == [(r["step"], r["reward/mean"]) for r in records]


def test_bf16_ppo_resumes_policy_and_critic_bit_identical(tmp_path):
    """PPO's critic is bf16 too, with its own fp32 main parameters in the checkpoint."""
    args = [*BF16, "--set", "algorithm.name=ppo", "--set", "algorithm.ppo_epochs=2",
            "--set", "algorithm.mini_batch_size=64", "--set", "algorithm.num_steps=6",
            "--set", "checkpoint.interval_steps=3"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(whole), *args, timeout_s=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    preempt_then_resume(cut, args, at_step=4)
    keys = ("reward/mean", "train/loss", "critic/vf_loss", "critic/values_mean")
    first, again = (_result(d)[0] for d in (whole, cut))
    assert [[r[k] for k in keys] for r in again] == [[r[k] for k in keys] for r in first]
    final, resumed = (json.loads((d / "final.json").read_text()) for d in (whole, cut))
    assert resumed == final and len(final["critic_sha256"]) == 64


def test_bf16_sync_check_stops_a_push_with_one_wrong_tensor(tmp_path):
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(tmp_path / "perturb"), *BF16,
                   "--set", "algorithm.num_steps=4", env_extra={"HPCRL_SYNC_FAULT": "perturb:1"}, timeout_s=280)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "step 2: engine and trainer log-probs differ by" in out.stderr, out.stderr[-3000:]
    assert "rollout.logprob_mean_tolerance=0.02: most tokens moved" in out.stderr
