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
`(ceil(n / num_workers) + 1) * timeout_s` plus a worker start-up for each hang, whatever the reward
does.

Workers are started with the spawn context (never fork: the controller is an MPI rank), die with
the controller (PR_SET_PDEATHSIG) and ignore SIGINT/SIGTERM/SIGUSR1/2 (the controller owns
shutdown and preemption); `close` stops them. Each worker has at most one chunk in flight, so
neither side can block on a full pipe while the other does.

`reward_scorer` gives the pool, or for the built-ins of INLINE_REWARDS an `InlineRewards` with the
same `score` contract that scores in the calling process, without workers.

A call is cut into CHUNKS_PER_WORKER chunks per worker, except when the workers' measured time per
item says the whole call scores in under SPREAD_MIN_S: then it is one chunk for one worker, since a
second worker's wake-up and answer cost more than they save (a cheap reward on a small batch, as
the tiny example's). A lost worker resets that measure, and the rest of its chunk is spread again.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

import numpy as np

from hpcrl.rewards._worker import IDLE, score_item, serve
from hpcrl.rewards.builtin import BUILTIN_REWARDS

RewardItem = tuple[str, str, str, dict[str, Any]]
"""(prompt, completion, answer, extra) of one completion."""

CHUNKS_PER_WORKER = 2
"""Chunks per worker and call: few messages, yet a worker killed mid-chunk loses little work."""

SPREAD_MIN_S = 2e-3
"""A call whose items the workers' measured cost puts under this much scoring in all goes to one
worker as one chunk: waking and answering a second worker costs ~0.5 ms more on 2 busy cores
(benchmarks/RESULTS.md, small_kernels), more than it can save there."""

POLL_S = 0.25
"""How often `score`'s wait runs its `poll` (the controller's preemption poll) at least."""


INLINE_REWARDS = frozenset({"exact_match", "token_match"})
"""Built-ins scored in the calling process: comparisons of two strings, bounded by their lengths, that
can neither hang nor take the process down, so a worker's deadline and isolation buy nothing there,
and its wake-up costs more than the scoring (tiny example: 0.1 against 0.5-0.9 ms a step)."""


class RewardPoolError(RuntimeError):
    """The pool cannot score at all: the reward does not load in a worker, or workers do not start."""


class RewardFailing(RuntimeError):
    """The reward failed on every completion of `reward.max_failed_steps` steps in a row: the run
    stops (exit 2), since the policy learns nothing from such steps (a bug in the reward, a verifier
    that is down)."""


@dataclass(frozen=True)
class Scores:
    """Rewards in item order (float32) and the items that scored 0 on an error: index -> message."""

    rewards: np.ndarray
    errors: dict[int, str] = field(default_factory=dict)

    @property
    def num_errors(self) -> int:
        return len(self.errors)

    def report(self, where: str, fn: str, what: str = "completions") -> None:
        """Print the first error, if any, naming the reward and how many of the items failed."""
        if self.errors:
            index, message = self.first_error()
            print(f"hpcrl: {where}: reward.fn={fn!r} failed on {self.num_errors} of {len(self.rewards)} "
                  f"{what} (scored 0); first, completion {index}: {message}", flush=True)

    def first_error(self) -> tuple[int, str]:
        return next(iter(self.errors.items()))

    @property
    def all_failed(self) -> bool:
        return self.rewards.size > 0 and self.num_errors == self.rewards.size


