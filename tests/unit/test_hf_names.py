"""hpcrl.rollout.hf_names against transformers' own `save_pretrained` output (Qwen3-MoE, Mixtral,
DeepSeek-V3 with and without q_lora_rank, DeepSeek-V2-Lite)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.hf_names import checkpoint_slots, checkpoint_state_dict, model_slots
from moe.hf_megatron import mtp_names

pytestmark = pytest.mark.timeout(120)

TINY_MIXTRAL = dict(model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
                    tie_word_embeddings=False)
TINY_DEEPSEEK_V3 = load_hf_config("tiny-deepseek-v3", None)
# DeepSeek-V2-Lite's shape of model: no q_lora_rank (q_proj), two shared experts, softmax top-k router.
TINY_DEEPSEEK_V2 = dict(model_type="deepseek_v2", vocab_size=64, hidden_size=32, intermediate_size=48,
                        moe_intermediate_size=16, num_hidden_layers=2, first_k_dense_replace=1,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16,
                        qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_routed_experts=4,
                        n_shared_experts=2, num_experts_per_tok=2, n_group=1, topk_group=1,
                        topk_method="greedy", max_position_embeddings=64, tie_word_embeddings=False)


def _build(hf_config: dict, seed: int = 0) -> torch.nn.Module:
    cfg = dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # router weights start at zero; make every tensor distinct
        for t in model.state_dict().values():  # parameters and persistent buffers (DeepSeek's router bias)
            t.copy_(torch.randn_like(t))
    return model


@pytest.mark.parametrize("hf_config", [load_hf_config("tiny-qwen3-moe", None), TINY_MIXTRAL,
                                       {**TINY_MIXTRAL, "tie_word_embeddings": True}, TINY_DEEPSEEK_V3,
                                       {**TINY_DEEPSEEK_V3, "q_lora_rank": None}, TINY_DEEPSEEK_V2],
                         ids=["qwen3_moe", "mixtral", "mixtral-tied", "deepseek_v3", "deepseek_v3-no-q-lora",
                              "deepseek_v2-lite"])
def test_checkpoint_state_dict_equals_save_pretrained(hf_config, tmp_path):
    model = _build(hf_config)
    model.save_pretrained(tmp_path)
    on_disk = load_file(str(tmp_path / "model.safetensors"))
    ours = checkpoint_state_dict(model)
    assert set(ours) == set(on_disk)
    for name, tensor in ours.items():
        assert tensor.shape == on_disk[name].shape, name
        assert torch.equal(tensor, on_disk[name]), name
    fused = [n for n in model.state_dict() if n.endswith("experts.gate_up_proj")]
    assert fused, "the model should keep its experts fused in memory"
    if hf_config["model_type"] == "mixtral":
        assert "model.layers.1.block_sparse_moe.experts.2.w3.weight" in ours
        assert "model.layers.0.block_sparse_moe.gate.weight" in ours
    elif hf_config["model_type"].startswith("deepseek"):
        last = hf_config["num_hidden_layers"] - 1
        experts = hf_config["n_routed_experts"]
        for name in ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight",
                     f"model.layers.{last}.mlp.experts.{experts - 1}.down_proj.weight",
                     f"model.layers.{last}.mlp.gate.weight",
                     f"model.layers.{last}.mlp.shared_experts.up_proj.weight",
                     f"model.layers.{last}.self_attn.kv_b_proj.weight"):
            assert name in ours, name
        q_lora = hf_config["q_lora_rank"] is not None
        assert (f"model.layers.{last}.self_attn.q_a_proj.weight" in ours) == q_lora
        assert (f"model.layers.{last}.self_attn.q_proj.weight" in ours) != q_lora
        bias = f"model.layers.{last}.mlp.gate.e_score_correction_bias"
        assert (bias in ours) == (hf_config["model_type"] == "deepseek_v3")
        assert not any(n.startswith(f"model.layers.{hf_config['num_hidden_layers']}.") for n in ours)
    else:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in ours


@pytest.mark.parametrize("hf_config", [load_hf_config("tiny-qwen3-moe", None), TINY_DEEPSEEK_V3],
                         ids=["qwen3_moe", "deepseek_v3"])
def test_slots_write_back_into_a_fresh_model(hf_config):
    src, dst = _build(hf_config, seed=1), _build(hf_config, seed=2)
    params = dst.state_dict(keep_vars=True)
    with torch.no_grad():
        for ckpt, tensor in checkpoint_state_dict(src).items():
            pname, index = model_slots(dst)[ckpt]
            params[pname][index].copy_(tensor)
    for name, tensor in src.state_dict().items():
        assert torch.equal(tensor, dst.state_dict()[name]), name


def test_order_is_fixed_and_grouped_per_expert():
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": (2, 8, 4),
              "model.layers.0.mlp.experts.down_proj": (2, 4, 4),
              "model.layers.0.mlp.gate.weight": (2, 4)}
    names = list(checkpoint_slots(shapes, "qwen3_moe"))
    assert names == [f"model.layers.0.mlp.experts.{e}.{p}.weight" for e in range(2)
                     for p in ("gate_proj", "up_proj", "down_proj")] + ["model.layers.0.mlp.gate.weight"]
    slots = checkpoint_slots(shapes, "qwen3_moe")
    assert slots["model.layers.0.mlp.experts.1.up_proj.weight"] == (
        "model.layers.0.mlp.experts.gate_up_proj", (1, slice(4, 8)))


def test_unknown_family_with_fused_experts_is_rejected():
    shapes = {"model.layers.0.mlp.experts.gate_up_proj": (2, 8, 4),
              "model.layers.0.mlp.experts.down_proj": (2, 4, 4)}
    with pytest.raises(ValueError, match="model_type 'olmoe'.*supported model types"):
        checkpoint_slots(shapes, "olmoe")
    with pytest.raises(ValueError, match="no matching model.layers.0.mlp.experts.down_proj"):
        checkpoint_slots({"model.layers.0.mlp.experts.gate_up_proj": (2, 8, 4)}, "qwen3_moe")


def test_mtp_names_are_the_layers_right_after_the_decoder():
    names = ["model.layers.2.mlp.gate.weight", "model.layers.3.eh_proj.weight", "model.layers.4.enorm.weight",
             "model.layers.5.hnorm.weight", "model.layers.31.enorm.weight", "lm_head.weight"]
    assert mtp_names(names, 3, 2) == ["model.layers.3.eh_proj.weight", "model.layers.4.enorm.weight"]
    assert mtp_names(names, 3, 0) == []
