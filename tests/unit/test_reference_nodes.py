"""The reference engine over several nodes (hpcrl/rollout/reference_nodes.py), as real processes on
this host: node 0 serves nothing until every node has joined its rendezvous at --dist-init-addr; a
follower serves SGLang's three health routes only, ignores SIGTERM, and exits 0 when node 0 stops
and 1 when node 0 dies."""

from __future__ import annotations

import http.client
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcrl.dist import free_port
from hpcrl.models.presets import CONFIG_DIR
from hpcrl.rollout.client import EngineClient
from hpcrl.rollout.reference_nodes import FOLLOWER_ROUTES

pytestmark = pytest.mark.timeout(120)


def _start(tmp_path: Path, nnodes: int, node_rank: int, addr: str) -> tuple[subprocess.Popen, Path]:
    port_file = tmp_path / f"port{node_rank}"
    log = open(tmp_path / f"node{node_rank}.log", "w")  # noqa: SIM115 - the child holds it
    cmd = [sys.executable, "-m", "hpcrl.rollout.reference_server", "--model-config",
           str(CONFIG_DIR / "tiny-qwen3-moe.json"), "--port", "0", "--port-file", str(port_file),
           "--threads", "1", "--nnodes", str(nnodes), "--node-rank", str(node_rank), "--dist-init-addr", addr,
           "--dist-timeout-s", "60"]
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT), port_file


def _url(port_file: Path, proc: subprocess.Popen, timeout_s: float = 60) -> str:
    end = time.monotonic() + timeout_s
    while not port_file.exists():
        assert proc.poll() is None, f"exited with {proc.returncode}"
        assert time.monotonic() < end, "never listened"
        time.sleep(0.05)
    return f"http://127.0.0.1:{port_file.read_text()}"


def _get(url: str, route: str) -> int:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=10)
    try:
        conn.request("GET", route)
        return conn.getresponse().status
    finally:
        conn.close()


def _stop_all(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_node_0_waits_for_its_followers_which_serve_health_only_and_stop_with_it(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    leader, leader_port = _start(tmp_path, 3, 0, addr)
    first, first_port = _start(tmp_path, 3, 1, addr)
    procs = [leader, first]
    try:
        time.sleep(3)  # node 2 has not joined: node 0 must not listen yet
        assert not leader_port.exists() and leader.poll() is None, (tmp_path / "node0.log").read_text()
        second, second_port = _start(tmp_path, 3, 2, addr)
        procs.append(second)
        url, follower = _url(leader_port, leader), _url(first_port, first)
        client = EngineClient(url, timeout_s=30)
        client.wait_healthy(60)
        info = client.server_info()
        assert (info["nnodes"], info["node_rank"], info["dist_init_addr"]) == (3, 0, addr)
        assert client.request("POST", "/generate", {"input_ids": [[1, 2]], "sampling_params": [
            {"max_new_tokens": 2, "temperature": 0}]})[0]["output_ids"]
        for route in FOLLOWER_ROUTES:
            assert _get(follower, route) == 200, route
        for route in ("/generate", "/server_info", "/model_info"):  # node 0's alone
            assert _get(follower, route) == 404, route
        first.send_signal(signal.SIGTERM)  # SGLang's followers wait for node 0's word
        time.sleep(1)
        assert first.poll() is None and _get(follower, "/health") == 200
        leader.send_signal(signal.SIGTERM)
        assert [p.wait(timeout=30) for p in procs] == [0, 0, 0]
        for node in (1, 2):
            assert "stopped by node 0" in (tmp_path / f"node{node}.log").read_text()
    finally:
        _stop_all(procs)


def test_a_follower_whose_node_0_dies_exits_with_an_error(tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    leader, leader_port = _start(tmp_path, 2, 0, addr)
    follower, follower_port = _start(tmp_path, 2, 1, addr)
    try:
        _url(leader_port, leader), _url(follower_port, follower)
        leader.kill()
        assert follower.wait(timeout=30) == 1
        assert "lost node 0" in (tmp_path / "node1.log").read_text()
    finally:
        _stop_all([leader, follower])


@pytest.mark.parametrize("flags,says", [
    (["--nnodes", "2", "--node-rank", "2"], "give 0 <= node-rank < nnodes"),
    (["--nnodes", "2", "--node-rank", "1"], "--dist-init-addr HOST:PORT"),
    (["--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "nohost"],
     "--dist-init-addr 'nohost': give HOST:PORT"),
])
def test_bad_node_flags_are_refused_naming_them(flags, says):
    out = subprocess.run([sys.executable, "-m", "hpcrl.rollout.reference_server", "--model-config",
                          str(CONFIG_DIR / "tiny-qwen3-moe.json"), "--port", "0", *flags],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and says in out.stderr, out.stderr[-2000:]
