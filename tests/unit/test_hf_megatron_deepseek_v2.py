"""moe/hf_megatron.py on DeepSeek-V2 configs: what it accepts (DeepSeek-V2-Lite's greedy softmax router)
and what it refuses, naming the config.json key (V2's group_limited_greedy over several groups, a
sigmoid score, renormalised top-k weights), and the V2 checkpoint's tensors (V3's minus the router bias)
as transformers and moe.specs name them.
"""

from __future__ import annotations

import pytest
import torch
from deepseek_dirs import deepseek_v2_config

from hpcrl.trainer.model import aux_loss_coef_of, build_hf_model
from moe.hf_megatron import (HFModelDims, RankCoords, hf_fused_to_checkpoint, hf_to_megatron, local_params,
                             megatron_to_hf)
from moe.specs import spec_from_config

V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 16, "num_key_value_heads": 16,
    "q_lora_rank": None, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6, "n_group": 1,
    "topk_group": 1, "topk_method": "greedy", "scoring_func": "softmax", "norm_topk_prob": False,
    "routed_scaling_factor": 1.0, "aux_loss_alpha": 0.001, "seq_aux": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
"""deepseek-ai/DeepSeek-V2-Lite's config.json (its size and routing keys)."""
V2 = {**V2_LITE, "hidden_size": 5120, "intermediate_size": 12288, "moe_intermediate_size": 1536,
      "num_hidden_layers": 60, "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
      "n_routed_experts": 160, "n_group": 8, "topk_group": 3, "topk_method": "group_limited_greedy",
      "routed_scaling_factor": 16.0}
"""deepseek-ai/DeepSeek-V2's config.json: 8 expert groups, the best 3 kept."""


def test_deepseek_v2_lite_parses_with_its_router_and_size():
    """V2-Lite: softmax scores, no renormalisation, no bias, no groups, scaling 1.0 (None: Megatron's
    no-op); 15.7B parameters, as published."""
    dims = HFModelDims.from_hf_config(V2_LITE)
    assert (dims.family, dims.score_function, dims.norm_topk_prob, dims.expert_bias) == \
        ("deepseek_v2", "softmax", False, False)
    assert (dims.n_group, dims.topk_group, dims.routed_scaling_factor, dims.mtp_layers) == (1, 1, None, 0)
    assert dims.mla is not None and dims.mla.q_lora_rank is None and dims.shared_ffn_size == 2 * 1408
    assert dict(dims.yarn or ())["mscale_all_dim"] == 0.707
    assert round(dims.num_params() / 1e9, 1) == 15.7
    assert aux_loss_coef_of(V2_LITE, None) == 0.0 and aux_loss_coef_of(V2_LITE, 0.01) == 0.01


@pytest.mark.parametrize("groups", [dict(n_group=1, topk_group=1), dict(n_group=4, topk_group=4)],
                         ids=["one-group", "every-group-kept"])
def test_group_limited_greedy_that_drops_no_group_is_greedy(groups):
    """With one group, or every group kept, V2's group_limited_greedy drops no expert: greedy."""
    cfg = {**deepseek_v2_config(), "topk_method": "group_limited_greedy", **groups}
    assert HFModelDims.from_hf_config(cfg) == HFModelDims.from_hf_config(deepseek_v2_config())


