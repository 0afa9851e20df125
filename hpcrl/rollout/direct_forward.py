"""The reference engine's decoding forward for Qwen3-MoE: transformers' own layers and kernels, called
directly, so that the logits are HF's bit for bit in a fraction of the Python around them.

A step of the decode loop through `Qwen3MoeForCausalLM.__call__` passes through about twenty
wrappers per layer (module hooks, `deprecate_kwarg`, `capture_outputs`, config look-ups, the output
dataclasses, the attention-interface dispatch): ~1,100 aten calls and ~3.5 ms per forward of the tiny
model on one thread, where the arithmetic is a few hundred ops. `DirectForward` walks the same
modules in HF's order (`Qwen3MoeModel.forward`, `Qwen3MoeDecoderLayer.forward`,
`Qwen3MoeAttention.forward`) and calls their `forward`s and HF's functions (`apply_rotary_pos_emb`,
the configured attention function, `create_causal_mask`, the `DynamicCache`), so every kernel sees
the same tensors: tests/unit/test_direct_forward.py checks the logits with `torch.equal`, padded and
not, fp32 and bf16. ~2.5 ms less per generate call of the tiny example (4 forwards).

Models it does not describe (other architectures, a sliding window) keep transformers' forward:
`DirectForward.refusal` says why.
"""

from __future__ import annotations

from typing import Any

import torch


class DirectForward:
    """`model(input_ids, attention_mask, position_ids, cache, use_cache=True, logits_to_keep=1).logits`
    of a transformers `Qwen3MoeForCausalLM` in inference, through its modules' own forwards."""

    def __init__(self, model: Any) -> None:
        from transformers.masking_utils import create_causal_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        reason = self.refusal(model)
        if reason:
            raise ValueError(f"DirectForward cannot run this model: {reason}")
        self.model = model
        self._mask = create_causal_mask
        self._rope = modeling_qwen3_moe.apply_rotary_pos_emb
        self._attend = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation,
                                                             modeling_qwen3_moe.eager_attention_forward)

    @staticmethod
    def refusal(model: Any) -> str | None:
        """Why `DirectForward` does not describe `model` (then the engine keeps its HF forward), or None."""
        from transformers.models.qwen3_moe import modeling_qwen3_moe

        if type(model) is not modeling_qwen3_moe.Qwen3MoeForCausalLM:
            return f"{type(model).__name__} is not Qwen3MoeForCausalLM"
        if model.config.sliding_window is not None:
            return "a sliding-window mask"
        if model.training:
            return "the model is in training mode"
        return None

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
        """The last position's logits, [B, 1, V]; `cache` (a DynamicCache) takes this step's keys
        and values. `attention_mask` is the [B, past + new] padding mask, or None without padding."""
        inner = self.model.model
        h = inner.embed_tokens.forward(input_ids)
        mask = None if attention_mask is None else self._mask(
            config=self.model.config, inputs_embeds=h, attention_mask=attention_mask, cache=cache,
            position_ids=position_ids)
        cos, sin = inner.rotary_emb(h, position_ids)
        for layer in inner.layers:
            h = h + self._attention(layer.self_attn, layer.input_layernorm.forward(h), mask, cos, sin, cache)
            h = h + layer.mlp.forward(layer.post_attention_layernorm.forward(h))
        return self.model.lm_head.forward(inner.norm.forward(h)[:, -1:, :])

    def _attention(self, attn: Any, x: torch.Tensor, mask: torch.Tensor | None, cos: torch.Tensor,
                   sin: torch.Tensor, cache: Any) -> torch.Tensor:
        heads_shape = (*x.shape[:-1], -1, attn.head_dim)
        q = attn.q_norm.forward(attn.q_proj.forward(x).view(heads_shape)).transpose(1, 2)
        k = attn.k_norm.forward(attn.k_proj.forward(x).view(heads_shape)).transpose(1, 2)
        v = attn.v_proj.forward(x).view(heads_shape).transpose(1, 2)
        q, k = self._rope(q, k, cos, sin)
        k, v = cache.update(k, v, attn.layer_idx)
        out, _ = self._attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                              sliding_window=attn.sliding_window)
        return attn.o_proj.forward(out.reshape(*x.shape[:-1], -1).contiguous())
