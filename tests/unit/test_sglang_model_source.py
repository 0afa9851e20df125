"""What SGLang starts from (hpcrl/rollout/worker.py `sglang_command`): model.path's own weights; or,
for a random-init model and for an FP8 block-scaled model.path, RUN_DIR/engine_model with only its
config.json, without `quantization_config`, and `--load-format dummy`. SGLang would build FP8 layers
for an FP8 directory, and the trainer's bf16 pushes would land in them beside the checkpoint's scales;
the engines serve bf16, and the initial sync (checked at step 0) brings the weights."""

from __future__ import annotations

import json

import pytest

from hpcrl.config import JobConfig
from hpcrl.rollout.worker import sglang_command

FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def _job(model_path: str | None) -> JobConfig:
    job = JobConfig()
    job.model.path, job.model.dtype = model_path, "bfloat16"
    job.rollout.backend, job.resources.device = "sglang", "cuda"
    return job


def _arg(cmd: list[str], flag: str) -> str | None:
    return cmd[cmd.index(flag) + 1] if flag in cmd else None


@pytest.mark.parametrize(("source", "served_as_stored"), [("bf16", True), ("fp8", False), ("random", False)])
def test_sglang_serves_bf16_weights_the_trainer_pushes(tmp_path, source, served_as_stored):
    hf = {"model_type": "deepseek_v3", "hidden_size": 64}
    if source == "fp8":
        hf["quantization_config"] = FP8
    (tmp_path / "model_config.json").write_text(json.dumps(hf))
    model_path = None if source == "random" else "/models/deepseek"
    cmd = sglang_command(_job(model_path), tmp_path, "h", 1)
    if served_as_stored:
        assert _arg(cmd, "--model-path") == model_path and "--load-format" not in cmd
        assert not (tmp_path / "engine_model").exists()
        return
    assert _arg(cmd, "--model-path") == str(tmp_path / "engine_model") and _arg(cmd, "--load-format") == "dummy"
    served = json.loads((tmp_path / "engine_model" / "config.json").read_text())
    assert served == {"model_type": "deepseek_v3", "hidden_size": 64}
    assert _arg(cmd, "--dtype") == "bfloat16"
