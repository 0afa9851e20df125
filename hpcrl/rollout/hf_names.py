"""HF checkpoint (on-disk) tensor names <-> transformers 5.x in-memory parameters of MoE causal LMs.

transformers 5.x keeps each MoE layer's experts fused in memory: `<layer>.mlp.experts.gate_up_proj`
[E, 2I, H] (the gate rows of expert e are `[e, :I]`, its up rows `[e, I:]`) and
`<layer>.mlp.experts.down_proj` [E, H, I]. `save_pretrained` converts back to the legacy per-expert
names, and those on-disk names are what SGLang's `model.load_weights` reads, so they are the names
of hpcrl's weight-sync protocol:

    Qwen3-MoE / Qwen2-MoE  <layer>.mlp.experts.{e}.gate_proj|up_proj|down_proj.weight,
                           router <layer>.mlp.gate.weight
    DeepSeek-V3 / V2       as Qwen3-MoE (transformers converts both with Qwen2-MoE's rules)
    Mixtral                <layer>.block_sparse_moe.experts.{e}.w1|w3|w2.weight (gate|up|down),
                           router <layer>.block_sparse_moe.gate.weight

Every other tensor keeps its in-memory name: DeepSeek's router bias
`<layer>.mlp.gate.e_score_correction_bias` (a float32 buffer, not a parameter, and a checkpoint tensor
all the same), its shared experts `<layer>.mlp.shared_experts.{gate,up,down}_proj.weight`, its dense
MLP layers' `<layer>.mlp.{gate,up,down}_proj.weight` and the MLA projections. DeepSeek's MTP layers
(`model.layers.{num_hidden_layers + k}.*` on disk) are not part of transformers' model and have no
slot (moe.hf_megatron.mtp_names picks them out). A `Slot` says where an on-disk tensor lives in memory:
the in-memory parameter name and an index into it (`()` for a whole parameter); indexing a parameter
with it gives a contiguous view, so reading a slot copies nothing and writing one is `copy_`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["EXPERT_NAMES", "ExpertNames", "Slot", "checkpoint_slots", "checkpoint_state_dict", "model_slots"]

Slot = tuple[str, tuple[int | slice, ...]]

_FUSED_RE = re.compile(r"(?P<prefix>.*\.)mlp\.experts\.(?P<kind>gate_up_proj|down_proj)")
_ROUTER_RE = re.compile(r"(?P<prefix>.*\.)mlp\.gate\.weight")


@dataclass(frozen=True, slots=True)
class ExpertNames:
    """On-disk naming of one MoE family: the MoE block's module name and the per-expert projections."""

    module: str
    gate: str
    up: str
    down: str


EXPERT_NAMES: dict[str, ExpertNames] = {
    "qwen3_moe": ExpertNames(module="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "qwen2_moe": ExpertNames(module="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "deepseek_v3": ExpertNames(module="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "deepseek_v2": ExpertNames(module="mlp", gate="gate_proj", up="up_proj", down="down_proj"),
    "mixtral": ExpertNames(module="block_sparse_moe", gate="w1", up="w3", down="w2"),
}


def _expert_names(model_type: str) -> ExpertNames:
    try:
        return EXPERT_NAMES[model_type]
    except KeyError:
        raise ValueError(f"model_type {model_type!r} has fused MoE experts but no known on-disk expert "
                         f"naming; supported model types: {sorted(EXPERT_NAMES)}. Add its naming to "
                         f"hpcrl.rollout.hf_names.EXPERT_NAMES.") from None


def checkpoint_slots(param_shapes: Mapping[str, Sequence[int]], model_type: str,
                     tie_word_embeddings: bool = False) -> dict[str, Slot]:
    """Every on-disk tensor name of a model -> its Slot, given the in-memory parameter shapes.

    Order is fixed: in-memory order, with a layer's experts expanded at its `gate_up_proj` as
    expert 0 (gate, up, down), expert 1 (gate, up, down), ... When `tie_word_embeddings` is set,
    `lm_head.weight` is left out (HF does not save it and SGLang skips it). `model_type` matters only
    for models with fused experts; an unknown one raises ValueError.
    """
    slots: dict[str, Slot] = {}
    for name, shape in param_shapes.items():
        if tie_word_embeddings and name == "lm_head.weight":
            continue
        fused = _FUSED_RE.fullmatch(name)
        router = _ROUTER_RE.fullmatch(name)
        if fused is not None:
            if fused["kind"] == "down_proj":
                continue  # emitted together with gate_up_proj below
            naming = _expert_names(model_type)
            prefix = fused["prefix"]
            down_name = f"{prefix}mlp.experts.down_proj"
            if down_name not in param_shapes:
                raise ValueError(f"{name} has no matching {down_name} among the model's parameters")
            num_experts, two_inter, _hidden = shape
            inter = two_inter // 2
            base = f"{prefix}{naming.module}.experts"
            for e in range(num_experts):
                slots[f"{base}.{e}.{naming.gate}.weight"] = (name, (e, slice(0, inter)))
                slots[f"{base}.{e}.{naming.up}.weight"] = (name, (e, slice(inter, two_inter)))
                slots[f"{base}.{e}.{naming.down}.weight"] = (down_name, (e,))
        elif router is not None and model_type in EXPERT_NAMES:
            slots[f"{router['prefix']}{EXPERT_NAMES[model_type].module}.gate.weight"] = (name, ())
        else:
            slots[name] = (name, ())
    return slots


def model_slots(model: torch.nn.Module) -> dict[str, Slot]:
    """`checkpoint_slots` of a transformers model (its config gives model_type and tying)."""
    config = model.config
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    tied = bool(getattr(text_config, "tie_word_embeddings", False)
                or getattr(config, "tie_word_embeddings", False))
    shapes = {name: tuple(t.shape) for name, t in model.state_dict(keep_vars=True).items()}
    return checkpoint_slots(shapes, config.model_type, tie_word_embeddings=tied)


def checkpoint_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their on-disk names, in `checkpoint_slots` order.

    Values are detached views of the live parameters (no copy): clone them if the model may change
    while they are in use. Equal, name for name and bit for bit, to what `save_pretrained` writes.
    """
    params = model.state_dict(keep_vars=True)
    return {ckpt: params[pname].detach()[index] for ckpt, (pname, index) in model_slots(model).items()}

