"""The reference engine's decoding forward for Qwen3-MoE, written directly in torch ops.

A decode step through transformers' `Qwen3MoeForCausalLM.__call__` passes through about twenty
wrappers per layer (module hooks, `deprecate_kwarg`, `capture_outputs`, config look-ups, output
dataclasses, the attention and experts dispatch) and HF's general MoE path (a sort, a histogram, an
inverse permutation, a scatter back): ~900 aten calls per forward of the tiny model on one thread,
where the arithmetic needs a few hundred. `DirectForward` computes the same model from the same
parameter tensors (read at every call, so pushed weights are used at once) in the ops the math needs:
RMSNorm, q/k norms and RoPE as in HF, attention by `F.scaled_dot_product_attention` with GQA, the
router's softmax / top-k / renormalisation, the experts as two `F.grouped_mm` over the tokens sorted
by expert, and an `index_add_` back. The tiny example's generate call is ~1.35x faster than through
HF (benchmarks/engine_forward.py); the logits agree with HF's to ~2e-7 in fp32 (the sums run in
another order), and HF's dtype rules are kept in bf16 (norms and router softmax in fp32).
tests/unit/test_direct_forward.py compares them, padded and not, dense and MoE layers, GQA or not.

With left padding, a query at a padding position sees no key at all; torch's SDPA gives such a row
zeros, not NaN, and no real token ever sees a padding key. Models it does not describe keep
transformers' forward: `DirectForward.refusal` says why. `on_route`, when set, is called with each MoE
layer's index and the experts its top-k chose ([B * T, top_k], in descending probability), the routes
the engine returns (engine.py, "Routed experts"). With `fp32_lm_head` the LM head runs in float32 on
the final norm's output (`lm_head_logits`), as SGLang's --enable-fp32-lm-head does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


class DirectForward:
    """`model(input_ids, attention_mask, position_ids, cache, use_cache=True, logits_to_keep=1).logits`
    of a transformers `Qwen3MoeForCausalLM` in inference, in torch ops."""

    def __init__(self, model: Any, fp32_lm_head: bool = False) -> None:
        reason = self.refusal(model)
        if reason:
            raise ValueError(f"DirectForward cannot run this model: {reason}")
        self.model = model
        c = model.config
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.top_k, self.norm_top_k, self.eps = c.num_experts_per_tok, c.norm_topk_prob, c.rms_norm_eps
        self.fp32_lm_head = fp32_lm_head
        self.on_route: Callable[[int, torch.Tensor], None] | None = None

    @staticmethod
    def refusal(model: Any) -> str | None:
        """Why `DirectForward` does not describe `model` (then the engine keeps its HF forward), or None."""
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        if type(model) is not modeling_qwen3_moe.Qwen3MoeForCausalLM:
            return f"{type(model).__name__} is not Qwen3MoeForCausalLM"
        c = model.config
        if c.sliding_window is not None:
            return "a sliding-window mask"
        if model.model.rotary_emb.rope_type != "default":
            return f"rope_type {model.model.rotary_emb.rope_type!r} (only 'default' is written here)"
        if c.hidden_act != "silu":
            return f"hidden_act {c.hidden_act!r} (the experts here are SwiGLU)"
        if model.training:
            return "the model is in training mode"
        return None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The last position's logits, [B, 1, V]; `cache` (a DynamicCache) takes this step's keys
        and values. `attention_mask` is the [B, past + new] padding mask, or None without padding."""
        hidden = self.hidden(input_ids, attention_mask, position_ids, cache)
        return lm_head_logits(hidden, self.model.lm_head.weight, self.fp32_lm_head)

    def hidden(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
               position_ids: torch.Tensor, cache: Any, every_position: bool = False) -> torch.Tensor:
        """The last position's final-norm output, [B, 1, H] in the model's dtype: what the LM head
        reads (`__call__`'s arguments); every position's, [B, T, H], with `every_position` (the
        input-token log-probs, engine_score.py)."""
        inner = self.model.model
        B, T = input_ids.shape
        h = F.embedding(input_ids, inner.embed_tokens.weight)
        freqs = position_ids[..., None].float() * inner.rotary_emb.inv_freq
        angles = torch.cat((freqs, freqs), -1)[:, None]  # [B, 1, T, head_dim]
        cos, sin = angles.cos().to(h.dtype), angles.sin().to(h.dtype)
        mask = None if attention_mask is None else self._mask(attention_mask, T)
        for i, layer in enumerate(inner.layers):
            h = h + self._attention(layer.self_attn, self._norm(h, layer.input_layernorm), cos, sin, mask,
                                    cache, i)
            x = self._norm(h, layer.post_attention_layernorm)
            h = h + (self._moe(layer.mlp, x.view(B * T, -1), i).view(B, T, -1)
                     if hasattr(layer.mlp, "experts") else self._dense(layer.mlp, x))
        return self._norm(h if every_position else h[:, -1:], inner.norm)

    def _norm(self, x: torch.Tensor, norm: Any) -> torch.Tensor:
        """HF's Qwen3MoeRMSNorm: in fp32, then back to x's dtype, times the weight."""
        x32 = x.float()
        return norm.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    @staticmethod
    def _mask(attention_mask: torch.Tensor, new: int) -> torch.Tensor:
        """[B, 1, new, past + new] bool: the causal padding mask."""
        keys = attention_mask.shape[1]
        key_pos = torch.arange(keys, device=attention_mask.device)
        return ((key_pos <= key_pos[keys - new:, None]) & attention_mask.bool()[:, None, :])[:, None]

    def _attention(self, attn: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   mask: torch.Tensor | None, cache: Any, index: int) -> torch.Tensor:
        B, T, _ = x.shape
        q = self._norm(_linear(attn.q_proj, x).view(B, T, self.heads, self.head_dim), attn.q_norm)
        k = self._norm(_linear(attn.k_proj, x).view(B, T, self.kv_heads, self.head_dim), attn.k_norm)
        v = _linear(attn.v_proj, x).view(B, T, self.kv_heads, self.head_dim)
        k, v = cache.update(_rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2), index)
        out = F.scaled_dot_product_attention(_rope(q.transpose(1, 2), cos, sin), k, v, attn_mask=mask,
                                             scale=attn.scaling,
                                             is_causal=mask is None and T > 1,
                                             enable_gqa=self.heads != self.kv_heads)
        return _linear(attn.o_proj, out.transpose(1, 2).reshape(B, T, -1))

    def _moe(self, block: Any, x: torch.Tensor, index: int) -> torch.Tensor:
        """Top-k routing (softmax in fp32, optionally renormalised), then the tokens sorted by expert
        through two grouped GEMMs and added back, weighted, to their rows."""
        experts = block.experts
        probs = torch.softmax(F.linear(x, block.gate.weight), -1, dtype=torch.float32)
        weights, chosen = probs.topk(self.top_k, -1)
        if self.on_route is not None:
            self.on_route(index, chosen)
        if self.norm_top_k:
            weights = weights / weights.sum(-1, keepdim=True)
        flat = chosen.view(-1)
        order = flat.argsort(stable=True)
        ends = torch.bincount(flat, minlength=experts.num_experts).cumsum(0).to(torch.int32)
        rows = order // self.top_k
        gate, up = _grouped_mm(x[rows], experts.gate_up_proj.transpose(-2, -1), ends).chunk(2, -1)
        y = _grouped_mm(F.silu(gate) * up, experts.down_proj.transpose(-2, -1), ends)
        y = y * weights.view(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, rows, y)

    @staticmethod
    def _dense(mlp: Any, x: torch.Tensor) -> torch.Tensor:
        return _linear(mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x))