class FailedSteps:
    """Counts the steps in a row whose every completion's reward failed (a step of several scorings,
    dapo's rounds, fails when all of them did; one success ends the row) and raises RewardFailing
    when it reaches `limit` (0: never)."""

    def __init__(self, fn: str, limit: int) -> None:
        self.fn, self.limit = fn, limit
        self.steps: list[int] = []
        self._scored_step: int | None = None  # the last step with a reward that did not fail

    def add(self, step: int, scores: Scores) -> None:
        if not scores.all_failed:
            self.steps.clear()  # in place: the checkpointer saves this list
            self._scored_step = step
            return
        if step == self._scored_step:
            return  # an earlier round of this step was scored
        if not self.steps or self.steps[-1] != step:
            self.steps.append(step)
        if self.limit and len(self.steps) >= self.limit:
            index, message = scores.first_error()
            which = f"step {step}" if len(self.steps) == 1 else \
                f"{len(self.steps)} steps in a row (steps {self.steps[0]} to {step})"
            raise RewardFailing(
                f"reward.fn={self.fn!r} failed on every completion of {which} (all scored 0: the policy "
                f"learns nothing from them); step {step}'s first error, completion {index}: {message}. Fix "
                "the reward (or set reward.max_failed_steps: 0 to go on)")


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
        self._item_s: float | None = None  # seconds per item in the workers (running mean); None: unknown
        atexit.register(self.close)  # runs before multiprocessing's own exit hook (registered earlier)

    def _spawn(self) -> _Slot:
        parent, child = self._ctx.Pipe()
        progress = self._ctx.RawArray("d", 2)
        proc = self._ctx.Process(target=serve, args=(child, self.spec, progress, os.getpid()), daemon=True,
                                 name="hpcrl-reward")
        proc.start()
        child.close()
        return _Slot(proc, parent, progress, time.monotonic())

    def score(self, items: Sequence[RewardItem], poll: Callable[[], None] | None = None) -> Scores:
        """Score every item (see the module docstring for the guarantees). `poll` runs at least every
        POLL_S seconds while workers score (the controller's preemption poll); what it raises ends
        the call, the workers' chunks then lost with them at `close`."""
        n = len(items)
        rewards = np.zeros(n, dtype=np.float64)
        errors: dict[int, str] = {}
        size = max(1, -(-n // self._chunks(n)))
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
            if poll is not None:
                poll()
            for conn in wait(busy, timeout=self._wait_s() if poll is None else min(self._wait_s(), POLL_S)):
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

    def _chunks(self, n: int) -> int:
        """Chunks for a call of n items: CHUNKS_PER_WORKER per worker, or one when the workers' cost
        so far says the call is cheaper than SPREAD_MIN_S."""
        if self._item_s is not None and self._item_s * n < SPREAD_MIN_S:
            return 1
        return CHUNKS_PER_WORKER * len(self._slots)

    def _receive(self, i: int, msg: tuple, rewards: np.ndarray, errors: dict[int, str]) -> None:
        slot = self._slots[i]
        if msg[0] == "ready":
            slot.ready = True
            self._failed_starts = 0
        elif msg[0] == "failed":
            self.close()
            raise RewardPoolError(f"reward.fn={self.spec!r} failed to load in a reward worker:\n{msg[1]}")
        else:
            start, scores, errs, seconds = msg
            rewards[start:start + len(scores)] = scores
            errors.update(errs)
            slot.chunk = None
            if scores:
                per_item = seconds / len(scores)
                self._item_s = per_item if self._item_s is None else (self._item_s + per_item) / 2

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
        self._item_s = None  # a hang or a crash: spread the rest over every worker again
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
            rest = -(-(hi - index - 1) // len(self._slots))  # the rest of the chunk, over every worker
            pieces = [(lo, index), *((a, min(a + rest, hi)) for a in range(index + 1, hi, max(rest, 1)))]
            todo.extendleft(reversed([c for c in pieces if c[1] > c[0]]))
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


class InlineRewards:
    """`RewardPool.score`'s contract for a reward of INLINE_REWARDS, scored in this process."""

    def __init__(self, spec: str) -> None:
        assert spec in INLINE_REWARDS, spec
        self.spec, self._fn = spec, BUILTIN_REWARDS[spec]

    def score(self, items: Sequence[RewardItem], poll: Callable[[], None] | None = None) -> Scores:
        scored = [score_item(self._fn, *item) for item in items]
        return Scores(np.array([s for s, _ in scored], dtype=np.float32),
                      {i: e for i, (_, e) in enumerate(scored) if e is not None})

    def close(self) -> None:
        """Nothing to stop (RewardPool's interface)."""


def reward_scorer(spec: str, num_workers: int, timeout_s: float) -> RewardPool | InlineRewards:
    """What scores `reward.fn`: InlineRewards for INLINE_REWARDS, else a RewardPool."""
    return InlineRewards(spec) if spec in INLINE_REWARDS else RewardPool(spec, num_workers, timeout_s)


def score_in_process(fn: Any, items: Sequence[RewardItem]) -> np.ndarray:
    """The rewards `RewardPool.score` gives for well-behaved rewards, computed here (reference for tests)."""
    return np.array([float(fn(p, c, a, x)) for p, c, a, x in items], dtype=np.float32)
