"""An engine over several nodes (rollout.nodes_per_engine) against SGLang 0.5.23's code: what a
follower node serves (the reference engine's followers, hpcrl/rollout/reference_nodes.py, serve the
same routes), that it waits out SIGTERM for node 0, and the TP split over nodes that hpcrl's
validation requires. Read by AST from the wheel: these run at SGLang's start, on GPUs."""

from __future__ import annotations

import ast
from pathlib import Path

from hpcrl.rollout.reference_nodes import FOLLOWER_ROUTES


def _function(path: Path, name: str) -> ast.FunctionDef:
    tree = ast.parse(path.read_text())
    return next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)


def test_a_follower_serves_sglangs_health_routes(sglang_root):
    """launch_dummy_health_check_server (srt/utils/common.py): GET routes, each answering a bare
    Response(status_code=200)."""
    fn = _function(sglang_root / "src" / "sglang" / "srt" / "utils" / "common.py",
                   "launch_dummy_health_check_server")
    routes = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.AsyncFunctionDef):
            (deco,) = node.decorator_list
            assert isinstance(deco, ast.Call) and ast.unparse(deco.func) == "app.get", ast.unparse(deco)
            routes[deco.args[0].value] = ast.unparse(node.body[-1])
    assert tuple(routes) == FOLLOWER_ROUTES
    assert set(routes.values()) == {"return Response(status_code=200)"}, routes


def test_a_follower_starts_that_server_and_waits_out_sigterm(sglang_root):
    """Engine._launch_subprocesses (srt/entrypoints/engine.py): on node_rank >= 1, a SIGTERM handler
    that only logs, then the health server, then a wait for the schedulers (which node 0 stops)."""
    srt = sglang_root / "src" / "sglang" / "srt"
    fn = _function(srt / "entrypoints" / "engine.py", "_launch_subprocesses")
    branch = next(n for n in ast.walk(fn) if isinstance(n, ast.If)
                  and ast.unparse(n.test) == "get_parallel().node_rank >= 1")
    text = ast.unparse(branch)
    handler = next(n for n in ast.walk(branch)
                   if isinstance(n, ast.FunctionDef) and n.name == "sigterm_handler")
    assert [type(s).__name__ for s in handler.body] == ["Expr"]  # logger.warning(...), nothing else
    assert "signal.signal(signal.SIGTERM, sigterm_handler)" in text
    assert text.index("launch_dummy_health_check_server(") < text.index("block_until_scheduler_exits()")


def test_sglang_splits_an_engines_tp_evenly_over_its_nodes(sglang_root):
    """check_server_args (srt/arg_groups/validation_hook.py): (tp_size * pp_size) % nnodes == 0,
    which hpcrl's validation asks of tp_per_engine (no pipeline parallelism in hpcrl's engines)."""
    fn = _function(sglang_root / "src" / "sglang" / "srt" / "arg_groups" / "validation_hook.py",
                   "check_server_args")
    asserts = [ast.unparse(n.test) for n in ast.walk(fn) if isinstance(n, ast.Assert)]
    assert "cfg.tp_size * cfg.pp_size % cfg.nnodes == 0" in asserts, asserts


def test_the_rendezvous_block_covers_sglangs_derived_ports(sglang_root):
    """PortArgs.init_new (srt/server_args.py), DP attention over nodes: port_base = dist_init_port + 1
    and NUM_DERIVED_PORTS = 6 from it (without SGLang's Rust server), which hpcrl's node 0 rank finds
    free with the rendezvous port (hpcrl/rollout/worker.py engine_rendezvous)."""
    from hpcrl.rollout.worker import SGLANG_DIST_INIT_PORTS

    text = ast.unparse(_function(sglang_root / "src" / "sglang" / "srt" / "server_args.py", "init_new"))
    assert "NUM_DERIVED_PORTS = 6 if not is_rust_server else 6 + num_dp_ranks_of(cfg)" in text
    assert "port_base = dist_init_port + 1" in text
    assert SGLANG_DIST_INIT_PORTS == 1 + 6
