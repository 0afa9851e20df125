"""DeepSeek-V3 specs (671B and a debug flavor) from config.json: MLA attention, shared experts,
first-k dense layers, the noaux_tc score-correction bias, and optional MTP layers.

HF checkpoint names per layer i (prefix `model.layers.{i}`):
  attention  `.self_attn.q_a_proj` [Rq, H], `.q_a_layernorm` [Rq], `.q_b_proj` [nq*(dn+dr), Rq]
             (or `.q_proj` [nq*(dn+dr), H] when q_lora_rank is null), `.kv_a_proj_with_mqa`
             [Rkv+dr, H], `.kv_a_layernorm` [Rkv], `.kv_b_proj` [nq*(dn+dv), Rkv], `.o_proj` [H, nq*dv]
  dense FFN  (i < first_k_dense_replace) `.mlp.{gate,up,down}_proj` of intermediate_size
  MoE        `.mlp.gate` [E, H], `.mlp.gate.e_score_correction_bias` [E] (float32),
             `.mlp.experts.{e}.{gate,up,down}_proj` of Ie, `.mlp.shared_experts.{gate,up,down}_proj`
             of Ie * n_shared_experts.
MTP (`mtp=True`, num_nextn_predict_layers layers after the last decoder layer): a full decoder
layer plus `enorm`, `hnorm` [H], `eh_proj` [H, 2H] and `shared_head.norm` [H]. The checkpoint's
MTP copies of embed_tokens and shared_head.head share the main model's parameters and are left
out. The 671B published total excludes MTP. FP8 block scales (`weight_scale_inv`) of the released
checkpoint are not tensors of the bf16 model that RL trains and moves, so they are not listed.
Shape legend as in `moe.specs._types`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.hf_megatron import family_of, with_hf_defaults
from moe.specs import _build as b
from moe.specs._types import (CONFIG_DIR, LazySpecs, ModelDims, MoESpec, Role, TensorKind, TensorSpec,
                              config_dtype, load_config, require)

FAMILY = "deepseek_v3"
BUILT_FAMILIES = (FAMILY, "deepseek_v2")
"""Families whose checkpoints this module describes: DeepSeek-V2 stores V3's tensors without the
score-correction bias (its topk_method is not noaux_tc) and without MTP layers."""
K, R = TensorKind, Role

DEBUG_CONFIG: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 128,
    "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 3,
    "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "n_group": 2, "topk_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
    "v_head_dim": 16, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "norm_topk_prob": True,
    "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 1, "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
}


def is_sparse_layer(cfg: Mapping[str, Any], layer: int) -> bool:
    """HF DeepSeek-V3 rule: MoE from first_k_dense_replace on, every moe_layer_freq-th layer."""
    return (cfg.get("n_routed_experts") is not None and layer >= int(cfg.get("first_k_dense_replace", 0))
            and layer % int(cfg.get("moe_layer_freq", 1)) == 0)


def _mla(out: list[TensorSpec], p: str, i: int, cfg: Mapping[str, Any], hidden: int, dtype: str) -> None:
    heads = int(require(cfg, "num_attention_heads", FAMILY))
    dn, dr = int(require(cfg, "qk_nope_head_dim", FAMILY)), int(require(cfg, "qk_rope_head_dim", FAMILY))
    dv, rkv = int(require(cfg, "v_head_dim", FAMILY)), int(require(cfg, "kv_lora_rank", FAMILY))
    rq = cfg.get("q_lora_rank")
    if rq is None:
        out.append(TensorSpec(f"{p}.q_proj.weight", (heads * (dn + dr), hidden), dtype, K.DENSE, R.ATTN_COL, i))
    else:
        rq = int(rq)
        out.append(TensorSpec(f"{p}.q_a_proj.weight", (rq, hidden), dtype, K.DENSE, R.REPLICATED, i))
        b.norm(out, f"{p}.q_a_layernorm.weight", rq, dtype, i)
        out.append(TensorSpec(f"{p}.q_b_proj.weight", (heads * (dn + dr), rq), dtype, K.DENSE, R.ATTN_COL, i))
    out.append(TensorSpec(f"{p}.kv_a_proj_with_mqa.weight", (rkv + dr, hidden), dtype, K.DENSE,
                          R.REPLICATED, i))
    b.norm(out, f"{p}.kv_a_layernorm.weight", rkv, dtype, i)
    out.append(TensorSpec(f"{p}.kv_b_proj.weight", (heads * (dn + dv), rkv), dtype, K.DENSE, R.ATTN_COL, i))
    out.append(TensorSpec(f"{p}.o_proj.weight", (hidden, heads * dv), dtype, K.DENSE, R.ATTN_ROW, i))


def _decoder_layer(out: list[TensorSpec], i: int, cfg: Mapping[str, Any], hidden: int, dtype: str) -> bool:
    """Append layer i; return True if its FFN is dense."""
    p = f"model.layers.{i}"
    b.norm(out, f"{p}.input_layernorm.weight", hidden, dtype, i)
    _mla(out, f"{p}.self_attn", i, cfg, hidden, dtype)
    b.norm(out, f"{p}.post_attention_layernorm.weight", hidden, dtype, i)
    if not is_sparse_layer(cfg, i):
        ffn = int(require(cfg, "intermediate_size", FAMILY))
        b.glu_ffn(out, f"{p}.mlp", i, hidden, ffn, dtype, K.DENSE, R.MLP_COL, R.MLP_ROW)
        return True
    experts = int(cfg["n_routed_experts"])
    moe_ffn = int(require(cfg, "moe_intermediate_size", FAMILY))
    b.router(out, f"{p}.mlp.gate.weight", experts, hidden, dtype, i)
    if family_of(cfg.get("model_type")) == "deepseek_v3":  # its router always has the bias (HFModelDims)
        out.append(TensorSpec(f"{p}.mlp.gate.e_score_correction_bias", (experts,), "float32", K.ROUTER,
                              R.ROUTER, i))
    b.routed_experts(out, f"{p}.mlp.experts", i, experts, hidden, moe_ffn, dtype)
    shared = int(cfg.get("n_shared_experts") or 0)
    if shared:
        b.glu_ffn(out, f"{p}.mlp.shared_experts", i, hidden, moe_ffn * shared, dtype, K.SHARED_EXPERT,
                  R.SHARED_COL, R.SHARED_ROW)
    return False


def spec_from_config(cfg: Mapping[str, Any], flavor: str = "custom", mtp: bool = False) -> MoESpec:
    """Every tensor of a DeepSeek-V3 (or Kimi-K2, or DeepSeek-V2) checkpoint described by `cfg`; `mtp` adds
    the MTP layers. The spec's family is the config's (deepseek_v2 for a V2). Keys `cfg` leaves out
    are read as transformers reads them (moe.hf_megatron.with_hf_defaults)."""
    cfg = with_hf_defaults(cfg)
    family = family_of(cfg.get("model_type"))
    if family not in BUILT_FAMILIES:
        raise ValueError(f"config.json model_type={cfg.get('model_type')!r}; expected one of {BUILT_FAMILIES}")
    dtype = config_dtype(cfg)
    layers = int(require(cfg, "num_hidden_layers", FAMILY))
    hidden = int(require(cfg, "hidden_size", FAMILY))
    vocab = int(require(cfg, "vocab_size", FAMILY))
    heads = int(require(cfg, "num_attention_heads", FAMILY))
    tied = bool(cfg.get("tie_word_embeddings", False))
    num_mtp = int(cfg.get("num_nextn_predict_layers") or 0) if mtp else 0

    out: list[TensorSpec] = []
    b.embedding(out, vocab, hidden, dtype)
    any_dense = False
    for i in range(layers):
        any_dense |= _decoder_layer(out, i, cfg, hidden, dtype)
    for i in range(layers, layers + num_mtp):
        p = f"model.layers.{i}"
        b.norm(out, f"{p}.enorm.weight", hidden, dtype, i)
        b.norm(out, f"{p}.hnorm.weight", hidden, dtype, i)
        out.append(TensorSpec(f"{p}.eh_proj.weight", (hidden, 2 * hidden), dtype, K.DENSE, R.REPLICATED, i))
        any_dense |= _decoder_layer(out, i, cfg, hidden, dtype)
        b.norm(out, f"{p}.shared_head.norm.weight", hidden, dtype, i)
    b.head(out, vocab, hidden, dtype, tied)
    moe_ffn = int(cfg.get("moe_intermediate_size") or 0)
    dims = ModelDims(num_layers=layers, hidden_size=hidden, vocab_size=vocab, num_heads=heads,
                     num_kv_heads=heads, num_experts=int(cfg.get("n_routed_experts") or 0),
                     intermediate_size=int(cfg["intermediate_size"]) if any_dense else 0,
                     moe_intermediate_size=moe_ffn,
                     shared_intermediate_size=moe_ffn * int(cfg.get("n_shared_experts") or 0),
                     tie_word_embeddings=tied, num_mtp_layers=num_mtp)
    return MoESpec(family, flavor, dims, tuple(out), cfg)


SPECS = LazySpecs({
    "debug": lambda: spec_from_config(DEBUG_CONFIG, "debug"),
    "debug-mtp": lambda: spec_from_config(DEBUG_CONFIG, "debug-mtp", mtp=True),
    "671B": lambda: spec_from_config(load_config(CONFIG_DIR / "deepseek-v3.json"), "671B"),
    "671B-mtp": lambda: spec_from_config(load_config(CONFIG_DIR / "deepseek-v3.json"), "671B-mtp", mtp=True),
})
