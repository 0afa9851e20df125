"""Every tensor name of each supported family's spec (moe/specs, the names hpcrl's weight sync sends)
is one SGLang 0.5.23's `load_weights` of that family loads, read from the wheel's source (SGLang's
model modules do not import on CPU).

The rules are parsed from the load_weights source: `stacked_params_mapping` (a literal list),
`FusedMoE.make_expert_params_mapping(ckpt_*_name=...)` (SGLang's function, taken from
layers/moe/fused_moe_triton/layer.py and run) and, for DeepSeek-V3, the q_a_proj +
kv_a_proj_with_mqa fusion. A name is mapped the way load_weights maps it (stacked first, experts
next, else the name itself) and accepted when every module along the mapped name is an attribute
that the family's model classes assign (`self.<attr> = ...` in the model file and the model files it
imports). SGLang skips names it does not know silently, so a misnamed tensor would be a stale weight:
this test is what catches it before a GPU run does.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from moe.specs import FAMILIES, get_spec

MODELS = "sglang/srt/models"
# family -> (file of load_weights, its class or None, function name, model files of the module tree)
SOURCES = {
    "qwen3_moe": (f"{MODELS}/qwen3_moe.py", "Qwen3MoeForCausalLM", "load_weights",
                  [f"{MODELS}/qwen3_moe.py", f"{MODELS}/qwen2_moe.py"]),
    "mixtral": (f"{MODELS}/mixtral.py", "MixtralForCausalLM", "load_weights", [f"{MODELS}/mixtral.py"]),
    "deepseek_v3": (f"{MODELS}/deepseek_common/deepseek_weight_loader.py", None, "do_load_weights",
                    [f"{MODELS}/deepseek_v2.py"]),
}
LEAVES = {"weight", "bias"}


def _function(tree: ast.Module, cls: str | None, name: str) -> ast.FunctionDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and (cls is None or node.name == cls):
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == name:
                    return item
    raise AssertionError(f"{cls}.{name} not found: SGLang's source changed shape; update this test")


def _assigned(fn: ast.FunctionDef, var: str) -> ast.expr:
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == var
                                                for t in node.targets):
            return node.value
    raise AssertionError(f"{var} is not assigned in {fn.name}")


def _expert_mapping_fn(root: Path):
    """SGLang's FusedMoE.make_expert_params_mapping, compiled from its source."""
    tree = ast.parse((root / "src/sglang/srt/layers/moe/fused_moe_triton/layer.py").read_text())
    fn = _function(tree, "FusedMoE", "make_expert_params_mapping")
    fn.decorator_list, fn.returns = [], None
    for arg in fn.args.args:
        arg.annotation = None
    scope: dict = {}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), "make_expert_params_mapping", "exec"), scope)
    return lambda **kw: scope["make_expert_params_mapping"](None, **kw)


class Rules:
    """One family's load_weights rules, parsed from SGLang's source."""

    def __init__(self, root: Path, family: str, num_experts: int) -> None:
        file, cls, fn_name, model_files = SOURCES[family]
        source = (root / "src" / file).read_text()
        fn = _function(ast.parse(source), cls, fn_name)
        self.stacked = ast.literal_eval(_assigned(fn, "stacked_params_mapping"))
        call = _assigned(fn, "expert_params_mapping")
        assert isinstance(call, ast.Call) and call.func.attr == "make_expert_params_mapping"
        kw = {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg.startswith("ckpt_")}
        self.experts = _expert_mapping_fn(root)(**kw, num_experts=num_experts)
        fn_source = ast.get_source_segment(source, fn)
        # DeepSeek: q_a_proj and kv_a_proj_with_mqa are cached and loaded together into this parameter
        fuses = "fused_qkv_a_proj_with_mqa" in fn_source
        self.fused = {"q_a_proj", "kv_a_proj_with_mqa"} if fuses else set()
        self.skip_experts_in_stacked = '"mlp.experts' in fn_source
        self.attrs = set()
        for f in model_files:
            for node in ast.walk(ast.parse((root / "src" / f).read_text())):
                if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                        and isinstance(node.value, ast.Name) and node.value.id == "self"):
                    self.attrs.add(node.attr)
        if self.fused:
            assert "fused_qkv_a_proj_with_mqa" in self.attrs

    def map(self, name: str) -> str:
        """The parameter name load_weights loads `name` into (its loop order: stacked, experts, direct)."""
        for param, weight, _ in self.stacked:
            if weight in name and not (self.skip_experts_in_stacked and "mlp.experts." in name):
                return name.replace(weight, param)
        for param, weight, _, _ in self.experts:
            if weight in name:
                return name.replace(weight, param)
        for part in self.fused:
            if f".{part}." in name:
                return name.replace(part, "fused_qkv_a_proj_with_mqa")
        return name

    def unknown_modules(self, param: str) -> list[str]:
        """Components of a mapped name that no model class assigns (empty: SGLang has the parameter)."""
        parts = param.split(".")
        leaf = parts[-1]
        ok_leaf = leaf in LEAVES or leaf in self.attrs or parts[-2:-1] == ["experts"] and leaf.startswith("w")
        unknown = [p for p in parts[:-1] if not p.isdigit() and p not in self.attrs]
        return unknown + ([] if ok_leaf else [leaf])


