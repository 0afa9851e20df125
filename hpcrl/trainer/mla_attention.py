"""Megatron-core's unfused core attention for multi-latent attention (MLA) without transformer-engine.

megatron-core 0.16.1 builds MLA's core attention with `k_channels` (the query/key head dim, nope +
rope) and `v_channels` (the value head dim), which only TE's attention accepts; the local
`DotProductAttention` takes neither and sizes its output as `kv_channels * heads`. Its forward
otherwise works for any key and value head dims (the matmuls reshape with -1), so this subclass
takes both arguments, keeps the softmax scale MLA computes (YaRN mscale included) and sizes the
output by the value head dim. `mla_layer_spec` puts it into a decoder block spec.

The local spec also makes MLA's down projections (q_a, kv_a) column-parallel: under TP each rank
computes a slice of [kv latent, k rope] and all-gathers it. Then the RoPE key, which every rank's
heads use, gets only this rank's heads' gradient: 0.16.1 reduces it nowhere (the TE spec's duplicated
linears take the other branch, which gathers it from the sequence-parallel region and reduce-scatters
its gradient). `mla_layer_spec` therefore builds the down projections as Megatron's duplicated
`Linear` (the whole weight on every TP rank, sequence-parallel gradients all-reduced over TP), as the
TE spec does: log-probs under TP2 were right either way, gradients only this way.
"""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide


class MLADotProductAttention(DotProductAttention):
    """DotProductAttention whose key and value head dims differ (MLA: k = nope + rope, v = v_head_dim)."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 k_channels: int | None = None, v_channels: int | None = None,
                 softmax_scale: float | None = None, **kwargs: Any) -> None:
        # Megatron's Attention base class first builds a core attention without the channel
        # arguments, which MLASelfAttention then replaces with one that has them.
        super().__init__(config, layer_number, attn_mask_type, attention_type, softmax_scale=softmax_scale,
                         **kwargs)
        if v_channels is not None:
            self.hidden_size_per_partition = divide(v_channels * config.num_attention_heads,
                                                    self.tp_group.size())


def mla_layer_spec(block_spec: Any) -> Any:
    """`block_spec` (Megatron's decoder block spec of an MLA model) with every layer's core
    attention replaced by `MLADotProductAttention` and its down projections by the duplicated
    `Linear`; returns the same object."""
    from megatron.core.post_training.modelopt.layers import Linear

    for layer in block_spec.layer_specs:
        attention = layer.submodules.self_attention.submodules
        attention.core_attention = MLADotProductAttention
        attention.linear_q_down_proj = attention.linear_kv_down_proj = Linear
    return block_spec
