"""algorithm.aux_loss_coef null (the default) takes the model's own load-balancing coefficient: the
shipped configs' values, transformers' default where a Qwen3-MoE or Mixtral config.json has none, and
0 for DeepSeek-V3 (bias balancing); a value set in the job wins. The policy's Megatron config carries
the resolved value (tests/megatron/test_policy_single_rank.py builds it)."""

import json
from pathlib import Path

import pytest

from hpcrl.config import load_job
from hpcrl.models.presets import CONFIG_DIR
from hpcrl.trainer.model import aux_loss_coef_of

MOE_CONFIGS = Path(__file__).resolve().parents[2] / "moe" / "configs"


@pytest.mark.parametrize(("path", "want"), [
    (MOE_CONFIGS / "qwen3-30b-a3b.json", 0.001), (MOE_CONFIGS / "qwen3-235b-a22b.json", 0.001),
    (MOE_CONFIGS / "mixtral-8x7b-v0.1.json", 0.02), (MOE_CONFIGS / "deepseek-v3.json", 0.0),
    (CONFIG_DIR / "tiny-qwen3-moe.json", 0.01), (CONFIG_DIR / "tiny-deepseek-v3.json", 0.0)],
    ids=lambda v: v.name if isinstance(v, Path) else None)
def test_null_takes_the_models_own_coefficient(path, want):
    cfg = json.loads(path.read_text())
    assert aux_loss_coef_of(cfg, None) == want
    assert aux_loss_coef_of(cfg, 0.05) == 0.05 and aux_loss_coef_of(cfg, 0.0) == 0.0  # the job's wins


def test_a_config_without_the_key_takes_transformers_default():
    from transformers import MixtralConfig, Qwen3MoeConfig

    for path, hf_class in ((MOE_CONFIGS / "qwen3-30b-a3b.json", Qwen3MoeConfig),
                           (MOE_CONFIGS / "mixtral-8x7b-v0.1.json", MixtralConfig)):
        cfg = json.loads(path.read_text())
        del cfg["router_aux_loss_coef"]
        assert aux_loss_coef_of(cfg, None) == hf_class().router_aux_loss_coef == 0.001


def test_the_job_file_default_is_null_and_a_value_is_kept(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: aux\n")
    assert load_job(job).algorithm.aux_loss_coef is None
    assert load_job(job, ["algorithm.aux_loss_coef=0.003"]).algorithm.aux_loss_coef == 0.003
    assert load_job(job, ["algorithm.aux_loss_coef=null"]).algorithm.aux_loss_coef is None


def test_kimi_k2_takes_deepseek_v3s_zero():
    """Kimi-K2's config.json has DeepSeek-V3's aux_loss_alpha and seq_aux, and balances by its bias too."""
    from deepseek_dirs import kimi_k2_config

    assert aux_loss_coef_of(kimi_k2_config(), None) == 0.0
