"""The JSON bodies hpcrl's EngineClient sends to SGLang's control routes, checked against SGLang
0.5.23's request structs (managers/io_struct.py, parsed; the route -> struct map from the endpoint
signatures of entrypoints/http_server.py). SGLang's HTTP layer ignores unknown keys
(utils/msgspec_utils.py: extra_behavior="ignore"), so a misspelt key would be dropped without a
word: every key hpcrl sends must be a field of the route's struct, and every required field sent."""

from __future__ import annotations

import ast

import pytest

from hpcrl.rollout.client import EngineClient

CALLS = [  # (client method, arguments): every control call hpcrl makes with a body
    ("init_weights_update_group", ("10.0.0.1", 29500, 1, 3, "weight_update_group", "nccl")),
    ("update_weights_from_distributed", (["a.weight"], ["bfloat16"], [[2, 3]], "weight_update_group", False,
                                         "flattened_bucket", "v7")),
    ("destroy_weights_update_group", ("weight_update_group",)),
    ("begin_weight_update", ()),
    ("end_weight_update", ()),
    ("get_weights_by_name", ("model.norm.weight", 5)),
    ("update_weight_version", ("v8", True)),
    ("release_memory_occupation", (["weights"],)),
    ("resume_memory_occupation", (["weights"],)),
    ("pause_generation", ("in_place",)),
    ("continue_generation", ()),
]


def _route_structs(root) -> dict[str, str]:
    """{route: request struct name} of SGLang's endpoints whose body is `Annotated[Struct, Body()]`."""
    tree = ast.parse((root / "src/sglang/srt/entrypoints/http_server.py").read_text())
    out = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            continue
        ann = fn.args.args[0].annotation
        if not (isinstance(ann, ast.Subscript) and getattr(ann.value, "id", "") == "Annotated"):
            continue
        first = ann.slice.elts[0] if isinstance(ann.slice, ast.Tuple) else ann.slice
        if not isinstance(first, ast.Name):
            continue  # e.g. Annotated[Optional[X], ...]: not a plain request struct
        struct = first.id
        for dec in fn.decorator_list:
            if isinstance(dec, ast.Call) and getattr(dec.func, "attr", "") in ("post", "api_route", "put") \
                    and dec.args and isinstance(dec.args[0], ast.Constant):
                out[dec.args[0].value] = struct
    return out


def _struct_fields(root) -> dict[str, dict[str, bool]]:
    """{struct: {field: required}} of io_struct.py's classes, base classes' fields included."""
    tree = ast.parse((root / "src/sglang/srt/managers/io_struct.py").read_text())
    classes = {c.name: c for c in tree.body if isinstance(c, ast.ClassDef)}

    def fields(name: str) -> dict[str, bool]:
        cls = classes.get(name)
        if cls is None:
            return {}
        out: dict[str, bool] = {}
        for base in cls.bases:
            out |= fields(getattr(base, "id", ""))
        for node in cls.body:
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                out[node.target.id] = node.value is None
        return out

    return {name: fields(name) for name in classes}


@pytest.fixture(scope="module")
def sent():
    """(route, body) of every call in CALLS, captured at EngineClient.request."""
    seen = []

    def record(self, method, route, payload=None, timeout_s=None):
        seen.append((route, payload))
        return {"success": True, "message": ""}

    client = EngineClient("http://127.0.0.1:1")
    mp = pytest.MonkeyPatch()
    mp.setattr(EngineClient, "request", record)
    try:
        for name, args in CALLS:
            getattr(client, name)(*args)
    finally:
        mp.undo()
    return seen


def test_every_key_hpcrl_sends_is_a_field_sglang_reads(sglang_root, sent):
    routes, structs = _route_structs(sglang_root), _struct_fields(sglang_root)
    assert len(sent) == len(CALLS)
    problems = []
    for route, body in sent:
        assert route in routes, f"{route} is not an SGLang 0.5.23 route with a request struct"
        fields = structs[routes[route]]
        assert fields, routes[route]
        unknown = sorted(set(body or {}) - set(fields))
        missing = sorted(f for f, required in fields.items() if required and f not in (body or {}))
        if unknown or missing:
            problems.append(f"{route} ({routes[route]}): unknown {unknown}, missing {missing}")
    assert not problems, "\n".join(problems)


def test_the_check_sees_a_misspelt_key(sglang_root):
    fields = _struct_fields(sglang_root)[_route_structs(sglang_root)["/update_weights_from_distributed"]]
    assert "load_format" in fields and "loadformat" not in fields and fields["names"] is True
