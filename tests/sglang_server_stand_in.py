"""A stand-in SGLang engine for the shard route's trainer side on CPU: an HTTP server with `tp` TP
worker processes, each holding tests/sglang_stand_in.py's Qwen3-MoE model (SGLang's parameter names
and TP/EP shapes).

SGLang cannot run here (it needs a GPU build), so this is the smallest faithful copy of what the
shard route touches, read from SGLang 0.5.23's code:
- `/init_weights_update_group`: every TP worker joins the group as rank `rank_offset + tp_rank`
  with SGLang's arguments, no device_id (model_runner_components/weight_updater.py:100-139;
  tests/conformance/test_weight_group_join.py checks hpcrl's join against SGLang's);
- `/begin_weight_update` / `/end_weight_update`: one session, a second begin or an end without one
  is HTTP 400 with SGLang's message (managers/scheduler_components/weight_updater.py:309-337);
- `/update_weights_from_tensor`: refused outside a session (:231-236); else TP worker r takes
  `serialized_named_tensors[r]`, unpickles it and, when `load_format` is one of the server's
  `--custom-weight-loader`s, calls it as `loader(model, named_tensors)` (weight_updater.py:343-378);
  200 {"success": true} or 400 (http_server.py:1436-1455). A loader that raises ends the engine
  (SGLang's scheduler sends SIGQUIT to the server, managers/scheduler.py:6370-6373): here the
  server process exits with code 3.
`/stand_in/params` (not SGLang's) saves every TP worker's parameters for the test to compare.
"""

from __future__ import annotations

import base64
import importlib
import json
import os
import pickle
import threading
import traceback
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.multiprocessing as mp

from sglang_stand_in import full_tensors, sglang_params, stand_in_model


def _tp_worker(conn, r: int, tp: int, ep: int, cfg: dict) -> None:
    from hpcrl.rollout.reshard_route import spec_at_dtype
    from hpcrl.rollout.weight_sender import init_custom_process_group

    torch.set_num_threads(1)
    spec = spec_at_dtype(cfg, "float32")
    shapes = {n: t.shape for n, t in sglang_params(full_tensors(spec), spec.dims, r, tp, ep).items()}
    model = stand_in_model(cfg, shapes)
    groups = {}
    while True:
        op, args = conn.recv()
        try:
            if op == "init":
                host, port, rank, world, name, backend = args
                # SGLang's call (weight_updater.py), no device_id: an NCCL group would be made lazily
                groups[name] = init_custom_process_group(backend=backend, init_method=f"tcp://{host}:{port}",
                                                         world_size=world, rank=rank, group_name=name,
                                                         timeout_s=60)
            elif op == "destroy":
                torch.distributed.destroy_process_group(groups.pop(args))
            elif op == "load":
                loader, payload = args
                named = pickle.loads(base64.b64decode(payload))
                module, _, fn = loader.rpartition(".")
                getattr(importlib.import_module(module), fn)(model, [(n, t.to("cpu")) for n, t in named])
            elif op == "params":
                torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, args)
            conn.send((True, "Success"))
        except Exception as exc:  # noqa: BLE001 - the server decides what an error means
            conn.send((False, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


class StandInServer:
    """The engine process's state: its TP workers' pipes, the session flag, the loaders it accepts."""

    def __init__(self, tp: int, ep: int, cfg: dict, loaders: list[str]) -> None:
        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for r in range(tp):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=_tp_worker, args=(theirs, r, tp, ep, cfg), daemon=True)
            proc.start()
            self.pipes.append(mine)
            self.procs.append(proc)
        self.loaders, self.session, self.weight_version = loaders, False, "default"
        self.lock = threading.Lock()

    def on_workers(self, ops: list[tuple[str, object]]) -> list[tuple[bool, str]]:
        """One op per TP worker, all in flight at once (a receive is collective over them)."""
        for pipe, op in zip(self.pipes, ops):
            pipe.send(op)
        return [pipe.recv() for pipe in self.pipes]

    def handle(self, route: str, req: dict) -> tuple[int, dict]:
        tp = len(self.pipes)
        if route == "/init_weights_update_group":
            where, rest = (req["master_address"], req["master_port"]), (req["world_size"], req["group_name"],
                                                                         req.get("backend") or "nccl")
            answers = self.on_workers([("init", (*where, req["rank_offset"] + r, *rest)) for r in range(tp)])
            return _merge(answers, "Succeeded to initialize custom process group.")
        if route == "/destroy_weights_update_group":
            return _merge(self.on_workers([("destroy", req.get("group_name") or "weight_update_group")] * tp),
                          "Succeeded to destroy custom process group.")
        if route == "/begin_weight_update":
            with self.lock:
                if self.session:
                    return 400, {"success": False, "message": "a weight-update session is already open; "
                                                              "call end_weight_update() first"}
                self.session = True
            return 200, {"success": True, "message": "Success"}
        if route == "/end_weight_update":
            with self.lock:
                if not self.session:
                    return 400, {"success": False, "message": "no weight-update session is open; call "
                                                              "begin_weight_update() first"}
                self.session = False
            return 200, {"success": True, "message": "Success"}
        if route == "/update_weights_from_tensor":
            if not self.session:
                return 400, {"success": False, "message": "update_weights_from_tensor must run between "
                                                          "begin_weight_update() and end_weight_update()"}
            loader = req.get("load_format")
            if loader not in self.loaders:
                return 400, {"success": False, "message": f"load_format {loader!r} is not a custom loader"}
            payloads = req["serialized_named_tensors"]
            answers = self.on_workers([("load", (loader, payloads[r])) for r in range(tp)])
            if not all(ok for ok, _ in answers):  # SGLang: the scheduler dies, then the server
                print("loader failed:", [m for ok, m in answers if not ok][0], flush=True)
                os._exit(3)
            if req.get("weight_version") is not None:
                self.weight_version = str(req["weight_version"])
            return 200, {"success": True, "message": "Success"}
        if route == "/stand_in/params":
            return _merge(self.on_workers([("params", f"{req['dir']}/tp{r}.pt") for r in range(tp)]), "saved")
        if route == "/server_info":
            return 200, {"weight_version": self.weight_version, "weight_update_session": self.session}
        return 404, {"success": False, "message": f"no route {route}"}


def _merge(answers: list[tuple[bool, str]], ok: str) -> tuple[int, dict]:
    bad = [m for good, m in answers if not good]
    return (400, {"success": False, "message": bad[0]}) if bad else (200, {"success": True, "message": ok})


def serve(tp: int, ep: int, cfg: dict, loaders: list[str], port_queue) -> None:
    """The engine process: start the TP workers, then answer HTTP on 127.0.0.1 (its port goes to
    `port_queue`) until killed."""
    state = StandInServer(tp, ep, cfg, loaders)

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:
            pass

        def _answer(self, status: int, obj: dict) -> None:
            data = json.dumps(obj).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer(*(state.handle(self.path, {}) if self.path != "/health" else (200, {})))

        def do_POST(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            self._answer(*state.handle(self.path, json.loads(self.rfile.read(n) or b"{}")))

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    port_queue.put(server.server_address[1])
    server.serve_forever()
