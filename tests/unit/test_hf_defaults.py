"""A config.json that leaves keys out is read by the trainer and the specs as the engines read it.

SGLang and the reference engine build their models through transformers' config classes, which fill
a missing key with their own default (DeepseekV3Config: routed_scaling_factor 2.5, n_group 8, ...);
the trainer filled it with another one (1.0, 1, ...), and the two sides computed different models
without a word (log-probs 0.73 apart, an outside audit's run). moe.hf_megatron.HF_DEFAULTS is that
table; these tests pin it to the installed transformers and compare both readings key by key."""

from __future__ import annotations

import dataclasses

import pytest

from hf_fixtures import QWEN3_MOE
from hpcrl.models.presets import load_hf_config
from moe.hf_megatron import HF_DEFAULTS, HFModelDims, transformers_model_type
from moe.specs import spec_from_config


def transformers_class(family: str):
    import transformers

    return {"qwen3_moe": transformers.Qwen3MoeConfig, "mixtral": transformers.MixtralConfig,
            "deepseek_v3": transformers.DeepseekV3Config, "deepseek_v2": transformers.DeepseekV2Config}[family]


@pytest.mark.parametrize("family", sorted(HF_DEFAULTS))
def test_the_table_is_transformers_own(family: str) -> None:
    filled = transformers_class(family)().to_dict()
    assert {k: filled.get(k, "<absent>") for k in HF_DEFAULTS[family]} == HF_DEFAULTS[family]


def configs() -> dict[str, dict]:
    """One config per family, each key of HF_DEFAULTS set to something else than its default, but
    those whose only supported value is the default (DeepSeek's norm_topk_prob, rope_interleave and
    topk_method; Qwen's decoder_sparse_step and mlp_only_layers): they read the same either way."""
    deepseek = load_hf_config("tiny-deepseek-v3", None)  # routed_scaling_factor 2.5 is V3's default:
    deepseek = {**deepseek, "routed_scaling_factor": 1.5, "n_shared_experts": 2, "first_k_dense_replace": 2,
                "rms_norm_eps": 1e-5, "tie_word_embeddings": True}
    v2 = {k: v for k, v in deepseek.items() if k not in ("n_group", "topk_group", "topk_method", "scoring_func")}
    v2 |= {"model_type": "deepseek_v2", "norm_topk_prob": False, "q_lora_rank": None, "max_position_embeddings": 512,
           "n_shared_experts": 1}
    qwen = {**QWEN3_MOE, "max_position_embeddings": 512, "num_key_value_heads": 2, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True}
    mixtral = {k: v for k, v in qwen.items() if k not in ("decoder_sparse_step", "mlp_only_layers", "norm_topk_prob",
                                                          "num_experts", "moe_intermediate_size", "head_dim")}
    mixtral |= {"model_type": "mixtral", "num_local_experts": QWEN3_MOE["num_experts"], "rms_norm_eps": 1e-6,
                "intermediate_size": QWEN3_MOE["moe_intermediate_size"]}
    return {"qwen3_moe": qwen, "mixtral": mixtral, "deepseek_v3": deepseek, "deepseek_v2": v2}


def read(cfg: dict) -> tuple[dict, list[str]] | str:
    """HFModelDims' fields and the spec's tensor names of `cfg`, or the ValueError's text."""
    try:
        dims = HFModelDims.from_hf_config(cfg)
        names = [t.name for t in spec_from_config(cfg).tensors]
    except ValueError as exc:
        return f"ValueError: {exc}"
    assert sorted(names) == list(dims.hf_shapes()), "the spec and the trainer hold other tensors"
    return dataclasses.asdict(dims), names


@pytest.mark.parametrize(("family", "key"), [(f, k) for f in sorted(HF_DEFAULTS) for k in HF_DEFAULTS[f]])
def test_a_missing_key_reads_as_transformers_reads_it(family: str, key: str) -> None:
    """The trainer's and the specs' reading of the config without `key` equals their reading of the
    config transformers' class makes of it (what the engines build)."""
    cfg = configs()[family]
    trimmed = {k: v for k, v in cfg.items() if k != key}
    fields = {k: v for k, v in trimmed.items() if k != "model_type"}
    engines = transformers_class(family)(**fields).to_dict() | {"model_type": cfg["model_type"]}
    assert transformers_model_type(cfg["model_type"]) == engines["model_type"]
    assert read(trimmed) == read(engines)


def test_a_deepseek_v3_config_without_topk_method_keeps_the_router_bias() -> None:
    """transformers' DeepseekV3Config writes no topk_method; its router has the bias all the same,
    and so had the trainer, but the spec (the syncs' and the plan's tensor list) left it out."""
    cfg = {k: v for k, v in load_hf_config("tiny-deepseek-v3", None).items() if k != "topk_method"}
    names = [t.name for t in spec_from_config(cfg).tensors]
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    assert sorted(names) == list(HFModelDims.from_hf_config(cfg).hf_shapes())
