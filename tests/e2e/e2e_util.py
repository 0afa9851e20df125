"""Helpers for end-to-end tests: run the real `hpcrl` CLI as a subprocess with a hard timeout."""

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"


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
