"""Seeded sampling with SGLang (docs/sglang.md): hpcrl launches it with
--enable-deterministic-inference (else SGLang ignores `sampling_seed`) and its keys file, and
validation refuses rollout.server_args that SGLang's deterministic mode cannot serve."""

from __future__ import annotations

import pytest

from hpcrl.config import ConfigError, JobConfig, validate
from hpcrl.rollout.worker import sglang_command


def _sglang_job(server_args: list[str]) -> JobConfig:
    job = JobConfig()
    job.model.dtype = "bfloat16"
    job.rollout.logprob_tolerance, job.rollout.logprob_mean_tolerance = 1.0, 0.02  # the bf16 sync check
    job.resources.device = "cuda"
    job.rollout.backend = "sglang"
    job.rollout.server_args = server_args
    return job


def test_sglang_runs_deterministic_with_the_jobs_key_file(tmp_path):
    (tmp_path / "model_config.json").write_text("{}")
    cmd = sglang_command(_sglang_job(["--mem-fraction-static", "0.7"]), tmp_path, "h", 1)
    assert "--enable-deterministic-inference" in cmd
    assert cmd[cmd.index("--config") + 1] == str(tmp_path / "engine_keys.yaml")
    assert not any("key" in a for a in cmd if a.startswith("--"))  # keys only inside the file
    assert cmd[-2:] == ["--mem-fraction-static", "0.7"]


@pytest.mark.parametrize(("args", "index", "words"), [
    (["--sampling-backend", "flashinfer"], 0, "samples with the pytorch backend"),
    (["--mem-fraction-static=0.7", "--sampling-backend=flashinfer"], 1, "remove --sampling-backend"),
    (["--attention-backend", "torch_native"], 0, "needs one of ascend, fa3, fa4, flashinfer"),
    (["--enable-deterministic-inference"], 0, "hpcrl sets --enable-deterministic-inference itself"),
])
def test_validation_refuses_what_deterministic_sglang_cannot_serve(args, index, words):
    with pytest.raises(ConfigError) as info:
        validate(_sglang_job(args))
    assert info.value.path == f"rollout.server_args[{index}]" and words in str(info.value), str(info.value)


@pytest.mark.parametrize("args", [["--attention-backend", "fa3"], ["--sampling-backend=pytorch"],
                                  ["--attention-backend=triton", "--mem-fraction-static", "0.8"]])
def test_validation_accepts_deterministic_backends(args):
    validate(_sglang_job(args))


def test_a_float32_engine_attends_with_triton_unless_told(tmp_path):
    """Deterministic inference picks fa3 (Hopper) or flashinfer (Blackwell) when no attention
    backend is given, and both take fp16/bf16 only: a float32 engine (the default model.dtype) gets
    triton; a bf16 one SGLang's pick; a backend the job names stays, and a half-only one is refused
    with float32."""
    (tmp_path / "model_config.json").write_text("{}")
    fp32 = _sglang_job([])
    fp32.model.dtype = "float32"
    cmd = sglang_command(fp32, tmp_path, "h", 1)
    assert cmd[cmd.index("--attention-backend") + 1] == "triton"
    assert "--attention-backend" not in sglang_command(_sglang_job([]), tmp_path, "h", 1)
    fp32.rollout.server_args = ["--attention-backend=triton"]
    assert sum(a.startswith("--attention-backend") for a in sglang_command(fp32, tmp_path, "h", 1)) == 1
    fp32.rollout.server_args = ["--attention-backend", "fa3"]
    fp32.rollout.logprob_tolerance, fp32.rollout.logprob_mean_tolerance = 1e-4, 0.0
    with pytest.raises(ConfigError, match=r"run in float32 .* the fa3 kernels do not take \(fp16/bf16 only\)"):
        validate(fp32)
