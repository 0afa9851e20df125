"""Typed model specs: every tensor of an MoE decoder under its HF checkpoint name, as plain data.

A `MoESpec` is what the layouts and the resharding planner need to know about a model and nothing
more: for each tensor its HF checkpoint name, global shape, dtype, `TensorKind`, the decoder layer
it belongs to, its global expert index (routed experts only) and its `Role`. The role is the
placement vocabulary shared by the Megatron and SGLang layouts: it says along which tensor dim a
parallel axis may split the tensor (see moe/README.md for the placement table). Specs are built
from a HF `config.json` dict by the per-family modules (`deepseek_v3`, `qwen3_moe`, `mixtral`).

Shape legend: V vocab, H hidden, E routed experts, I dense FFN size, Ie expert FFN size,
nq query heads, nkv KV heads, hd head dim; MLA: Rq q_lora_rank, Rkv kv_lora_rank,
dn nope head dim, dr rope head dim, dv value head dim.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import MappingProxyType
from typing import Any

from moe.hf_megatron import is_size

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


class TensorKind(StrEnum):
    """What a tensor is, for memory reports and for humans."""

    DENSE = "dense"
    ROUTED_EXPERT = "routed_expert"
    SHARED_EXPERT = "shared_expert"
    ROUTER = "router"
    NORM = "norm"
    EMBEDDING = "embedding"


class Role(StrEnum):
    """How a tensor may be split by parallel axes (the layouts map each role to a placement).

    `*_COL` tensors split along dim 0 (output rows), `*_ROW` along dim 1 (input columns).
    """

    EMBED = "embed"                # [V, H] input embedding: vocab rows
    LM_HEAD = "lm_head"            # [V, H] output projection: vocab rows
    REPLICATED = "replicated"      # norms, MLA down-projections, MTP eh_proj: never split
    ROUTER = "router"              # [E, H] gate and [E] score bias: replicated
    ATTN_COL = "attn_col"          # q_proj [nq*hd, H], q_b_proj, kv_b_proj: split by query heads
    ATTN_KV = "attn_kv"            # k_proj / v_proj [nkv*hd, H]: split (or replicated) by KV heads
    ATTN_ROW = "attn_row"          # o_proj [H, nq*hd]: split by query heads along dim 1
    MLP_COL = "mlp_col"            # dense gate_proj / up_proj [I, H]
    MLP_ROW = "mlp_row"            # dense down_proj [H, I]
    SHARED_COL = "shared_col"      # shared-expert gate_proj / up_proj [Is, H]
    SHARED_ROW = "shared_row"      # shared-expert down_proj [H, Is]
    EXPERT_COL = "expert_col"      # routed expert gate_proj / up_proj (w1 / w3) [Ie, H]
    EXPERT_ROW = "expert_row"      # routed expert down_proj (w2) [H, Ie]


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the HF checkpoint. `layer` is None for embeddings, final norm and lm_head."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: TensorKind
    role: Role
    layer: int | None = None
    expert: int | None = None

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True, slots=True)
class ModelDims:
    """The dimensions the layouts validate against (divisibility by TP/EP/PP)."""

    num_layers: int           # decoder layers (MTP layers excluded; they follow the last one)
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int         # equals num_heads for MLA (every head has its own latent KV slice)
    num_experts: int
    intermediate_size: int    # dense FFN size (0 if the model has no dense FFN layer)
    moe_intermediate_size: int
    shared_intermediate_size: int  # 0 without shared experts
    tie_word_embeddings: bool
    num_mtp_layers: int = 0   # DeepSeek multi-token-prediction layers, indices num_layers, num_layers+1, ...


@dataclass(frozen=True, eq=False)
class MoESpec:
    """Every tensor of one model, in HF checkpoint order, plus the dims layouts validate against.

    Contract: tensor names are unique; `tensors` is ordered (embedding, layers in order, final
    norm, lm_head) and that order is the canonical tensor index used by plans. Specs compare and
    hash by identity (a 671B spec has ~45k tensors), so they can key caches cheaply.
    """

    family: str
    flavor: str
    dims: ModelDims
    tensors: tuple[TensorSpec, ...]
    config: Mapping[str, Any] = field(repr=False, default_factory=dict)
    _index: Mapping[str, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        index = {t.name: i for i, t in enumerate(self.tensors)}
        assert len(index) == len(self.tensors), "duplicate tensor names in spec"
        object.__setattr__(self, "_index", MappingProxyType(index))
        object.__setattr__(self, "config", MappingProxyType(dict(self.config)))

    @property
    def name(self) -> str:
        return f"{self.family}/{self.flavor}"

    @property
    def total_params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def index(self, name: str) -> int:
        """Position of tensor `name` in `tensors` (KeyError names the tensor if unknown)."""
        try:
            return self._index[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in spec {self.name}") from None

    def __getitem__(self, name: str) -> TensorSpec:
        return self.tensors[self.index(name)]

    def params_by_kind(self) -> dict[TensorKind, int]:
        out = {k: 0 for k in TensorKind}
        for t in self.tensors:
            out[t.kind] += t.numel
        return out


class LazySpecs(Mapping[str, MoESpec]):
    """flavor -> MoESpec, built on first access (a 671B spec has ~45k tensors; build only what is used)."""

    def __init__(self, builders: Mapping[str, Callable[[], MoESpec]]) -> None:
        self._builders = dict(builders)
        self._built: dict[str, MoESpec] = {}

    def __getitem__(self, flavor: str) -> MoESpec:
        if flavor not in self._builders:
            raise KeyError(f"unknown flavor {flavor!r}; valid: {sorted(self._builders)}")
        if flavor not in self._built:
            self._built[flavor] = self._builders[flavor]()
        return self._built[flavor]

    def __iter__(self) -> Iterator[str]:
        return iter(self._builders)

    def __len__(self) -> int:
        return len(self._builders)


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
# The tiny preset is owned by hpcrl; it is read as a file so that moe/ never imports hpcrl.
HPCRL_CONFIG_DIR = Path(__file__).resolve().parent.parent.parent / "hpcrl" / "models" / "configs"


def load_config(path: str | Path) -> dict[str, Any]:
    """Read a HF config.json; a missing file raises FileNotFoundError naming the path."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"config.json not found: {p}")
    with p.open() as f:
        return json.load(f)


def config_dtype(cfg: Mapping[str, Any]) -> str:
    """The weight dtype of a config (`torch_dtype` or transformers-5 `dtype`), default bfloat16."""
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"config.json torch_dtype={dtype!r} is not supported; valid: {sorted(DTYPE_BYTES)}")
    return dtype


def require(cfg: Mapping[str, Any], key: str, family: str) -> int:
    """cfg[key], a size (a positive integer), or a ValueError that names the key and the family
    being parsed."""
    if key not in cfg or cfg[key] is None:
        raise ValueError(f"{family} config.json is missing required key {key!r}")
    value = cfg[key]
    if not is_size(value):
        raise ValueError(f"{family} config.json {key}={value!r}: expected a positive integer")
    return value
