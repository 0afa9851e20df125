"""Tolerances for comparing two evaluations of the same arithmetic in another summation order (other
kernels, TP/EP/PP splits, micro-batches, thread counts, CPU kinds: AVX2 and AVX-512 pick other
vector widths), derived from the arithmetic instead of read off one machine's output.

A sum of n terms in floating point with unit roundoff u is off by at most gamma_n * sum|terms|, with
gamma_n = n * u / (1 - n * u) ~ n * u (Higham, "Accuracy and Stability of Numerical Algorithms",
sec. 3.1); two orders of the same sum differ by at most twice that. A quantity at the end of a chain
of `depth` such reductions, each passing its error on with a gain of at most 1 (normalised layers;
optimizer updates that are Lipschitz in the gradient), is off by at most 2 * n * u * depth * magnitude
to first order, where n is the longest reduction and `magnitude` stands for sum|terms| (the largest
value the quantity takes). Worst-case bounds are far above what rounding does in practice (which
grows like sqrt(n)), so they hold on every CPU kind; each test that uses one states its n, depth and
magnitude, and shows that a real error (a swapped expert, a wrong slice, a missing norm) exceeds it.
"""

from __future__ import annotations

import torch

U_FP32 = 2.0 ** -24
"""Unit roundoff of float32 (round to nearest, 24-bit significand)."""
U_BF16 = 2.0 ** -8
"""Unit roundoff of bfloat16 (8-bit significand)."""


def reordered(n: int, depth: int, magnitude: float, u: float = U_FP32) -> float:
    """First-order bound on |a - b| for a and b the same quantity computed through `depth` reductions
    of at most `n` terms each, in two summation orders, with sum|terms| ~ `magnitude`."""
    return 2 * n * u * depth * magnitude


MLA_LAYER_DEPTH = 10
"""Reductions per layer with multi-latent attention (DeepSeek-V3): q down, q up, kv down, kv up,
q.k, attention.v, o_proj, router, expert up, expert down (the shared expert runs beside the routed
ones, the dense layers' MLP in their place)."""


def forward_depth(num_layers: int, per_layer: int = 7) -> int:
    """How many reductions a logit of a MoE transformer ends: per layer q/k/v, q.k, attention.v,
    o_proj, router, expert up, expert down (7; MLA_LAYER_DEPTH with MLA), then lm_head."""
    return 1 + per_layer * num_layers


def layer_depth(hf_config: dict) -> int:
    """forward_depth's reductions per layer for this HF config."""
    return MLA_LAYER_DEPTH if "kv_lora_rank" in hf_config else 7


def router_depth(layer: int, per_layer: int = 7) -> int:
    """How many reductions a router logit of `layer` (0-based) ends: `per_layer` per earlier layer,
    then the layer's attention (per_layer - 3: all but router and expert up/down), the router's own and
    its softmax."""
    return per_layer * layer + per_layer - 1


def longest_reduction(hf_config: dict, keys: int) -> int:
    """n of a forward of this HF config over `keys` positions: the longest of hidden, heads * head_dim,
    the (expert) ffn sizes and the attention's key count (the vocab's log-sum-exp is logprob_bound's)."""
    heads = hf_config["num_attention_heads"]
    head_dim = hf_config.get("head_dim") or hf_config["hidden_size"] // heads
    mla = [hf_config.get(k) or 0 for k in ("q_lora_rank", "kv_lora_rank")]
    if "kv_lora_rank" in hf_config:  # MLA: per head nope + rope in q.k, v_head_dim in o_proj
        head_dim = max(hf_config["qk_nope_head_dim"] + hf_config["qk_rope_head_dim"], hf_config["v_head_dim"])
    return max(hf_config["hidden_size"], heads * head_dim, hf_config.get("moe_intermediate_size", 0),
               hf_config["intermediate_size"], keys, *mla)


def logit_bound(hf_config: dict, max_logit: float, keys: int) -> float:
    """|a - b| for two evaluations of a MoE transformer's logits in other summation orders (kernels,
    batch shapes, padding, KV cache, TP/EP splits) that route every token alike: reordered with n =
    longest_reduction, depth = forward_depth, magnitude = max|logit| (the weights' scale is in it)."""
    return reordered(longest_reduction(hf_config, keys),
                     forward_depth(hf_config["num_hidden_layers"], layer_depth(hf_config)), max_logit)


def logprob_bound(logits_apart: float, vocab: int, temperature: float = 1.0, u: float = U_FP32) -> float:
    """|a - b| for log_softmax(z / T)[i] of two logit vectors at most `logits_apart` apart (max norm):
    the token's logit and the log-sum-exp each move by at most max|dz| / T, plus the rounding of the
    two log-sum-exps (a sum of `vocab` terms, each <= 1, in other orders)."""
    return 2 * logits_apart / temperature + reordered(vocab, 1, 1.0, u)


