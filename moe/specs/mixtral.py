"""Mixtral specs (Mixtral-8x7B-v0.1 and a debug flavor) from config.json.

HF checkpoint names per layer i: `model.layers.{i}.input_layernorm`, `.self_attn.{q,k,v,o}_proj`,
`.post_attention_layernorm`, router `.block_sparse_moe.gate` [E, H] and experts
`.block_sparse_moe.experts.{e}.w1` (gate, [Ie, H]), `.w3` (up, [Ie, H]), `.w2` (down, [H, Ie]).
Every layer is sparse; Mixtral's expert FFN size is `intermediate_size`. Legend as in `_types`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.hf_megatron import with_hf_defaults
from moe.specs import _build as b
from moe.specs._types import (CONFIG_DIR, LazySpecs, ModelDims, MoESpec, TensorSpec, config_dtype,
                              load_config, require)

FAMILY = "mixtral"

DEBUG_CONFIG: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": 128,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e6, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "float32",
}


def spec_from_config(cfg: Mapping[str, Any], flavor: str = "custom") -> MoESpec:
    """Every tensor of a Mixtral checkpoint described by `cfg` (a config.json dict; keys it leaves out
    read as transformers reads them: moe.hf_megatron.with_hf_defaults)."""
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
    experts = int(require(cfg, "num_local_experts", FAMILY))
    ffn = int(require(cfg, "intermediate_size", FAMILY))
    tied = bool(cfg.get("tie_word_embeddings", False))

    out: list[TensorSpec] = []
    b.embedding(out, vocab, hidden, dtype)
    for i in range(layers):
        p = f"model.layers.{i}"
        b.norm(out, f"{p}.input_layernorm.weight", hidden, dtype, i)
        b.gqa_attention(out, f"{p}.self_attn", i, hidden, heads, kv_heads, head_dim, dtype, qk_norm=False,
                        bias=False)
        b.norm(out, f"{p}.post_attention_layernorm.weight", hidden, dtype, i)
        b.router(out, f"{p}.block_sparse_moe.gate.weight", experts, hidden, dtype, i)
        b.routed_experts(out, f"{p}.block_sparse_moe.experts", i, experts, hidden, ffn, dtype,
                         names=("w1", "w3", "w2"))
    b.head(out, vocab, hidden, dtype, tied)
    dims = ModelDims(num_layers=layers, hidden_size=hidden, vocab_size=vocab, num_heads=heads,
                     num_kv_heads=kv_heads, num_experts=experts, intermediate_size=0,
                     moe_intermediate_size=ffn, shared_intermediate_size=0, tie_word_embeddings=tied)
    return MoESpec(FAMILY, flavor, dims, tuple(out), cfg)


SPECS = LazySpecs({
    "debug": lambda: spec_from_config(DEBUG_CONFIG, "debug"),
    "8x7B": lambda: spec_from_config(load_config(CONFIG_DIR / "mixtral-8x7b-v0.1.json"), "8x7B"),
})
