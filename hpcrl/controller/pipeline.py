"""The generation pipeline: which policy version samples which prompt block, and the rollouts sampled
ahead of the trainer (rollout.max_staleness, asynchronous RL).

Versions: version v is the policy after v optimizer steps; the engines hold v from the weight push
at the end of step v - 1 (the initial push gives 0). Every `take` (one `rl.generate()`) hands out
the oldest started request (or starts one and waits for it when none is); right after each push
(`fill`), the pipeline starts requests until k + 1 are waiting to be taken, each sampled by the
version just pushed (none for steps past the run's last). With one generate per step, step s
therefore trains on block s sampled by version max(0, s - k): which version samples which block is
a function of the step, never of timing. A weight push waits for the requests in flight (SGLang's
update takes its model-update writer lock, which every /generate holds as a reader), so a request
never spans two versions; the engines' answers say which version sampled them (meta_info
weight_version), and `take` checks it against the schedule. Before each push the controller
collects every started request (`collect_started`): a push must wait for them anyway, and a
request written on one connection may reach its engine after a push written later on another
(it would then be sampled by the newer version), so waiting for the answers is what makes the
schedule hold.

k = 0 is the synchronous loop: `take` starts the step's request and waits for it.

Exact resume: the requests started and not yet trained on by a completed step are the pipeline's
state (`to_bytes`), saved in every checkpoint with the prompt cursor that is past them; a resume
takes them from there instead of sampling their blocks again by a version it no longer has. A
request older than `max_staleness` when taken (only after a resume with a smaller k) is dropped,
counted, and its block sampled again by the current version: no prompt is skipped or repeated.
"""

from __future__ import annotations

import io
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hpcrl.controller.groups import GenerateRequest, PendingRollout, Rollout, RolloutGroup

BUFFER_BLOB = "rollout_buffer"
"""The checkpoint blob (trainer rank 0's) holding the pipeline's state."""


@dataclass
class Flight:
    """One generation request: prompt block `block` sampled by policy `version`."""

    block: int
    version: int
    pending: PendingRollout | None = None
    rollout: Rollout | None = None
    started_at: float = 0.0  # perf_counter when it was written to the engines