def topk_margin(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of `scores` [..., E]: the k-th largest minus the (k+1)-th. Two evaluations of the scores
    each within B of a third one pick the same top-k set wherever the third one's margin exceeds 2 B
    (a chosen score falls by at most B, an unchosen one rises by at most B)."""
    top = scores.float().topk(k + 1, -1).values
    return top[..., k - 1] - top[..., k]


def routing_margin_ratio(router_logits: list[torch.Tensor], k: int, n: int, first_layer: int = 0,
                         per_layer: int = 7) -> float:
    """min over layers and tokens of topk_margin / (2 * reordered(n, router_depth(layer), max|logit|)):
    above 1, every evaluation of the model in another summation order (B apart) routes every token to
    the experts these `router_logits` (one per layer, [tokens, E], from one fp32 evaluation) route it
    to, so comparing two such evaluations compares the same routing; at or below 1 a near-tie could
    send a token elsewhere, a jump no rounding bound covers (then the test needs other inputs). The
    ratio itself moves by at most 1/2 on another host (its evaluation is B away), so inputs measured
    above 1.5 pass the check on every host. Router i sits in layer `first_layer` + i (after the dense
    layers of a DeepSeek), each earlier layer ending `per_layer` reductions (layer_depth's)."""
    ratios = [(topk_margin(r, k).min() / (2 * reordered(n, router_depth(first_layer + i, per_layer),
                                                        r.abs().max().item()))).item()
              for i, r in enumerate(router_logits)]
    return min(ratios)


def grouped_margin_ratio(router_logits: list[torch.Tensor], biases: list[torch.Tensor], hf_config: dict,
                         n: int, first_layer: int, per_layer: int | None = None) -> float:
    """routing_margin_ratio for DeepSeek-V3's router (layers from `first_layer` on; `per_layer`
    reductions per layer, layer_depth's by default): choice scores s = sigmoid(logit) + bias, groups
    ranked by the sum of their top-2 scores, top-k among the chosen groups. A logit B off moves s by at
    most B / 4 (sigmoid's slope), plus the rounding of the sigmoid and of the bias add
    (4 u (1 + max|bias|)): e in all, a group score 2 e. So the routing stands where the
    topk_group-th group's margin exceeds 2 * 2 e and the k-th expert's margin among the chosen groups
    exceeds 2 e; the ratio is the smaller of margin / that."""
    k, groups, top_groups = hf_config["num_experts_per_tok"], hf_config["n_group"], hf_config["topk_group"]
    per_layer = layer_depth(hf_config) if per_layer is None else per_layer
    ratios = []
    for i, (logits, bias) in enumerate(zip(router_logits, biases)):
        B = reordered(n, router_depth(first_layer + i, per_layer), logits.abs().max().item())
        e = B / 4 + 4 * U_FP32 * (1 + bias.float().abs().max().item())
        s = logits.float().sigmoid() + bias.float()
        group_scores = s.view(s.shape[0], groups, -1).topk(2, -1).values.sum(-1)
        if top_groups < groups:
            ratios.append((topk_margin(group_scores, top_groups).min() / (4 * e)).item())
        chosen = group_scores.topk(top_groups, -1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, chosen, True)
        masked = s.masked_fill(~mask.repeat_interleave(s.shape[1] // groups, 1), float("-inf"))
        ratios.append((topk_margin(masked, k).min() / (2 * e)).item())
    return min(ratios)


def hf_routing(model, batch) -> tuple[object, float]:
    """A transformers MoE model's output on a TrainBatch's tokens (router logits included) and the
    routing_margin_ratio of its real tokens (padding excluded: its routing reaches no real token)."""
    cfg = model.config.to_dict()
    real = ~batch.padding_mask_BL().reshape(-1)
    n = longest_reduction(cfg, batch.seq_len)
    with torch.no_grad():
        out = model(batch.tokens_BL, output_router_logits=True)
    routers = [r.reshape(-1, r.shape[-1])[real] for r in out.router_logits]
    if cfg.get("model_type") == "deepseek_v3":  # its MoE layers' routers, after the dense layers
        biases = [layer.mlp.gate.e_score_correction_bias for layer in model.model.layers
                  if hasattr(layer.mlp, "gate")]
        return out, grouped_margin_ratio(routers, biases, cfg, n, cfg.get("first_k_dense_replace", 0))
    # DeepSeek-V2's softmax top-k: the logits' order decides, at MLA's depths after the dense layers
    return out, routing_margin_ratio(routers, cfg["num_experts_per_tok"], n, cfg.get("first_k_dense_replace", 0),
                                     layer_depth(cfg))
