"""Small builders shared by the per-family spec modules (embedding, GQA attention, FFNs, experts).

Each helper appends `TensorSpec`s in HF checkpoint naming to a list; the family modules only
decide which blocks a layer has and what the HF prefixes are. Shape legend as in `_types`.
"""

from __future__ import annotations

from moe.specs._types import Role, TensorKind, TensorSpec

K, R = TensorKind, Role


def embedding(out: list[TensorSpec], vocab: int, hidden: int, dtype: str) -> None:
    out.append(TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype, K.EMBEDDING, R.EMBED))


def head(out: list[TensorSpec], vocab: int, hidden: int, dtype: str, tied: bool) -> None:
    """Final norm, then lm_head unless the embeddings are tied (then lm_head is not a tensor)."""
    out.append(TensorSpec("model.norm.weight", (hidden,), dtype, K.NORM, R.REPLICATED))
    if not tied:
        out.append(TensorSpec("lm_head.weight", (vocab, hidden), dtype, K.EMBEDDING, R.LM_HEAD))


def norm(out: list[TensorSpec], name: str, size: int, dtype: str, layer: int) -> None:
    out.append(TensorSpec(name, (size,), dtype, K.NORM, R.REPLICATED, layer))


def gqa_attention(out: list[TensorSpec], p: str, layer: int, hidden: int, heads: int, kv_heads: int,
                  head_dim: int, dtype: str, qk_norm: bool, bias: bool) -> None:
    """q/k/v/o projections of grouped-query attention under prefix `p` (e.g. model.layers.3.self_attn)."""
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    out.append(TensorSpec(f"{p}.q_proj.weight", (q_rows, hidden), dtype, K.DENSE, R.ATTN_COL, layer))
    if bias:
        out.append(TensorSpec(f"{p}.q_proj.bias", (q_rows,), dtype, K.DENSE, R.ATTN_COL, layer))
    for n in ("k_proj", "v_proj"):
        out.append(TensorSpec(f"{p}.{n}.weight", (kv_rows, hidden), dtype, K.DENSE, R.ATTN_KV, layer))
        if bias:
            out.append(TensorSpec(f"{p}.{n}.bias", (kv_rows,), dtype, K.DENSE, R.ATTN_KV, layer))
    out.append(TensorSpec(f"{p}.o_proj.weight", (hidden, q_rows), dtype, K.DENSE, R.ATTN_ROW, layer))
    if qk_norm:
        norm(out, f"{p}.q_norm.weight", head_dim, dtype, layer)
        norm(out, f"{p}.k_norm.weight", head_dim, dtype, layer)


def glu_ffn(out: list[TensorSpec], p: str, layer: int, hidden: int, ffn: int, dtype: str,
            kind: TensorKind, col: Role, row: Role, expert: int | None = None,
            names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """A SwiGLU FFN: gate [ffn, H], up [ffn, H], down [H, ffn]; `names` are the HF names of the three."""
    gate, up, down = names
    out.append(TensorSpec(f"{p}.{gate}.weight", (ffn, hidden), dtype, kind, col, layer, expert))
    out.append(TensorSpec(f"{p}.{up}.weight", (ffn, hidden), dtype, kind, col, layer, expert))
    out.append(TensorSpec(f"{p}.{down}.weight", (hidden, ffn), dtype, kind, row, layer, expert))


def routed_experts(out: list[TensorSpec], p: str, layer: int, num_experts: int, hidden: int, ffn: int,
                   dtype: str, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")) -> None:
    """Experts `{p}.{e}.<gate|up|down>.weight` for e in [0, num_experts)."""
    for e in range(num_experts):
        glu_ffn(out, f"{p}.{e}", layer, hidden, ffn, dtype, K.ROUTED_EXPERT, R.EXPERT_COL, R.EXPERT_ROW,
                expert=e, names=names)


def router(out: list[TensorSpec], name: str, num_experts: int, hidden: int, dtype: str, layer: int) -> None:
    out.append(TensorSpec(name, (num_experts, hidden), dtype, K.ROUTER, R.ROUTER, layer))
