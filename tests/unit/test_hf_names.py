"""hpcrl.rollout.hf_names against transformers' own `save_pretrained` output (Qwen3-MoE, Mixtral)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.hf_names import checkpoint_slots, checkpoint_state_dict, model_slots

pytestmark = pytest.mark.timeout(120)

TINY_MIXTRAL = dict(model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=16,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                    num_local_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
                    tie_word_embeddings=False)


def _build(hf_config: dict, seed: int = 0) -> torch.nn.Module:
    cfg = dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # router weights start at zero; make every tensor distinct
        for p in model.parameters():
            p.copy_(torch.randn_like(p))
    return model


@pytest.mark.parametrize("hf_config", [load_hf_config("tiny-qwen3-moe", None), TINY_MIXTRAL,
                                       {**TINY_MIXTRAL, "tie_word_embeddings": True}],
                         ids=["qwen3_moe", "mixtral", "mixtral-tied"])
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
    else:
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in ours


def test_slots_write_back_into_a_fresh_model():
    hf_config = load_hf_config("tiny-qwen3-moe", None)
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
