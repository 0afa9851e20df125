"""Tensors SGLang fuses on load, which must reach one `load_weights` call together (no torch).

SGLang 0.5.23's loaders take most HF tensors one by one, but a few are fused from several
checkpoint tensors inside one `load_weights` call, with the pieces cached in a dict local to that
call: a piece that arrives in another call (another bucket of `/update_weights_from_distributed`)
is cached, never completed, and the fused parameter silently keeps its old value. Read from the
wheel (`sglang/srt/models/...`):

- DeepSeek-V2/V3 (`deepseek_common/deepseek_weight_loader.py`, `cached_a_proj`): with a
  q_lora_rank, `self_attn.q_a_proj.*` and `self_attn.kv_a_proj_with_mqa.*` are concatenated into
  `fused_qkv_a_proj_with_mqa` (weights and, in quantized checkpoints, their scales alike); the
  partner of a name is found by replacing one infix with the other.
- DeepSeek-V3.2 (same file, `_load_fused_indexer_wk`): `indexer.wk` / `indexer.weights_proj` with a
  block-fp8 weight wait for their `weight_scale_inv`; bf16 pieces load alone. Not a supported family
  here, listed for completeness by the `.weight` / `.weight_scale_inv` pair rule below.
- Qwen3-MoE (`qwen3_moe.py`) and Mixtral (`mixtral.py`): q/k/v -> qkv_proj and gate/up ->
  gate_up_proj are stacked shard by shard (`weight_loader(param, w, shard_id)`), experts likewise,
  so every tensor loads on its own: no groups.

`fused_groups(names)` returns the groups present among `names` (each sorted by position, two or
more members); the broadcast paths keep each group in one bucket of one source.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["FUSED_INFIXES", "fused_groups"]

FUSED_INFIXES: tuple[tuple[str, ...], ...] = (
    (".self_attn.q_a_proj.", ".self_attn.kv_a_proj_with_mqa."),  # DeepSeek MLA, cached_a_proj
)
"""Each entry: infixes whose tensors (same name otherwise) SGLang fuses within one load call."""

_SCALED = (".indexer.wk.", ".indexer.weights_proj.")  # DeepSeek-V3.2: weight + weight_scale_inv


def _key(name: str) -> tuple | None:
    """The group a tensor name belongs to (None: it loads alone)."""
    for k, infixes in enumerate(FUSED_INFIXES):
        for infix in infixes:
            if infix in name:
                return ("infix", k, name.replace(infix, infixes[0], 1))
    if any(s in name for s in _SCALED):
        for suffix in (".weight_scale_inv", ".weight"):
            if name.endswith(suffix):
                return ("scale", name[: -len(suffix)])
    return None


def fused_groups(names: Sequence[str]) -> list[list[int]]:
    """Indices into `names` of every group SGLang loads fused (module docstring), in order of
    their first member; singletons (a partner absent from `names`) are left out."""
    groups: dict[tuple, list[int]] = {}
    for i, name in enumerate(names):
        key = _key(name)
        if key is not None:
            groups.setdefault(key, []).append(i)
    return [g for g in groups.values() if len(g) > 1]
