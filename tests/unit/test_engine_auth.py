"""Per-job engine keys (hpcrl/rollout/engine_auth.py): SGLang 0.5.23's auth rules as a table; the key
file (0600, created once even by racing ranks); and a reference server started with --config: without
the key, or with a wrong one, /generate and the weight and memory routes are refused with 401 and
change nothing, /health stays open, the keys never appear on its command line, its log is
user-only, and a client holding the keys generates and pushes weights as before."""

from __future__ import annotations

import http.client
import json
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from hpcrl.models.presets import CONFIG_DIR
from hpcrl.rollout.client import EngineClient, EngineError, launch_reference_server
from hpcrl.rollout.engine_auth import (ADMIN_ROUTES, AuthLevel, EngineKeys, decide_request_auth, job_keys,
                                       keys_path, route_level)
from hpcrl.rollout.weight_sender import WeightSender
from launch.procs import stop as stop_process

pytestmark = pytest.mark.timeout(300)

CONFIG_PATH = CONFIG_DIR / "tiny-qwen3-moe.json"
GREEDY = {"temperature": 0, "max_new_tokens": 4, "ignore_eos": True}
N, A, F = AuthLevel.NORMAL, AuthLevel.ADMIN_OPTIONAL, AuthLevel.ADMIN_FORCE


@pytest.mark.parametrize(("level", "api", "admin", "header", "want"), [
    (N, None, None, None, (True, 401)),
    (N, "k", None, None, (False, 401)), (N, "k", None, "Bearer k", (True, 401)),
    (N, "k", None, "bearer k", (True, 401)), (N, "k", None, "Basic k", (False, 401)),
    (N, None, "a", None, (True, 401)),  # the admin key alone leaves ordinary routes open
    (N, "k", "a", "Bearer a", (False, 401)), (N, "k", "a", "Bearer k", (True, 401)),
    (A, None, None, None, (True, 401)), (A, "k", None, "Bearer k", (True, 401)),
    (A, "k", "a", "Bearer k", (False, 401)), (A, "k", "a", "Bearer a", (True, 401)),
    (A, None, "a", None, (False, 401)),
    (F, "k", None, "Bearer k", (False, 403)), (F, "k", "a", "Bearer a", (True, 401)),
])
def test_rules_are_sglangs(level, api, admin, header, want):
    got = decide_request_auth(method="POST", path="/x", authorization_header=header, api_key=api,
                              admin_api_key=admin, auth_level=level)
    assert got == want
    for path in ("/health", "/health_generate", "/metrics"):  # always open
        assert decide_request_auth(method="GET", path=path, authorization_header=None, api_key="k",
                                   admin_api_key="a", auth_level=level)[0]


def test_route_levels_and_the_clients_header():
    assert route_level("/generate") is N and route_level("/server_info") is N
    for path in ("/update_weights_from_distributed", "/begin_weight_update", "/release_memory_occupation",
                 "/pause_generation", "/hpcrl/update_weights_reshard"):
        assert route_level(path) is A and path in ADMIN_ROUTES
    keys = EngineKeys("k", "a")
    assert keys.header("/generate") == "Bearer k" and keys.header("/init_weights_update_group") == "Bearer a"


