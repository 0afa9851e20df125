"""Reward worker pool: scores completions in `reward.num_workers` processes on the controller's node,
each completion under a deadline (`reward.timeout_s`).

    RewardPool.score(items) --chunks--> worker 0 ... worker W-1   (spawned once, reward loaded once)
            ^                                  | (start, scores, errors) per chunk
            +----------------------------------+
            deadline watch: shared (started_at, index) per worker, read only when a wait times out

Contract: `score` returns one reward per item, in item order, equal to calling the reward in this
process (float, then float32). An item whose reward raises, returns a non-number or NaN, or runs
past `timeout_s` scores 0 and is listed in `Scores.errors`. A worker that hangs (also in C code
that ignores signals) is killed with SIGKILL and replaced; a worker that dies is replaced; the rest
of its chunk is dispatched again. So `score` returns within about
`ceil(n / num_workers) * timeout_s` plus a worker start-up for each hang, whatever the reward does.

Workers are started with the spawn context (never fork: the controller is an MPI rank), die with
the controller (PR_SET_PDEATHSIG) and ignore SIGINT/SIGTERM/SIGUSR1/2 (the controller owns
shutdown and preemption); `close` stops them. Each worker has at most one chunk in flight, so
neither side can block on a full pipe while the other does.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from hpcrl.rewards._worker import IDLE, serve

RewardItem = tuple[str, str, str, dict[str, Any]]
"""(prompt, completion, answer, extra) of one completion."""

CHUNKS_PER_WORKER = 2
"""Chunks per worker and call: few messages, yet a worker killed mid-chunk loses little work."""


class RewardPoolError(RuntimeError):
    """The pool cannot score at all: the reward does not load in a worker, or workers do not start."""


@dataclass(frozen=True)
class Scores:
    """Rewards in item order (float32) and the items that scored 0 on an error: index -> message."""

    rewards: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def num_errors(self) -> int:
        return len(self.errors)


@dataclass
class _Slot:
    proc: Any
    conn: Connection
    progress: Any  # shared doubles [started_at (IDLE: not scoring), index]
    spawned_s: float
    ready: bool = False
    chunk: tuple[int, int] | None = None


class RewardPool:
    """`num_workers` processes that each load the reward `spec` once (see the module docstring)."""

    def __init__(self, spec: str, num_workers: int, timeout_s: float,
                 startup_timeout_s: float = 120.0) -> None:
        assert num_workers >= 1 and timeout_s > 0, (num_workers, timeout_s)
        self.spec, self.timeout_s, self.startup_timeout_s = spec, timeout_s, startup_timeout_s
        self._ctx = mp.get_context("spawn")
        self._slots = [self._spawn() for _ in range(num_workers)]
        self._failed_starts = 0
        atexit.register(self.close)  # runs before multiprocessing's own exit hook (registered earlier)

    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        progress = self._ctx.RawArray("d", 2)
        proc = self._ctx.Process(target=serve, args=(child, self.spec, progress, os.getpid()), daemon=True,
                                 name="hpcrl-reward")
        proc.start()
        child.close()
        return _Slot(proc, parent, progress, time.monotonic())

    def score(self, items: Sequence[RewardItem]) -> Scores:
        """Score every item (see the module docstring for the guarantees)."""
        n = len(items)
        rewards = np.zeros(n, dtype=np.float64)
        errors: dict[int, str] = {}
        size = max(1, -(-n // (CHUNKS_PER_WORKER * len(self._slots))))
        todo = deque((lo, min(lo + size, n)) for lo in range(0, n, size))
        orphaned: set[tuple[int, int]] = set()  # chunks that already lost a worker outside any item
        while todo or any(s.chunk for s in self._slots):
            for i, slot in enumerate(self._slots):
                if slot.ready and slot.chunk is None and todo:
                    slot.chunk = lo, hi = todo.popleft()
                    try:
                        slot.conn.send((lo, list(items[lo:hi])))
                    except OSError:
                        self._lose(i, todo, orphaned, errors, "its worker process died")
            busy = [s.conn for s in self._slots if s.chunk or not s.ready]
            for conn in wait(busy, timeout=self._wait_s()):
                i = next(k for k, s in enumerate(self._slots) if s.conn is conn)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._slots[i].proc.join(1.0)
                    code = self._slots[i].proc.exitcode
                    self._lose(i, todo, orphaned, errors, f"its worker process exited (code {code})")
                    continue
                self._receive(i, msg, rewards, errors)
            self._enforce_deadlines(todo, orphaned, errors)
        return Scores(rewards.astype(np.float32), dict(sorted(errors.items())))

    def _receive(self, i: int, msg: tuple, rewards: np.ndarray, errors: dict[int, str]) -> None:
        slot = self._slots[i]
        if msg[0] == "ready":
            slot.ready = True
            self._failed_starts = 0
        elif msg[0] == "failed":
            self.close()
            raise RewardPoolError(f"reward.fn={self.spec!r} failed to load in a reward worker:\n{msg[1]}")
        else:
            start, scores, errs = msg
            rewards[start:start + len(scores)] = scores
            errors.update(errs)
            slot.chunk = None

    def _wait_s(self) -> float:
        """Seconds until the next deadline: an item's, or a starting worker's."""
        now = time.monotonic()
        deadlines = [s.spawned_s + self.startup_timeout_s for s in self._slots if not s.ready]
        for s in self._slots:
            if s.chunk:
                started = s.progress[0]
                deadlines.append(started + self.timeout_s if started != IDLE else now + self.timeout_s)
        return max(0.0, min(deadlines) - now + 1e-3) if deadlines else 0.0

    def _enforce_deadlines(self, todo: deque, orphaned: set, errors: dict[int, str]) -> None:
        now = time.monotonic()
        for i, s in enumerate(self._slots):
            if not s.ready and now - s.spawned_s > self.startup_timeout_s:
                self.close()
                raise RewardPoolError(f"a reward worker for reward.fn={self.spec!r} did not start within "
                                      f"{self.startup_timeout_s:.0f} s (importing the reward hangs?)")
            started = s.progress[0]
            if s.chunk and started != IDLE and now - started > self.timeout_s:
                self._lose(i, todo, orphaned, errors, f"timed out after {self.timeout_s:g} s (worker killed)")

    def _lose(self, i: int, todo: deque, orphaned: set, errors: dict[int, str], why: str) -> None:
        """Kill worker i and replace it; its item in progress scores 0 with `why`, the rest of its
        chunk goes back to the front of the queue."""
        slot = self._slots[i]
        started, index = slot.progress[0], int(slot.progress[1])
        slot.proc.kill()
        slot.proc.join(5.0)
        slot.conn.close()
        if not slot.ready:
            self._failed_starts += 1
            if self._failed_starts >= 3:
                self.close()
                raise RewardPoolError(f"reward workers for reward.fn={self.spec!r} die while starting "
                                      f"({why})")
        self._slots[i] = self._spawn()
        if slot.chunk is None:
            return
        lo, hi = slot.chunk
        if started != IDLE and lo <= index < hi:
            errors[index] = why
            todo.extendleft(c for c in ((index + 1, hi), (lo, index)) if c[1] > c[0])
        elif slot.chunk in orphaned:  # lost twice outside any item: give up on the chunk
            errors.update((k, why) for k in range(lo, hi))
        else:
            orphaned.add(slot.chunk)
            todo.appendleft(slot.chunk)

    def close(self) -> None:
        """Stop every worker (ask, then kill after a second). Idempotent."""
        atexit.unregister(self.close)
        slots, self._slots = self._slots, []
        for s in slots:
            try:
                s.conn.send(None)
            except OSError:
                pass
        for s in slots:
            s.proc.join(1.0)
            if s.proc.is_alive():
                s.proc.kill()
                s.proc.join(5.0)
            s.conn.close()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def score_in_process(fn: Any, items: Sequence[RewardItem]) -> np.ndarray:
    """The rewards `RewardPool.score` gives for well-behaved rewards, computed here (reference for tests)."""
    return np.array([float(fn(p, c, a, x)) for p, c, a, x in items], dtype=np.float32)
