"""hpcrl's engine auth (hpcrl/rollout/engine_auth.py: the reference server's rules and the keys the
client sends) against SGLang 0.5.23's own: `decide_request_auth` from sglang/srt/utils/auth.py
(imported; it needs only the standard library) on every combination of method, route, header and
configured keys, and the route levels from the `@auth_level` marks of entrypoints/http_server.py
(parsed) for every SGLang route hpcrl's client or reference server names."""

from __future__ import annotations

import ast
import itertools
import re
from pathlib import Path

import pytest

from sglang_wheel import load_file

engine_auth = pytest.importorskip("hpcrl.rollout.engine_auth",
                                  reason="hpcrl/rollout/engine_auth.py (engine keys) is not there yet")

ROLLOUT = Path(__file__).resolve().parents[2] / "hpcrl" / "rollout"


@pytest.fixture(scope="module")
def sglang_auth(sglang_root):
    return load_file(sglang_root, "sglang/srt/utils/auth.py", "_sglang_auth")


@pytest.fixture(scope="module")
def sglang_levels(sglang_root) -> dict[str, str]:
    """{route path: auth level name} of SGLang's HTTP server (NORMAL when unmarked)."""
    tree = ast.parse((sglang_root / "src/sglang/srt/entrypoints/http_server.py").read_text())
    levels = {}
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        paths, level = [], "NORMAL"
        for dec in fn.decorator_list:
            if not isinstance(dec, ast.Call) or not isinstance(dec.func, (ast.Attribute, ast.Name)):
                continue
            name = dec.func.attr if isinstance(dec.func, ast.Attribute) else dec.func.id
            if name in ("get", "post", "put", "api_route") and dec.args and \
                    isinstance(dec.args[0], ast.Constant):
                paths.append(dec.args[0].value)
            elif name == "auth_level":
                level = dec.args[0].attr
        for p in paths:
            levels[p] = level
    assert levels.get("/generate") == "NORMAL" and levels.get("/update_weights_from_distributed")
    return levels


def test_route_levels_match_sglang(sglang_levels):
    named = set()
    for f in ("client.py", "reference_server.py", "engine_auth.py"):
        named |= set(re.findall(r'"(/[a-z_/]+)"', (ROLLOUT / f).read_text()))
    checked = sorted(p for p in named if p in sglang_levels)
    assert {"/generate", "/init_weights_update_group", "/begin_weight_update", "/pause_generation",
            "/release_memory_occupation", "/server_info"} <= set(checked), checked
    wrong = {p: (engine_auth.route_level(p).name, sglang_levels[p]) for p in checked
             if engine_auth.route_level(p).name != sglang_levels[p]}
    assert not wrong, f"route: (hpcrl, SGLang) levels differ: {wrong}"
    ours_only = sorted(p for p in engine_auth.ADMIN_ROUTES if p not in sglang_levels)
    assert all(p.startswith("/hpcrl/") for p in ours_only), ours_only


def test_decisions_match_sglang(sglang_auth):
    keys = [None, "k-api", "k-admin"]
    headers = [None, "Bearer k-api", "Bearer k-admin", "bearer k-admin", "Bearer wrong", "Basic k-api",
               "k-api"]
    paths = ["/generate", "/health", "/health_generate", "/metrics", "/update_weights_from_distributed"]
    n = 0
    grid = itertools.product(["GET", "POST", "OPTIONS"], paths, headers, keys[:2], [None, keys[2]],
                             list(engine_auth.AuthLevel))
    for method, path, header, api, admin, level in grid:
        want = sglang_auth.decide_request_auth(method=method, path=path, authorization_header=header,
                                               api_key=api, admin_api_key=admin,
                                               auth_level=sglang_auth.AuthLevel(level.value))
        allowed, status = engine_auth.decide_request_auth(method=method, path=path,
                                                          authorization_header=header, api_key=api,
                                                          admin_api_key=admin, auth_level=level)
        assert allowed == want.allowed, (method, path, header, api, admin, level)
        if not allowed:
            assert status == want.error_status_code, (method, path, header, api, admin, level)
        n += 1
    assert n > 1000
