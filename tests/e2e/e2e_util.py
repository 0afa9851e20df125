"""Helpers for end-to-end tests: run the real `hpcrl` CLI as a subprocess with a hard timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
DEEPSEEK_EXAMPLE = REPO / "examples" / "tiny_deepseek_v3_grpo.yaml"


def hpcrl(*args: str, timeout_s: float = 600, env_extra: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ)
    env.pop("HPCRL_FAULT", None)
    env.update(env_extra or {})
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], cwd=REPO, env=env, capture_output=True,
                         text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    return out, time.monotonic() - t0


def leftover_processes(marker: str) -> list[str]:
    """Command lines of live processes that mention `marker` (the run dir), after a short grace."""
    time.sleep(1.0)
    found = []
    for p in psutil.process_iter(["cmdline", "status"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if marker in cmd and p.info["status"] != psutil.STATUS_ZOMBIE:
            found.append(cmd)
    return found


def start_run(run_dir: Path, *args: str, example: Path = EXAMPLE, env_extra: dict | None = None) -> subprocess.Popen:
    """`hpcrl run example --run-dir run_dir ARGS` in the background (its own session; stdout and
    stderr together, text)."""
    env = dict(os.environ)
    env.pop("HPCRL_FAULT", None)
    env.update(env_extra or {})
    return subprocess.Popen([sys.executable, "-m", "hpcrl.cli", "run", str(example), "--run-dir", str(run_dir),
                             *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def wait_for_step(proc: subprocess.Popen, run_dir: Path, steps: int, timeout_s: float = 400) -> None:
    """Wait until the run's metrics.jsonl holds `steps` records (the run must stay alive)."""
    deadline = time.monotonic() + timeout_s
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        assert proc.poll() is None, proc.communicate()[0][-2000:]
        time.sleep(0.1)
    raise AssertionError(f"run did not reach {steps} steps")


def kill_everything(proc: subprocess.Popen, run_dir: Path) -> None:
    """kill -9 at once, as a node failure would, the run `start_run` began: launcher, mpiexec, ranks,
    engines (every process whose command line names the run dir); then wait for the launcher."""
    import signal

    victims = [proc.pid] + [p.pid for p in psutil.process_iter(["cmdline"])
                            if str(run_dir) in " ".join(p.info["cmdline"] or [])]
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.communicate(timeout=60)


def preempt_then_resume(run_dir: Path, args: list[str], at_step: int, timeout_s: float = 400) -> None:
    """Run the example, send SIGUSR1 once `at_step` steps are done (it checkpoints and exits for
    requeue), then run it again: it must resume from that checkpoint and finish."""
    import signal

    from launch.result import REQUEUE_EXIT_CODE

    proc = start_run(run_dir, *args)
    wait_for_step(proc, run_dir, at_step)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    resumed, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *args, timeout_s=timeout_s)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from checkpoint step" in resumed.stdout
