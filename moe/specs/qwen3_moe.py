"""Qwen3-MoE specs (Qwen3-30B-A3B, Qwen3-235B-A22B, the tiny debug preset) from config.json.

HF checkpoint names per layer i: `model.layers.{i}.input_layernorm`, `.self_attn.{q,k,v,o}_proj`,
`.self_attn.{q,k}_norm`, `.post_attention_layernorm`; sparse layers have `.mlp.gate` [E, H] and
`.mlp.experts.{e}.{gate,up,down}_proj`; layers in `mlp_only_layers` (or off the
`decoder_sparse_step` grid) have a dense `.mlp.{gate,up,down}_proj` of `intermediate_size`.
Shape legend as in `moe.specs._types`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.hf_megatron import with_hf_defaults
from moe.specs import _build as b
from moe.specs._types import (CONFIG_DIR, HPCRL_CONFIG_DIR, LazySpecs, ModelDims, MoESpec, TensorKind,
                              TensorSpec, config_dtype, load_config, require)

FAMILY = "qwen3_moe"


def num_experts(cfg: Mapping[str, Any]) -> int:
    """The expert count: `num_experts` in hub config.json files, `num_local_experts` in the ones
    transformers 5.x writes; 0 when neither is there."""
    return int(cfg.get("num_experts", cfg.get("num_local_experts", 0)) or 0)


def is_sparse_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    """HF Qwen3-MoE rule: an MoE block unless listed in mlp_only_layers or off the sparse step."""
    step = int(cfg.get("decoder_sparse_step", 1))
    return (layer not in cfg.get("mlp_only_layers", []) and num_experts(cfg) > 0
            and (layer + 1) % step == 0)


def spec_from_config(cfg: Mapping[str, Any], flavor: str = "custom") -> MoESpec:
    """Every tensor of a Qwen3-MoE checkpoint described by `cfg` (a config.json dict; keys it leaves
    out read as transformers reads them: moe.hf_megatron.with_hf_defaults)."""
    cfg = with_hf_defaults(cfg)
    if cfg.get("model_type") != FAMILY:
        raise ValueError(f"config.json model_type={cfg.get('model_type')!r}; expected {FAMILY!r}")
    dtype = config_dtype(cfg)
    layers = int(require(cfg, "num_hidden_layers", FAMILY))
    hidden = int(require(cfg, "hidden_size", FAMILY))
    vocab = int(require(cfg, "vocab_size", FAMILY))
    heads = int(require(cfg, "num_attention_heads", FAMILY))
    kv_heads = int(cfg.get("num_key_value_heads") or heads)
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    experts = num_experts(cfg) or int(require(cfg, "num_experts", FAMILY))
    moe_ffn = int(require(cfg, "moe_intermediate_size", FAMILY))
    ffn = int(cfg.get("intermediate_size") or 0)
    tied = bool(cfg.get("tie_word_embeddings", False))
    bias = bool(cfg.get("attention_bias", False))

    out: list[TensorSpec] = []
    b.embedding(out, vocab, hidden, dtype)
    any_dense = False
    for i in range(layers):
        p = f"model.layers.{i}"
        b.norm(out, f"{p}.input_layernorm.weight", hidden, dtype, i)
        b.gqa_attention(out, f"{p}.self_attn", i, hidden, heads, kv_heads, head_dim, dtype, qk_norm=True,
                        bias=bias)
        b.norm(out, f"{p}.post_attention_layernorm.weight", hidden, dtype, i)
        if is_sparse_layer(cfg, i):
            b.router(out, f"{p}.mlp.gate.weight", experts, hidden, dtype, i)
            b.routed_experts(out, f"{p}.mlp.experts", i, experts, hidden, moe_ffn, dtype)
        else:
            if ffn <= 0:
                raise ValueError(f"qwen3_moe layer {i} is dense but config.json intermediate_size={ffn}")
            any_dense = True
            b.glu_ffn(out, f"{p}.mlp", i, hidden, ffn, dtype, TensorKind.DENSE, b.R.MLP_COL, b.R.MLP_ROW)
    b.head(out, vocab, hidden, dtype, tied)
    dims = ModelDims(num_layers=layers, hidden_size=hidden, vocab_size=vocab, num_heads=heads,
                     num_kv_heads=kv_heads, num_experts=experts,
                     intermediate_size=ffn if any_dense else 0, moe_intermediate_size=moe_ffn,
                     shared_intermediate_size=0, tie_word_embeddings=tied)
    return MoESpec(FAMILY, flavor, dims, tuple(out), cfg)


SPECS = LazySpecs({
    "debug": lambda: spec_from_config(load_config(HPCRL_CONFIG_DIR / "tiny-qwen3-moe.json"), "debug"),
    "30B-A3B": lambda: spec_from_config(load_config(CONFIG_DIR / "qwen3-30b-a3b.json"), "30B-A3B"),
    "235B-A22B": lambda: spec_from_config(load_config(CONFIG_DIR / "qwen3-235b-a22b.json"), "235B-A22B"),
})
