"""moe.specs: tensor inventories from config.json match published totals and HF checkpoint names."""

from __future__ import annotations

import glob
import json

import pytest

from moe.specs import FAMILIES, CONFIG_DIR, Role, TensorKind, get_spec, load_config, spec_from_config
from moe.specs import deepseek_v3, mixtral
from moe.specs._types import HPCRL_CONFIG_DIR


@pytest.mark.parametrize("name, published", [
    ("deepseek_v3/671B", 671e9),
    ("qwen3_moe/235B-A22B", 235e9),
    ("qwen3_moe/30B-A3B", 30.5e9),
    ("mixtral/8x7B", 46.7e9),
])
def test_totals_match_published(name: str, published: float) -> None:
    spec = get_spec(name)
    assert abs(spec.total_params - published) / published < 0.005, spec.total_params


def test_deepseek_v3_structure() -> None:
    spec = get_spec("deepseek_v3/671B")
    kinds = spec.params_by_kind()
    assert all(kinds[k] > 0 for k in TensorKind), kinds
    routed = [t for t in spec.tensors if t.kind is TensorKind.ROUTED_EXPERT]
    assert len(routed) == 58 * 256 * 3  # layers 3..60 are MoE, 3 matrices per expert
    assert {t.layer for t in routed} == set(range(3, 61))
    assert spec["model.layers.0.mlp.gate_proj.weight"].shape == (18432, 7168)
    assert "model.layers.3.mlp.gate_proj.weight" not in {t.name for t in spec.tensors}
    bias = spec["model.layers.3.mlp.gate.e_score_correction_bias"]
    assert (bias.shape, bias.dtype, bias.kind) == ((256,), "float32", TensorKind.ROUTER)
    assert spec["model.layers.5.self_attn.q_b_proj.weight"].shape == (128 * 192, 1536)
    assert spec["model.layers.5.self_attn.kv_a_proj_with_mqa.weight"].role is Role.REPLICATED
    assert spec["model.layers.5.self_attn.o_proj.weight"].shape == (7168, 128 * 128)
    assert spec["model.layers.60.mlp.experts.255.down_proj.weight"].shape == (7168, 2048)
    assert spec["model.layers.60.mlp.experts.255.down_proj.weight"].expert == 255
    assert spec["model.layers.60.mlp.shared_experts.up_proj.weight"].kind is TensorKind.SHARED_EXPERT
    assert spec.dims.num_layers == 61 and spec.dims.num_mtp_layers == 0
    assert spec.total_bytes == sum(t.numel * (4 if t.dtype == "float32" else 2) for t in spec.tensors)


def test_deepseek_v3_mtp_is_optional() -> None:
    base, mtp = get_spec("deepseek_v3/671B"), get_spec("deepseek_v3/671B-mtp")
    extra = mtp.total_params - base.total_params
    assert abs(extra - 11.5e9) / 11.5e9 < 0.02  # published: 11.5B unique MTP parameters
    assert mtp.dims.num_mtp_layers == 1
    assert mtp["model.layers.61.eh_proj.weight"].shape == (7168, 2 * 7168)
    assert mtp["model.layers.61.mlp.experts.0.gate_proj.weight"].layer == 61


def test_shipped_configs_are_the_published_files() -> None:
    ds = load_config(CONFIG_DIR / "deepseek-v3.json")
    assert (ds["n_routed_experts"], ds["first_k_dense_replace"], ds["num_nextn_predict_layers"]) == (256, 3, 1)
    q = load_config(CONFIG_DIR / "qwen3-235b-a22b.json")
    assert (q["num_experts"], q["num_hidden_layers"], q["num_key_value_heads"]) == (128, 94, 4)
    m = load_config(CONFIG_DIR / "mixtral-8x7b-v0.1.json")
    assert (m["num_local_experts"], m["intermediate_size"]) == (8, 14336)


def test_every_family_has_a_debug_flavor_and_qwen_debug_is_the_tiny_preset() -> None:
    for family, flavors in FAMILIES.items():
        assert "debug" in flavors, family
    tiny = json.loads((HPCRL_CONFIG_DIR / "tiny-qwen3-moe.json").read_text())
    spec = get_spec("qwen3_moe/debug")
    assert spec.dims.hidden_size == tiny["hidden_size"] and spec.dims.num_experts == tiny["num_experts"]
    assert spec["model.layers.1.mlp.experts.3.down_proj.weight"].shape == (tiny["hidden_size"],
                                                                           tiny["moe_intermediate_size"])


