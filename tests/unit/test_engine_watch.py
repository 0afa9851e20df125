"""hpcrl/rollout/engine_watch.py without MPI: a rollout rank's record of its engine process, updated
the moment the engine dies unasked (signal or exit code, not when stopped on purpose), and the
controller's failure message with the dead engine first and the consequence in one line."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from hpcrl.dist import free_port
from hpcrl.rollout.engine_watch import EngineRecord, dead_engines_first, record_path

pytestmark = pytest.mark.timeout(60)

TRACE = ("rank 1 (trainer, host h, pid 7) failed in phase 'sync' of step 2:\n"
         "Traceback (most recent call last):\n"
         '  File "x.py", line 1, in f\nRuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242')


def _engine(tmp_path, code: str = "import time; time.sleep(60)", engine: int = 0):
    (tmp_path / "logs").mkdir(exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", code])
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens: the engine is unreachable once dead
    return proc, EngineRecord(tmp_path, engine, 2 + engine, socket.gethostname(), proc, url)


def _wait_exit(tmp_path, engine: int = 0) -> dict:
    end = time.monotonic() + 10
    while time.monotonic() < end:
        data = json.loads(record_path(tmp_path, engine).read_text())
        if "exit" in data:
            return data
        time.sleep(0.02)
    raise AssertionError("no exit recorded")


def test_a_killed_engine_is_recorded_and_named_first(tmp_path):
    proc, record = _engine(tmp_path)
    assert json.loads(record_path(tmp_path, 0).read_text())["pid"] == proc.pid and record.death() is None
    message = f"hpcrl run failed: {TRACE}"
    assert dead_engines_first(tmp_path, message, wait_s=0) == message  # alive: unchanged
    os.kill(proc.pid, signal.SIGKILL)
    data = _wait_exit(tmp_path)
    assert data["exit"]["signal"] == "SIGKILL" and record.death() is not None
    out = dead_engines_first(tmp_path, message)
    head, then = out.split("\n")
    assert head.startswith(f"hpcrl run failed: engine 0 (rollout rank 2, host {socket.gethostname()}) "
                           "died at ")
    assert head.endswith(f": killed by signal SIGKILL (pid {proc.pid}, {data['url']}); "
                         "see RUN_DIR/logs/engine0.log")
    assert then == ("  then: rank 1 (trainer, host h, pid 7) failed in phase 'sync' of step 2: "
                    "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:4242")
    # a rollout rank's heartbeat reported it: the death alone (it names the rank), not twice
    beat = (f"hpcrl run failed: rank 2 (rollout) failed in phase 'heartbeat' of step 3: EngineDied: "
            f"{record.death()}")
    assert dead_engines_first(tmp_path, beat) == f"hpcrl run failed: {record.death()}"
    assert dead_engines_first(tmp_path, out) == out  # the death first already


def test_exit_code_recorded_and_an_asked_stop_is_not_a_death(tmp_path):
    _, _ = _engine(tmp_path, "import sys; sys.exit(3)", engine=0)
    assert _wait_exit(tmp_path, 0)["exit"]["code"] == 3
    proc, record = _engine(tmp_path, engine=1)
    record.stop()
    proc.terminate()
    proc.wait()
    time.sleep(0.3)
    assert "exit" not in json.loads(record_path(tmp_path, 1).read_text())
    out = dead_engines_first(tmp_path, "hpcrl run failed: something", wait_s=0)
    assert "engine 0 (" in out and "exited with code 3" in out and "engine 1" not in out


def test_an_engine_gone_with_its_rank_is_not_waited_for(tmp_path):
    (tmp_path / "logs").mkdir()
    dead_rank = subprocess.Popen([sys.executable, "-c", "pass"])
    dead_rank.wait()
    url = f"http://127.0.0.1:{free_port()}"
    record_path(tmp_path, 0).write_text(json.dumps({
        "engine": 0, "rank": 2, "host": socket.gethostname(), "rank_pid": dead_rank.pid, "pid": 1,
        "url": url, "log": "RUN_DIR/logs/engine0.log"}))
    t0 = time.monotonic()
    assert dead_engines_first(tmp_path, "hpcrl run failed: rank 2 exited", wait_s=30) == \
        "hpcrl run failed: rank 2 exited"
    assert time.monotonic() - t0 < 5
    # a message of what the loss caused names the rank first (it appeared nowhere)
    push = ("hpcrl run failed: shard-to-shard weight push 1 failed: engine 0 (http://127.0.0.1:1): "
            "/hpcrl/update_weights_reshard failed (no HTTP answer): ConnectionRefusedError")
    head, then = dead_engines_first(tmp_path, push, wait_s=30).split("\n")
    assert head == (f"hpcrl run failed: rollout rank 2 (host {socket.gethostname()}, pid {dead_rank.pid}) is gone, "
                    f"and its engine 0 ({url}) with it"), head
    assert then.startswith("  then: shard-to-shard weight push 1 failed")


def test_records_of_an_earlier_attempt_are_ignored(tmp_path):
    proc, _ = _engine(tmp_path)
    os.kill(proc.pid, signal.SIGKILL)
    _wait_exit(tmp_path)
    old = time.time() - 3600
    os.utime(record_path(tmp_path, 0), (old, old))  # written before this (controller) process began
    assert dead_engines_first(tmp_path, "hpcrl run failed: x", wait_s=0) == "hpcrl run failed: x"