@pytest.mark.parametrize(("family", "flavor"), [(f, fl) for f in sorted(FAMILIES) for fl in FAMILIES[f]])
def test_every_spec_name_is_loaded_by_sglang(sglang_root, family, flavor):
    spec = get_spec(family, flavor)
    rules = Rules(sglang_root, family, spec.dims.num_experts)
    num_layers = spec.config["num_hidden_layers"]
    bad = {}
    for t in spec.tensors:
        layer = re.match(r"model\.layers\.(\d+)\.", t.name)
        if layer and int(layer.group(1)) >= num_layers:
            continue  # MTP layers: the target model skips them (SGLang's draft model loads them)
        unknown = rules.unknown_modules(rules.map(t.name))
        if unknown:
            bad[t.name] = (rules.map(t.name), unknown)
    assert not bad, f"{len(bad)} names SGLang would skip silently, e.g. {list(bad.items())[:5]}"


@pytest.mark.parametrize(("family", "wrong"), [
    ("qwen3_moe", "model.layers.0.block_sparse_moe.experts.0.w1.weight"),  # Mixtral's names in Qwen3
    ("mixtral", "model.layers.0.mlp.experts.0.gate_proj.weight"),
    ("deepseek_v3", "model.layers.0.self_attn.q_proj_a.weight"),
    ("qwen3_moe", "model.layers.0.self_attn.qk_norm.weight"),
])
def test_a_misnamed_tensor_is_caught(sglang_root, family, wrong):
    rules = Rules(sglang_root, family, 8)
    assert rules.unknown_modules(rules.map(wrong))


def test_expert_mapping_is_sglangs(sglang_root):
    """Per-expert HF names map to FusedMoE's fused parameters, with SGLang's shard ids."""
    rules = Rules(sglang_root, "qwen3_moe", 4)
    assert rules.map("model.layers.1.mlp.experts.3.up_proj.weight") == "model.layers.1.mlp.experts.w13_weight"
    down = rules.map("model.layers.1.mlp.experts.3.down_proj.weight")
    assert down == "model.layers.1.mlp.experts.w2_weight"
    assert ("experts.w13_", "experts.3.gate_proj.", 3, "w1") in rules.experts


def _call_local_dicts(fn: ast.FunctionDef) -> set[str]:
    """Names a load function binds to a dict (`x = {}`, `x = {} if c else None`, `x: Dict = {}`):
    state that outlives one weight, i.e. pieces waiting for a partner in the same call."""
    out = set()
    for node in ast.walk(fn):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            values = [node.value] + ([node.value.body, node.value.orelse] if isinstance(node.value, ast.IfExp)
                                     else [])
            if any(isinstance(v, ast.Dict) or isinstance(v, ast.Call) and getattr(v.func, "id", "") == "dict"
                   for v in values):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                out |= {t.id for t in targets if isinstance(t, ast.Name)}
    return out - {"params_dict", "kw"}


def test_fused_groups_match_sglang(sglang_root):
    """moe/fused.py (what hpcrl keeps in one bucket) lists what SGLang's loaders fuse within one call:
    Qwen3-MoE and Mixtral keep no pieces across weights; DeepSeek-V3 caches exactly q_a_proj and
    kv_a_proj_with_mqa (cached_a_proj) and the V3.2 indexer pieces."""
    from moe.fused import FUSED_INFIXES

    for family, (file, cls, name, _) in SOURCES.items():
        source = (sglang_root / "src" / file).read_text()
        fn = _function(ast.parse(source), cls, name)
        held = _call_local_dicts(fn)
        if family != "deepseek_v3":
            assert not held, f"{family}'s load_weights now holds pieces across weights in {held}"
            continue
        assert held == {"cached_a_proj", "pending_indexer_wk"}, held
        tested = {c.value for node in ast.walk(fn) if isinstance(node, ast.Compare)
                  and any(isinstance(op, ast.In) for op in node.ops)
                  for c in [node.left] if isinstance(c, ast.Constant) and "a_proj" in str(c.value)}
        assert tested == {"q_a_proj", "kv_a_proj_with_mqa"}, tested
        ours = {infix.strip(".").rsplit(".", 1)[-1] for infix in FUSED_INFIXES[0]}
        assert ours == tested
