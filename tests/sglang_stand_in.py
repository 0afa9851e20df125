"""A stand-in for an SGLang TP worker's Qwen3-MoE model, shared by the shard-loader tests.

`sglang_params` computes what SGLang 0.5.23's `load_weights` leaves on one TP rank from the full HF
tensors, following SGLang's own rules (QKVParallelLinear kv-head replicas, FusedMoE gate|up halves
and moe_tp narrowing, vocab padded to 64 with padding rows untouched), written independently of
moe.layouts; `stand_in_model` is an nn.Module with SGLang's parameter names at those shapes. Needs
only torch and hpcrl's presets (it also runs under the torch 2.14.1 side venv).
"""

from __future__ import annotations

import types

import torch

from hpcrl.models.presets import load_hf_config

GROUP = "hpcrl_reshard"
SENTINEL = -7.0  # what the stand-in's parameters hold before the sync (padding rows keep it)


def hf_config(vocab: int = 100) -> dict:
    return {**load_hf_config("tiny-qwen3-moe", None), "vocab_size": vocab}  # 100: padded shards


def full_tensors(spec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def sglang_params(full: dict[str, torch.Tensor], d, r: int, tp: int, ep: int) -> dict[str, torch.Tensor]:
    """What SGLang's load_weights leaves on TP rank r (qwen3_moe.py, linear.py, fused_moe layer.py)."""
    moe_tp, hd, out = tp // ep, d.hidden_size // d.num_heads, {}
    ep_rank, mr = r // moe_tp, r % moe_tp
    pad = 64 if (-(-d.vocab_size // 64) * 64) % tp == 0 else 64 * tp  # VocabParallelEmbedding's padding
    per = -(-d.vocab_size // pad) * pad // tp
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        t = torch.full((per, d.hidden_size), SENTINEL)
        rows = full[name][r * per:(r + 1) * per]
        t[:rows.shape[0]] = rows
        out[name] = t
    out["model.norm.weight"] = full["model.norm.weight"]
    qs, e_local, ie = d.num_heads * hd // tp, d.num_experts // ep, d.moe_intermediate_size // moe_tp
    for layer in range(d.num_layers):
        p = f"model.layers.{layer}"
        if tp >= d.num_kv_heads:  # QKVParallelLinear: kv heads replicated over tp / nkv ranks
            h = r // (tp // d.num_kv_heads)
            kv = slice(h * hd, (h + 1) * hd)
        else:
            kvs = d.num_kv_heads * hd // tp
            kv = slice(r * kvs, (r + 1) * kvs)
        a = f"{p}.self_attn"
        q = full[f"{a}.q_proj.weight"][r * qs:(r + 1) * qs]
        k, v = full[f"{a}.k_proj.weight"][kv], full[f"{a}.v_proj.weight"][kv]
        out[f"{a}.qkv_proj.weight"] = torch.cat([q, k, v])
        out[f"{a}.o_proj.weight"] = full[f"{a}.o_proj.weight"][:, r * qs:(r + 1) * qs]
        for n in (f"{a}.q_norm.weight", f"{a}.k_norm.weight", f"{p}.input_layernorm.weight",
                  f"{p}.post_attention_layernorm.weight", f"{p}.mlp.gate.weight"):
            out[n] = full[n]
        x = f"{p}.mlp.experts"
        w13, w2 = [], []
        for e in range(ep_rank * e_local, (ep_rank + 1) * e_local):
            cut = slice(mr * ie, (mr + 1) * ie)
            gate, up = full[f"{x}.{e}.gate_proj.weight"][cut], full[f"{x}.{e}.up_proj.weight"][cut]
            w13.append(torch.cat([gate, up]))
            w2.append(full[f"{x}.{e}.down_proj.weight"][:, cut])
        out[f"{x}.w13_weight"], out[f"{x}.w2_weight"] = torch.stack(w13), torch.stack(w2)
    return out


def stand_in_model(cfg: dict, shapes: dict[str, torch.Size]) -> torch.nn.Module:
    """An nn.Module whose named_parameters() are SGLang's names at `shapes`, filled with SENTINEL."""
    root = torch.nn.Module()
    for name, shape in shapes.items():
        *path, leaf = name.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(torch.full(shape, SENTINEL), requires_grad=False))
    root.config = types.SimpleNamespace(to_dict=lambda: dict(cfg), vocab_size=cfg["vocab_size"])
    return root