class GenerationPipeline:
    def __init__(self, rollouts: RolloutGroup, request_of: Callable[[int], GenerateRequest],
                 take_block: Callable[[], int], max_staleness: int, num_steps: int,
                 while_waiting: Callable[[], None] = lambda: None) -> None:
        self.rollouts, self.request_of, self.take_block = rollouts, request_of, take_block
        self.while_waiting = while_waiting  # runs after the requests are written, before an answer is read
        self.max_staleness, self.num_steps = max_staleness, num_steps
        self.version = 0
        """The policy version the engines hold (set after each weight push)."""
        self._ahead: deque[Flight] = deque()  # started, not taken, oldest first
        self._taken: list[Flight] = []  # taken by the step in progress
        self.busy: list[tuple[float, float]] = []  # (start, end) of the engines' requests this step

    def take(self, step: int) -> tuple[Rollout, Flight, int]:
        """The next rollout, its flight and how many stale requests were dropped first; keeps
        `max_staleness` requests started behind it."""
        dropped = 0
        while True:
            flight = self._ahead.popleft() if self._ahead else self._start(self.take_block(), step)
            if step - flight.version <= self.max_staleness:
                break
            dropped += 1  # sampled too long ago: sample its block again, first in line
            self._ahead.appendleft(self._start(flight.block, step))
        self._taken.append(flight)
        if flight.rollout is None:
            self.while_waiting()
        return self._collect(flight), flight, dropped

    def fill(self, next_step: int) -> None:
        """After a weight push (the engines hold `self.version`, nothing in flight): start requests
        until k + 1 wait to be taken, none for steps past the run's last (k = 0: none)."""
        if not self.max_staleness:
            return
        while len(self._ahead) < min(self.max_staleness + 1, self.num_steps - next_step):
            self._ahead.append(self._start(self.take_block(), next_step))

    def collect_started(self) -> None:
        """Wait for every started request's answer (before a weight push)."""
        for flight in self._ahead:
            self._collect(flight)

    def busy_seconds(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which the engines had a request of the pipeline (the
        union of the collected requests' spans; the ones whose answers arrived are collected first)."""
        for flight in self._ahead:
            if flight.pending is not None and all(a.ready() for _, a in flight.pending.answers):
                self._collect(flight)
        self.busy = [(a, b) for a, b in self.busy if b > start]  # older spans count no more
        spans = sorted((max(a, start), min(b, end)) for a, b in self.busy if a < end)
        total, reach = 0.0, start
        for a, b in spans:
            total += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        return total

    def step_done(self) -> None:
        """The step in progress completed: what it took is no longer state."""
        self._taken = []

    def _start(self, block: int, step: int) -> Flight:
        pending = self.rollouts.start(step, self.request_of(block))
        return Flight(block, self.version, pending, started_at=time.perf_counter())

    def _collect(self, flight: Flight) -> Rollout:
        if flight.rollout is None:
            rollout = self.rollouts.collect(flight.pending)
            got = sorted(set(rollout.versions))
            # the schedule's invariant (asynchronous runs): no push overtook a started request. A
            # synchronous run leaves a wrong or missing push to the sync check, which names it.
            if self.max_staleness and got != [flight.version]:
                raise RuntimeError(f"prompt block {flight.block}: the engines sampled it with policy versions "
                                   f"{got}, the pipeline started it under version {flight.version}")
            self.busy.append((flight.started_at, flight.started_at + flight.pending.latency_s))
            flight.rollout, flight.pending = rollout, None
        return flight.rollout

    # -- checkpoint state ---------------------------------------------------------------------------

    def to_bytes(self) -> bytes | None:
        """The requests not trained on by a completed step (collected first), or None if none."""
        flights = [*self._taken, *self._ahead]
        if not flights:
            return None
        rollouts = [self._collect(f) for f in flights]
        arrays: dict[str, np.ndarray] = {}
        meta = {"format": "hpcrl-rollout-buffer-1", "flights": []}
        for i, (f, r) in enumerate(zip(flights, rollouts)):
            meta["flights"].append({"block": f.block, "version": f.version, "finish_reasons": r.finish_reasons,
                                    "routes": r.routes is not None})
            arrays[f"{i}/prompt"], arrays[f"{i}/prompt_len"] = _ragged(r.prompt_ids, np.int64)
            arrays[f"{i}/response"], arrays[f"{i}/response_len"] = _ragged(r.response_ids, np.int64)
            arrays[f"{i}/logprobs"], _ = _ragged(r.engine_logprobs, np.float64)
            if r.routes is not None:
                arrays[f"{i}/routes"] = np.concatenate([x.reshape(-1, *x.shape[1:]) for x in r.routes])
                arrays[f"{i}/routes_len"] = np.array([len(x) for x in r.routes], np.int64)
        out = io.BytesIO()
        np.savez(out, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        return out.getvalue()

    def restore(self, data: bytes) -> None:
        """Take the saved requests back as started ones, in order."""
        with np.load(io.BytesIO(data)) as z:
            meta = json.loads(z["meta"].tobytes())
            for i, f in enumerate(meta["flights"]):
                request = self.request_of(f["block"])
                routes = None
                if f["routes"]:
                    routes = np.split(z[f"{i}/routes"], np.cumsum(z[f"{i}/routes_len"])[:-1])
                rollout = Rollout(request.examples, _unragged(z[f"{i}/prompt"], z[f"{i}/prompt_len"]),
                                  _unragged(z[f"{i}/response"], z[f"{i}/response_len"]),
                                  _unragged(z[f"{i}/logprobs"], z[f"{i}/response_len"]), f["finish_reasons"],
                                  routes, versions=[f["version"]] * len(f["finish_reasons"]))
                self._ahead.append(Flight(f["block"], f["version"], rollout=rollout))


def _ragged(rows: list[list], dtype) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, rows), np.int64, count=len(rows))
    flat = np.fromiter((x for row in rows for x in row), dtype, count=int(lens.sum()))
    return flat, lens


def _unragged(flat: np.ndarray, lens: np.ndarray) -> list[list]:
    return [part.tolist() for part in np.split(flat, np.cumsum(lens)[:-1])] if len(lens) else []