def lm_head_logits(hidden: torch.Tensor, weight: torch.Tensor, fp32: bool) -> torch.Tensor:
    """The LM head: `hidden @ weight.T` in the model's dtype, or with `fp32` in float32 from the same
    (bf16) hidden states and weight, SGLang's `_compute_lm_head` with use_fp32_lm_head
    (layers/logits_processor.py: hidden.to(fp32) @ weight.to(fp32).T; on CUDA a bf16 mm with an fp32
    output, the same products, each exact in fp32)."""
    if fp32:
        return F.linear(hidden.float(), weight.float())
    return F.linear(hidden, weight)


def _grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Rows [ends[e-1], ends[e]) of `x` times `w[e]`: `F.grouped_mm`, except on CUDA outside bf16,
    where torch's kernel refused float32 ("Invalid strides/sizes", torch 2.11 on an H200, dev/LOG.md):
    there one matmul per expert, the same products."""
    if x.is_cuda and x.dtype != torch.bfloat16:
        return per_expert_mm(x, w, ends)
    return F.grouped_mm(x, w, offs=ends)


def per_expert_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """`_grouped_mm` as one matmul per expert (an expert without rows gives none)."""
    bounds = ends.tolist()
    return torch.cat([x[s:e] @ w[i] for i, (s, e) in enumerate(zip([0, *bounds[:-1]], bounds))])


def _linear(layer: Any, x: torch.Tensor) -> torch.Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's apply_rotary_pos_emb for one tensor: x * cos + rotate_half(x) * sin."""
    first, second = x.chunk(2, -1)
    return x * cos + torch.cat((-second, first), -1) * sin