@pytest.mark.parametrize("changes, match", [
    (dict(V2), r"config.json topk_method='group_limited_greedy': with n_group=8, topk_group=3: DeepSeek-V2 "
               r"keeps the groups whose best expert"),
    ({"n_group": 4, "topk_group": 2, "topk_method": "group_limited_greedy"},
     r"topk_method='group_limited_greedy': with n_group=4, topk_group=2: .* only 'greedy'"),
    ({"topk_method": "group_limited_greedy", "n_group": None},
     r"config.json n_group=None: topk_method 'group_limited_greedy' needs n_group"),
    ({"topk_method": "noaux_tc"}, r"config.json topk_method='noaux_tc': deepseek_v2 supports 'greedy'"),
    ({"scoring_func": "sigmoid"}, r"config.json scoring_func='sigmoid': deepseek_v2 routes with softmax"),
    ({"norm_topk_prob": True}, r"config.json norm_topk_prob=True: .* never renormalises .* set it to false"),
    ({"moe_layer_freq": 2}, r"config.json moe_layer_freq=2"),
    ({"rope_scaling": {"type": "linear", "factor": 2.0}}, r"rope_scaling type='linear' is not supported for "
                                                           r"deepseek_v2"),
    # transformers and SGLang scale YaRN's attention differently here (an audit: log-probs 0.07-0.64 apart)
    ({"rope_scaling": {"type": "yarn", "factor": 40, "attention_factor": 1.2}},
     r"rope_scaling attention_factor=1.2 is not supported for yarn"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "mscale_all_dim": 0.707}},
     r"mscale=None, mscale_all_dim=0.707: give both .* or neither"),
    ({"rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707}}, r"mscale=0.707, mscale_all_dim=None"),
], ids=["deepseek-v2", "group-limited-4-of-2", "group-limited-without-groups", "noaux_tc", "sigmoid",
        "norm_topk_prob", "moe_layer_freq", "linear-rope", "yarn-attention-factor", "yarn-mscale-all-dim-only",
        "yarn-mscale-only"])
def test_what_megatron_cannot_compute_is_refused_naming_the_key(changes, match):
    cfg = {**deepseek_v2_config(), **changes} if "model_type" not in changes else changes
    with pytest.raises(ValueError, match=match):
        HFModelDims.from_hf_config(cfg)


@pytest.mark.parametrize("yarn", [{}, {"mscale": 1.0}, {"mscale": 0.707, "mscale_all_dim": 0.707}])
def test_yarn_scales_that_every_side_reads_alike_are_taken(yarn):
    cfg = {**deepseek_v2_config(), "rope_scaling": {"type": "yarn", "factor": 40, **yarn}}
    assert dict(HFModelDims.from_hf_config(cfg).yarn or ())["factor"] == 40


def test_rope_interleave_is_not_read():
    """transformers' DeepSeek-V2 always rotates complex pairs (DeepSeek's interleaved layout), whatever
    rope_interleave says, and so does the Megatron model: the key changes nothing."""
    cfg = deepseek_v2_config()
    assert HFModelDims.from_hf_config({**cfg, "rope_interleave": False}) == HFModelDims.from_hf_config(cfg)


def test_tensors_are_transformers_checkpoint_names_without_the_router_bias():
    """hf_shapes, moe.specs' spec and transformers' DeepseekV2ForCausalLM (under checkpoint names) hold
    the same tensors at the same shapes, V3's minus `mlp.gate.e_score_correction_bias`; a TP2/EP2
    Megatron split of them reassembles bit for bit."""
    cfg = deepseek_v2_config()
    dims = HFModelDims.from_hf_config(cfg)
    model = build_hf_model(cfg, seed=0)
    assert type(model).__name__ == "DeepseekV2ForCausalLM"
    hf = hf_fused_to_checkpoint(model.state_dict(), dims)
    shapes = dims.hf_shapes()
    assert {n: tuple(t.shape) for n, t in hf.items()} == shapes
    assert not any("e_score_correction_bias" in n for n in shapes)
    v3 = HFModelDims.from_hf_config({**cfg, "model_type": "deepseek_v3", "topk_method": "noaux_tc",
                                     "scoring_func": "sigmoid", "norm_topk_prob": True}).hf_shapes()
    assert set(v3) - set(shapes) == {f"model.layers.{i}.mlp.gate.e_score_correction_bias" for i in (1, 2)}
    spec = spec_from_config(cfg)
    assert spec.family == "deepseek_v2" and {t.name: t.shape for t in spec.tensors} == shapes
    coords = [RankCoords(tp_rank=t, tp=2, ep_rank=e, ep=2) for t in (0, 1) for e in (0, 1)]
    shards = {c: hf_to_megatron(hf, dims, c) for c in coords}
    assert all(set(shards[c]) == {p.name for p in local_params(dims, c)} for c in coords)
    back = megatron_to_hf([(c, shards[c]) for c in coords], dims)
    assert set(back) == set(hf) and all(torch.equal(back[n], hf[n]) for n in hf)
