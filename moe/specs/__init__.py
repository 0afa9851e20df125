"""MoE model specs: every tensor of a model (HF name, global shape, dtype, kind, role) from config.json.

Families: `deepseek_v3`, `qwen3_moe`, `mixtral`; each module exposes `SPECS: Mapping[str, MoESpec]`
(flavor -> spec, built lazily) with a `debug` flavor, and `spec_from_config(cfg)`. A `deepseek_v2`
config.json is described by `deepseek_v3.spec_from_config` (the same tensors, no router bias; no
shipped flavors).

    from moe.specs import get_spec, spec_from_config
    spec = get_spec("deepseek_v3/671B")          # or get_spec("qwen3_moe", "30B-A3B")
    spec = spec_from_config(load_config("path/to/config.json"))
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from moe.hf_megatron import MODEL_TYPES, family_of
from moe.specs import deepseek_v3, mixtral, qwen3_moe
from moe.specs._types import (CONFIG_DIR, DTYPE_BYTES, ModelDims, MoESpec, Role, TensorKind, TensorSpec,
                              load_config)

__all__ = ["CONFIG_DIR", "DTYPE_BYTES", "FAMILIES", "ModelDims", "MoESpec", "Role", "TensorKind",
           "TensorSpec", "get_spec", "load_config", "spec_at_dtype", "spec_from_config"]

FAMILIES: Mapping[str, Mapping[str, MoESpec]] = {
    deepseek_v3.FAMILY: deepseek_v3.SPECS,
    qwen3_moe.FAMILY: qwen3_moe.SPECS,
    mixtral.FAMILY: mixtral.SPECS,
}
_FROM_CONFIG = {**{family: deepseek_v3.spec_from_config for family in deepseek_v3.BUILT_FAMILIES},
                qwen3_moe.FAMILY: qwen3_moe.spec_from_config, mixtral.FAMILY: mixtral.spec_from_config}


def get_spec(family: str, flavor: str | None = None) -> MoESpec:
    """A shipped spec by `family` and `flavor`, or by one string `"family/flavor"`."""
    if flavor is None:
        family, _, flavor = family.partition("/")
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; valid: {sorted(FAMILIES)}")
    flavors = FAMILIES[family]
    if flavor not in flavors:
        raise ValueError(f"unknown flavor {flavor!r} of {family}; valid: {sorted(flavors)}")
    return flavors[flavor]


def spec_from_config(cfg: Mapping[str, Any], flavor: str = "custom", **kwargs: Any) -> MoESpec:
    """The spec of any supported config.json dict, dispatched on its `model_type`'s family (kimi_k2 is
    deepseek_v3: moe.hf_megatron.MODEL_TYPE_ALIASES; deepseek_v2 is described as deepseek_v3)."""
    family = family_of(cfg.get("model_type"))
    if family not in _FROM_CONFIG:
        raise ValueError(f"config.json model_type={cfg.get('model_type')!r} is not supported; "
                         f"valid: {sorted(MODEL_TYPES)}")
    return _FROM_CONFIG[family](cfg, flavor, **kwargs)


def spec_at_dtype(cfg: Mapping[str, Any], dtype: str, flavor: str = "custom") -> MoESpec:
    """The spec of a HF config.json dict with every tensor at `dtype`, the dtype the weights move in.
    The trainer (hpcrl.models.job_model.build_spec), the reference engine and the SGLang-side loader
    all build it here, so their fingerprints agree."""
    clean = {k: v for k, v in cfg.items() if k != "dtype"}
    return spec_from_config({**clean, "torch_dtype": dtype}, flavor=flavor)
