"""Body of a reward worker process (started by `hpcrl.rewards.pool.RewardPool`, spawn context).

Protocol over one duplex pipe: the worker sends ("ready", pid) once the reward is loaded and its
optional `warm_up()` has run (or
("failed", traceback) and exits); then for each chunk (start, items) it receives, it sends back
(start, scores, errors, seconds) with errors [(index, message)] and the chunk's scoring time; None or
a closed pipe ends it. Before each
item it writes (started_at, index) into the shared `progress` array (started_at 0.0 = not scoring),
which is how the pool finds the item that ran past its deadline without a message per item.
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

IDLE = 0.0
PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this worker when the controller dies, even inside C code that holds the GIL
    (closing the pipe only ends a worker that is reading it)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def serve(conn: Connection, spec: str, progress: Any, parent_pid: int) -> None:
    """Load `spec` and score chunks until told to stop (see the module docstring)."""
    _die_with_parent(parent_pid)
    # Preemption notices and Ctrl-C are the controller's to handle; it stops workers itself.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    try:
        from hpcrl.rewards.loader import load_reward_fn

        fn = load_reward_fn(spec)
        warm_up = getattr(fn, "warm_up", None)
        if callable(warm_up):
            warm_up()
    except BaseException:
        conn.send(("failed", traceback.format_exc(limit=-3)))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        start, items = msg
        scores, errors = [], []
        began = time.perf_counter()
        for k, (prompt, completion, answer, extra) in enumerate(items):
            progress[1] = start + k
            progress[0] = time.monotonic()
            score, error = score_item(fn, prompt, completion, answer, extra)
            if error is not None:
                errors.append((start + k, error))
            progress[0] = IDLE
            scores.append(score)
        conn.send((start, scores, errors, time.perf_counter() - began))


FLOAT32_MAX = 3.4028234663852886e38
"""Rewards travel as float32 (RewardPool's Scores): a larger magnitude would arrive as inf."""


def score_item(fn: Any, prompt: str, completion: str, answer: str, extra: Any) -> tuple[float, str | None]:
    """One completion's reward, or 0.0 and the error when the reward raises or returns a non-number
    (a string or a bool included: float() would take "0.5" and True), or one not finite in float32.
    A dict's "score" is its reward (verl's rule for compute_score results)."""
    try:
        raw = fn(prompt, completion, answer, extra)
        if isinstance(raw, dict) and "score" in raw:  # verl's reward functions may return {"score": ...}
            raw = raw["score"]
        if isinstance(raw, (str, bytes, bool)):
            raise TypeError(f"returned {raw!r} ({type(raw).__name__}), not a number")
        score = float(raw)
        if not math.isfinite(score) or abs(score) > FLOAT32_MAX:
            raise ValueError(f"returned {score}, not finite as a float32")
    except BaseException as exc:  # SystemExit too: a reward must not end the worker
        return 0.0, f"{type(exc).__name__}: {exc}"
    return score, None