def test_bad_configs_name_the_problem() -> None:
    with pytest.raises(ValueError, match="model_type='llama' is not supported; valid: .*'kimi_k2'"):
        spec_from_config({"model_type": "llama"})
    cfg = dict(mixtral.DEBUG_CONFIG)
    del cfg["num_local_experts"]
    with pytest.raises(ValueError, match="num_local_experts"):
        spec_from_config(cfg)
    for key, bad in (("vocab_size", -5), ("num_local_experts", 0), ("hidden_size", "64"), ("hidden_size", True)):
        with pytest.raises(ValueError, match=f"mixtral config.json {key}={bad!r}: expected a positive integer"):
            spec_from_config({**mixtral.DEBUG_CONFIG, key: bad})  # what hpcrl plan reads (validate checks more)
    with pytest.raises(ValueError, match="torch_dtype='int4'"):
        spec_from_config({**mixtral.DEBUG_CONFIG, "torch_dtype": "int4"})
    with pytest.raises(ValueError, match="unknown flavor"):
        get_spec("qwen3_moe/1T")
    with pytest.raises(KeyError, match="not in spec"):
        get_spec("mixtral/debug")["model.layers.99.foo"]


@pytest.mark.timeout(180)
def test_debug_specs_match_transformers_checkpoints(tmp_path) -> None:
    """Names and shapes equal what transformers 5.x writes with save_pretrained (the SGLang input)."""
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    cases = {"qwen3_moe/debug": load_config(HPCRL_CONFIG_DIR / "tiny-qwen3-moe.json"),
             "mixtral/debug": mixtral.DEBUG_CONFIG, "deepseek_v3/debug": deepseek_v3.DEBUG_CONFIG}
    for name, cfg in cases.items():
        spec = get_spec(name)
        config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
        torch.manual_seed(0)
        out = tmp_path / name.replace("/", "_")
        AutoModelForCausalLM.from_config(config).save_pretrained(out)
        saved = {}
        for f in glob.glob(str(out / "*.safetensors")):
            with safe_open(f, "pt") as sf:
                saved.update({k: tuple(sf.get_slice(k).get_shape()) for k in sf.keys()})
        assert saved == {t.name: t.shape for t in spec.tensors}, name


@pytest.mark.parametrize("config", ["tiny-deepseek-v3", "tiny-deepseek-v3-no-q-lora", "deepseek-v3", "kimi_k2"])
def test_the_planned_deepseek_spec_is_what_the_trainer_holds(config: str) -> None:
    """`hpcrl plan`'s spec (spec_at_dtype, as hpcrl.models.job_model.build_spec builds it) names the
    tensors the Megatron trainer holds, with their shapes: moe.hf_megatron's inventory, which has no
    MTP layer (num_nextn_predict_layers = 1 in these configs; the trainer does not build it).
    kimi_k2 (Kimi-K2's model type and grouping) is planned and built as DeepSeek-V3."""
    from deepseek_dirs import kimi_k2_config

    from moe.hf_megatron import HFModelDims
    from moe.specs import spec_at_dtype

    if config == "deepseek-v3":
        cfg = load_config(CONFIG_DIR / "deepseek-v3.json")
    elif config == "kimi_k2":
        cfg = {**kimi_k2_config(), "num_nextn_predict_layers": 1}
    else:
        cfg = load_config(HPCRL_CONFIG_DIR / "tiny-deepseek-v3.json")
        if config.endswith("no-q-lora"):
            cfg = {**cfg, "q_lora_rank": None}
    assert cfg["num_nextn_predict_layers"] == 1
    spec = spec_at_dtype(cfg, "bfloat16")
    dims = HFModelDims.from_hf_config(cfg)
    assert {t.name: t.shape for t in spec.tensors} == dims.hf_shapes()
    assert spec.dims.num_mtp_layers == 0 and spec.dims.num_layers == dims.num_layers
    bias = [t for t in spec.tensors if t.name.endswith("e_score_correction_bias")]
    assert len(bias) == dims.num_layers - dims.first_dense_layers
    assert {(t.dtype, t.role, t.shape) for t in bias} == {("float32", Role.ROUTER, (dims.num_experts,))}
