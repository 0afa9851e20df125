"""`kill -9` of an engine in the middle of `hpcrl run`, as a user's OOM killer would: the run stops,
and its headline names the dead engine (index, rollout rank, host, signal, pid, log) before the
consequence other ranks saw (a broken weight broadcast or a cut-off /generate), with no traceback.
Also checked on that run: the job's engine keys and the engine's log are user-only files."""

import json
import os
import signal
import stat
import subprocess
import sys
import time

import pytest

from e2e_util import EXAMPLE, REPO, leftover_processes

pytestmark = pytest.mark.e2e


def _wait_for(predicate, timeout_s: float, what: str, proc: subprocess.Popen) -> None:
    end = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"the run ended before {what}: {out[-2000:]}{err[-2000:]}")
        if time.monotonic() > end:
            proc.kill()
            pytest.fail(f"no {what} within {timeout_s} s")
        time.sleep(0.05)


def _steps_done(run_dir) -> int:
    path = run_dir / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.timeout(400)
@pytest.mark.parametrize("sync,node", [("shard", 0), ("broadcast", 0), ("broadcast", 1)],
                         ids=["shard", "broadcast", "follower-node"])
def test_engine_killed_mid_run_is_the_headline(tmp_path, sync, node):
    """node 1: the engines span two nodes (rollout.nodes_per_engine) and engine 1's follower node
    dies; its node 0 still answers, and the follower's rollout rank reports the death at the next
    heartbeat, as the headline without a consequence."""
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k != "HPCRL_FAULT"}
    args = ["run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", "algorithm.num_steps=500", "--set",
            "logging.progress=false", "--set", "rollout.num_engines=2",
            "--set", f"rollout.weight_sync={sync}", "--set", f"rollout.nodes_per_engine={1 + node}"]
    proc = subprocess.Popen([sys.executable, "-m", "hpcrl.cli", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    name = "engine1" + ("-node1" if node else "")
    try:
        record_path = run_dir / "logs" / f"{name}.json"
        _wait_for(lambda: record_path.exists() and _steps_done(run_dir) >= 2, 240, "second step", proc)
        record = json.loads(record_path.read_text())
        os.kill(record["pid"], signal.SIGKILL)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode != 0
    headline = next((line for line in err.splitlines() if line.startswith("hpcrl run failed")), "")
    who = "engine 1 node 1" if node else "engine 1"
    want = (f"hpcrl run failed: {who} (rollout rank {record['rank']}, host {record['host']}) died at ")
    assert headline.startswith(want), err[-3000:]
    assert (f": killed by signal SIGKILL (pid {record['pid']}, {record['url']}); "
            f"see RUN_DIR/logs/{name}.log") in headline, headline
    assert "Traceback" not in err and "Connection closed by peer" not in headline, err[-3000:]
    assert ("\n  then: " in err) != bool(node)  # a leader's consequence follows, one line
    assert not leftover_processes(str(run_dir))
    # per-job engine keys and the engine log are user-only
    assert stat.S_IMODE((run_dir / "engine_keys.yaml").stat().st_mode) == 0o600
    assert stat.S_IMODE((run_dir / "logs" / f"{name}.log").stat().st_mode) == 0o600
    keys = (run_dir / "engine_keys.yaml").read_text()
    assert "api-key: " in keys and "admin-api-key: " in keys