def test_job_keys_file_is_user_only_and_made_once(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", "import sys; from hpcrl.rollout.engine_auth import "
                               "job_keys; k = job_keys(sys.argv[1]); print(k.api_key, k.admin_api_key)",
                               str(tmp_path)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    answers = {p.communicate(timeout=120)[0] for p in procs}
    assert len(answers) == 1  # racing ranks all read the one file that won
    api, admin = answers.pop().split()
    assert api != admin and len(api) == 64 and int(api, 16) >= 0  # hex: never a leading "-"
    assert stat.S_IMODE(keys_path(tmp_path).stat().st_mode) == 0o600
    assert job_keys(tmp_path) == EngineKeys(api, admin)
    assert [p.name for p in tmp_path.iterdir()] == ["engine_keys.yaml"]  # no temporary file left


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    keys = job_keys(run_dir)
    log = run_dir / "engine.log"
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    proc, url = launch_reference_server(str(CONFIG_PATH), "cpu", 0, str(log), threads=1,
                                        config_path=str(keys_path(run_dir)))
    try:
        yield proc, url, keys, log
    finally:
        torch.set_num_threads(prev)
        stop_process(proc, 30)


def _raw(url: str, method: str, route: str, body: dict | None, header: str | None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    headers = {"Content-Type": "application/json", **({"Authorization": header} if header else {})}
    conn.request(method, route, body=None if body is None else json.dumps(body), headers=headers)
    resp = conn.getresponse()
    data = resp.read()
    conn.close()
    return resp.status, json.loads(data) if data else {}


def test_requests_without_the_right_key_are_refused_and_change_nothing(keyed_server):
    proc, url, keys, log = keyed_server
    owner = EngineClient(url, timeout_s=60, keys=keys)
    before = owner.generate([1, 5, 6], GREEDY)
    assert _raw(url, "GET", "/health", None, None)[0] == 200
    for header in (None, "Bearer wrong", f"Bearer {keys.admin_api_key}"):  # the admin key is not the API key
        assert _raw(url, "POST", "/generate", {"input_ids": [1, 5], "sampling_params": GREEDY}, header) \
            == (401, {"error": "Unauthorized"})
        assert _raw(url, "GET", "/server_info", None, header)[0] == 401
    weight_calls = [("/begin_weight_update", {}), ("/release_memory_occupation", {"tags": ["weights"]}),
                    ("/update_weights_from_distributed",
                     {"names": ["model.norm.weight"], "dtypes": ["float32"], "shapes": [[64]]}),
                    ("/init_weights_update_group", {"master_address": "127.0.0.1", "master_port": 1,
                                                    "rank_offset": 1, "world_size": 2}),
                    ("/update_weight_version", {"new_version": "stolen"}), ("/pause_generation", {})]
    for header in (None, "Bearer wrong", f"Bearer {keys.api_key}"):  # the API key is not the admin key
        for route, body in weight_calls:
            assert _raw(url, "POST", route, body, header) == (401, {"error": "Unauthorized"}), (route, header)
    stranger = EngineClient(url, timeout_s=10, keys=None)
    with pytest.raises(EngineError) as info:
        stranger.generate([1, 5, 6], GREEDY)
    assert info.value.status == 401
    assert info.value.message.startswith("Unauthorized: the engine wants the job's key (RUN_DIR/engine_keys")
    state = owner.server_info()
    assert state["weight_version"] == "default"
    assert state["internal_states"][0] == {"released_tags": [], "weight_update_session": False,
                                           "weight_update_groups": []}
    assert owner.generate([1, 5, 6], GREEDY)["output_ids"] == before["output_ids"]

    # the owner's client works as without keys: a weight push lands, versioned
    sender = WeightSender([owner], backend="gloo", timeout_s=60)
    sender.connect()
    try:
        sender.push([("model.norm.weight", torch.full((64,), 2.0))], bucket_bytes=1 << 20,
                    weight_version="v1")
    finally:
        sender.close()
    assert owner.server_info()["weight_version"] == "v1"
    assert owner.get_weights_by_name("model.norm.weight", truncate_size=3) == [2.0, 2.0, 2.0]

    cmdline = open(f"/proc/{proc.pid}/cmdline", "rb").read().decode()
    assert keys.api_key not in cmdline and keys.admin_api_key not in cmdline and "--config" in cmdline
    assert stat.S_IMODE(os.stat(log).st_mode) == 0o600


def test_timing_of_a_keyed_request_stays_a_header_check(keyed_server):
    """Keys add one header and one constant-time comparison per request, nothing measurable."""
    _, url, keys, _ = keyed_server
    keyed, plain = EngineClient(url, timeout_s=60, keys=keys), EngineClient(url, timeout_s=60, keys=None)
    for _ in range(20):
        keyed.request("GET", "/health")
    t0 = time.perf_counter()
    for _ in range(200):
        keyed.request("GET", "/get_weight_version")
    per_request = (time.perf_counter() - t0) / 200
    assert per_request < 0.02, per_request
    assert plain.health()


def test_reference_config_file_merges_like_sglangs(tmp_path):
    """--config options go before the command line's (which win), one argv item each, so a value
    that starts with "-" stays a value."""
    from hpcrl.rollout.reference_server import _with_config

    path = tmp_path / "c.yaml"
    path.write_text('api-key: "-k"\nadmin-api-key: "a"\nthreads: 2\nflag: true\noff: false\n')
    assert _with_config(["--port", "0", "--config", str(path), "--threads", "1"]) == [
        "--api-key=-k", "--admin-api-key=a", "--threads=2", "--flag", "--port", "0", "--threads", "1"]


def test_server_info_answers_the_keys_as_sglang_does_and_the_client_redacts_them(keyed_server):
    """SGLang 0.5.23's /server_info is every resolved server argument, both keys among them, to any
    holder of the API key (the reference engine answers the same); hpcrl's client hands nothing of
    them on."""
    _, url, keys, _ = keyed_server
    status, raw = _raw(url, "GET", "/server_info", None, f"Bearer {keys.api_key}")
    assert status == 200 and (raw["api_key"], raw["admin_api_key"]) == (keys.api_key, keys.admin_api_key)
    info = EngineClient(url, timeout_s=60, keys=keys).server_info()
    assert info["api_key"] == info["admin_api_key"] == "<redacted>"
    assert keys.api_key not in json.dumps(info) and keys.admin_api_key not in json.dumps(info)
    assert info["weight_version"] == raw["weight_version"]  # the rest is the answer as it came


def test_a_failed_start_reports_its_log_without_the_keys(tmp_path):
    """An engine that dies at start-up is reported with the end of its log, which stays in the run dir;
    SGLang prints its server arguments (the keys) there first, so the report redacts them."""
    keys = job_keys(tmp_path)
    log = tmp_path / "engine.log"
    log.write_text(f"server_args=ServerArgs(api_key='{keys.api_key}', admin_api_key='{keys.admin_api_key}')\n")
    with pytest.raises(RuntimeError) as info:
        launch_reference_server(str(tmp_path / "no-such-config.json"), "cpu", 0, str(log), threads=1,
                                config_path=str(keys_path(tmp_path)), startup_timeout_s=120)
    message = str(info.value)
    assert "exited with code" in message and f"log tail ({log})" in message and "<redacted>" in message
    assert keys.api_key not in message and keys.admin_api_key not in message
    assert keys.api_key in log.read_text()  # the log itself keeps what the engine wrote
