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

Partial rollouts (rollout.partial, k >= 2): a block is sampled by several versions, each adding at
most ceil(max_new_tokens / k) tokens to every completion before the next push, and the last
version before its step finishing it. Where a push cuts a completion is a token count, never a
matter of timing: each segment is a request of its own (prompt + the tokens so far, max_new_tokens
the segment's limit, a seed of its own), so the schedule stays a function of the step. Right after
a push, `fill` continues every cut completion with the version just pushed: the flight the step
after next will take (or a later one) by another bounded segment, the next step's to its end; a
flight taken while cut (only when a step takes more than one batch) is finished on the spot. A
flight whose last segment the current version sampled already (saved after the push that started
it) waits for the next push.
"""

from __future__ import annotations

import io
import json
import math
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from hpcrl.controller.groups import GenerateRequest, PendingRollout, Rollout, RolloutGroup

BUFFER_BLOB = "rollout_buffer"
"""The checkpoint blob (trainer rank 0's) holding the pipeline's state."""


@dataclass
class Flight:
    """Prompt block `block`'s completions, first sampled by policy `version`; with partial rollouts
    continued segment by segment (`segment_version` samples the latest)."""

    block: int
    version: int
    pending: PendingRollout | None = None  # the segment in flight
    rollout: Rollout | None = None  # the collected tokens
    started_at: float = 0.0  # perf_counter when the segment in flight was written to the engines
    request: GenerateRequest | None = None  # the block's prompts and sampling parameters
    segment_version: int = 0
    rows: list[int] | None = None  # the completions the segment in flight continues (None: all, the first)
    asked: list[int] = field(default_factory=list)  # the segment in flight's max_new_tokens, per row
    cut: list[int] = field(default_factory=list)  # completions a segment's limit cut, to be continued


class BufferMismatch(ValueError):
    """Saved rollouts that do not belong to the resumed job's prompts."""


class GenerationPipeline:
    def __init__(self, rollouts: RolloutGroup, request_of: Callable[[int], GenerateRequest],
                 take_block: Callable[[], int], max_staleness: int, num_steps: int,
                 while_waiting: Callable[[], None] = lambda: None, partial: bool = False) -> None:
        self.rollouts, self.request_of, self.take_block = rollouts, request_of, take_block
        self.while_waiting = while_waiting  # runs after the requests are written, before an answer is read
        self.max_staleness, self.num_steps = max_staleness, num_steps
        self.partial = partial and max_staleness >= 2  # rollout.partial: segments of several versions
        self.version = 0
        """The policy version the engines hold (set after each weight push)."""
        self._ahead: deque[Flight] = deque()  # started, not taken, oldest first
        self._taken: list[Flight] = []  # taken by the step in progress
        self._taken_step = -1  # the step that took them
        self.busy: list[tuple[float, float]] = []  # (start, end) of the engines' requests this step
        self.poll: Callable[[], None] | None = None
        """The checkpointer's preemption poll, run while `take` waits for the engines (the step's
        generation, which a preemption may abandon); no other wait of the pipeline runs it."""

    def take(self, step: int) -> tuple[Rollout, Flight, int]:
        """The next rollout, its flight and how many stale requests were dropped first; keeps
        `max_staleness` requests started behind it."""
        dropped = 0
        if step - self.version > self.max_staleness:  # a request started now would be stale too
            raise RuntimeError(f"step {step}: the engines hold policy version {self.version}, more than "
                               f"rollout.max_staleness={self.max_staleness} steps behind; an asynchronous run "
                               "needs a weight push (rl.sync_weights) every step")
        while True:
            flight = self._ahead.popleft() if self._ahead else self._start(self.take_block(), step)
            if step - flight.version <= self.max_staleness:
                break
            dropped += 1  # sampled too long ago: sample its block again, first in line
            self._ahead.appendleft(self._start(flight.block, step))
        self._taken.append(flight)
        self._taken_step = step
        if flight.pending is not None:
            self.while_waiting()
        self._collect(flight, self.poll)
        if flight.cut:  # taken before the version that was to finish it: the current one does
            self._continue(flight, step, bounded=False)
            self._collect(flight, self.poll)
        return flight.rollout, flight, dropped

    def fill(self, next_step: int) -> None:
        """After a weight push (the engines hold `self.version`, nothing in flight): continue the cut
        completions (partial rollouts), then start requests until k + 1 wait to be taken, none for
        steps past the run's last (k = 0: none). The flight at position i of the queue is taken
        i steps from now: a segment is bounded when a later push comes before that (i >= 2).

        A push collected late (an asynchronous run's, during step `next_step`: `needs_push`) finds
        the flights that step took already: they count as the queue's first."""
        if not self.max_staleness:
            return
        taken = len(self._taken) if self._taken_step == next_step else 0
        for i, flight in enumerate(self._ahead, start=taken):
            if flight.cut and flight.segment_version < self.version:
                self._continue(flight, next_step, bounded=i >= 2)
        while taken + len(self._ahead) < min(self.max_staleness + 1, self.num_steps - next_step):
            self._ahead.append(self._start(self.take_block(), next_step, bounded=taken + len(self._ahead) >= 2))

    def needs_push(self, step: int) -> bool:
        """Whether step `step`'s next `take` needs the weight push still in flight (its `fill`): when
        no flight waits, when the first is cut (partial rollouts: that version continues it) or was
        sampled too long ago."""
        return not self._ahead or bool(self._ahead[0].cut) or step - self._ahead[0].version > self.max_staleness

    def collect_started(self) -> None:
        """Wait for every started request's answer (before a weight push)."""
        for flight in self._ahead:
            self._collect(flight)

    def busy_seconds(self, start: float, end: float) -> float:
        """Seconds of [start, end] during which the engines had a request of the pipeline (the
        union of the collected requests' spans; the ones whose answers arrived are collected first)."""
        self._collect_answered(self._ahead)
        self.busy = [(a, b) for a, b in self.busy if b > start]  # older spans count no more
        spans = sorted((max(a, start), min(b, end)) for a, b in self.busy if a < end)
        total, reach = 0.0, start
        for a, b in spans:
            total += max(0.0, b - max(a, reach))
            reach = max(reach, b)
        return total

    def step_done(self, step: int, updated: bool) -> None:
        """Step `step` completed: what it took is no longer state. A synchronous step without a policy
        update (ppo's critic warmup) pushed nothing: the engines' policy is still the trainer's, the
        one the next step samples with (an asynchronous run pushes every step: validation)."""
        self._taken = []
        if not updated and not self.max_staleness:
            self.version = step + 1

    def _start(self, block: int, step: int, bounded: bool = False) -> Flight:
        """Block `block`'s first segment (all of it unless `bounded`, partial rollouts)."""
        request = self.request_of(block)
        flight = Flight(block, self.version, request=request)
        rows = range(len(request.prompt_ids))
        if bounded and self.partial:
            self._send(flight, step, None, [self._segment_limit(flight, row) for row in rows])
        else:
            flight.asked = [p["max_new_tokens"] for p in request.sampling_params or []]
            self._write(flight, step, request)
        return flight

    def _continue(self, flight: Flight, step: int, bounded: bool) -> None:
        """The cut completions' next segment, by the current version (to their end unless `bounded`)."""
        rows, flight.cut = flight.cut, []
        self._send(flight, step, rows, [self._segment_limit(flight, row) if bounded else self._left(flight, row)
                                        for row in rows])

    def _send(self, flight: Flight, step: int, rows: list[int] | None, asked: list[int]) -> None:
        """A segment: completions `rows` (None: all, from their prompts) continued by up to `asked` tokens."""
        request, done = flight.request, flight.rollout
        picked = range(len(request.prompt_ids)) if rows is None else rows
        prompts = [request.prompt_ids[row] + (done.response_ids[row] if rows is not None else []) for row in picked]
        params = [{**request.sampling_params[row], "max_new_tokens": n,
                   "sampling_seed": segment_seed(request.sampling_params[row]["sampling_seed"], len(prompt)
                                                 - len(request.prompt_ids[row]))}
                  for row, n, prompt in zip(picked, asked, prompts)]
        flight.rows, flight.asked = rows, asked
        self._write(flight, step, self.rollouts.prepare([request.examples[row] for row in picked], prompts, params))

    def _write(self, flight: Flight, step: int, request: GenerateRequest) -> None:
        flight.pending = self.rollouts.start(step, request)
        flight.segment_version, flight.started_at = self.version, time.perf_counter()

    def _left(self, flight: Flight, row: int) -> int:
        """The tokens completion `row` may still add."""
        done = len(flight.rollout.response_ids[row]) if flight.rollout is not None else 0
        return flight.request.sampling_params[row]["max_new_tokens"] - done

    def _segment_limit(self, flight: Flight, row: int) -> int:
        """A bounded segment's tokens: ceil(max_new_tokens / k), at most what is left."""
        limit = math.ceil(flight.request.sampling_params[row]["max_new_tokens"] / self.max_staleness)
        return min(limit, self._left(flight, row))

    def _collect_answered(self, flights) -> None:
        """Collect those of `flights` whose every answer has arrived (no wait)."""
        for flight in flights:
            if flight.pending is not None and all(a.ready() for _, a in flight.pending.answers):
                self._collect(flight)

    def _collect(self, flight: Flight, poll: Callable[[], None] | None = None) -> Rollout:
        if flight.pending is not None:
            segment = self.rollouts.collect(flight.pending, poll)
            got = sorted(set(segment.versions))
            # the schedule's invariant (asynchronous runs): no push overtook a started request. A
            # synchronous run leaves a wrong or missing push to the sync check, which names it.
            if self.max_staleness and got != [flight.segment_version]:
                raise RuntimeError(f"prompt block {flight.block}: the engines sampled it with policy versions "
                                   f"{got}, the pipeline started it under version {flight.segment_version}")
            self.busy.append((flight.started_at, flight.started_at + flight.pending.latency_s))
            flight.pending = None
            self._merge(flight, segment)
        return flight.rollout

    def _merge(self, flight: Flight, segment: Rollout) -> None:
        """Add a collected segment's tokens to the flight; note the completions its limit cut."""
        rows = range(len(segment.response_ids)) if flight.rows is None else flight.rows
        if flight.rows is None:
            flight.rollout = segment
            if self.partial:
                segment.token_versions = [[flight.segment_version] * len(ids) for ids in segment.response_ids]
        else:
            r = flight.rollout
            for j, row in enumerate(rows):
                r.response_ids[row] = r.response_ids[row] + segment.response_ids[j]
                r.engine_logprobs[row] = r.engine_logprobs[row] + segment.engine_logprobs[j]
                r.token_versions[row] = r.token_versions[row] + [flight.segment_version] * len(segment.response_ids[j])
                r.finish_reasons[row] = segment.finish_reasons[j]
                if r.routes is not None:  # the last segment's routes cover the whole sequence
                    r.routes[row] = segment.routes[j]
        if self.partial:
            flight.cut = [row for j, row in enumerate(rows)
                          if segment.finish_reasons[j] == "length" and len(segment.response_ids[j]) == flight.asked[j]
                          and self._left(flight, row) > 0]

    def drop_in_flight(self, cursor) -> int:
        """After a step abandoned while the engines generated (Checkpointer.poll): forget the first
        segments still unanswered when they are the last prompt blocks drawn, and move the prompt
        cursor (a PromptCursor) back to the first of them, so the save does not wait for them and a
        resume samples those blocks again, as the run would have. Answers that arrived are collected
        first; a continued segment (partial rollouts) or a block drawn out of order is kept (the save
        waits for it). Returns how many flights were dropped."""
        flights = [*self._taken, *self._ahead]
        self._collect_answered(flights)
        tail: list[Flight] = []
        for flight in reversed(flights):
            if flight.pending is None or flight.rows is not None:
                break
            tail.insert(0, flight)
        blocks = [f.block for f in tail]
        if not tail or blocks != list(range(cursor.next_block - len(tail), cursor.next_block)):
            return 0
        gone = {id(f) for f in tail}  # by identity: Flight's generated __eq__ compares rollouts
        self._taken = [f for f in self._taken if id(f) not in gone]
        self._ahead = deque(f for f in self._ahead if id(f) not in gone)
        cursor.next_block = blocks[0]
        return len(tail)

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
                                    "routes": r.routes is not None, "segment_version": f.segment_version,
                                    "cut": f.cut})
            arrays[f"{i}/prompt"], arrays[f"{i}/prompt_len"] = _ragged(r.prompt_ids, np.int64)
            arrays[f"{i}/response"], arrays[f"{i}/response_len"] = _ragged(r.response_ids, np.int64)
            arrays[f"{i}/logprobs"], _ = _ragged(r.engine_logprobs, np.float64)
            if r.token_versions is not None:
                arrays[f"{i}/token_versions"], _ = _ragged(r.token_versions, np.int64)
            if r.routes is not None:
                arrays[f"{i}/routes"] = np.concatenate([x.reshape(-1, *x.shape[1:]) for x in r.routes])
                arrays[f"{i}/routes_len"] = np.array([len(x) for x in r.routes], np.int64)
        out = io.BytesIO()
        np.savez(out, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
        return out.getvalue()

    def restore(self, data: bytes) -> None:
        """Take the saved requests back as started ones, in order. BufferMismatch when the job now
        draws other prompts for a saved block (its group_size, prompts per step or data changed)."""
        with np.load(io.BytesIO(data)) as z:
            meta = json.loads(z["meta"].tobytes())
            for i, f in enumerate(meta["flights"]):
                request = self.request_of(f["block"])
                saved = _unragged(z[f"{i}/prompt"], z[f"{i}/prompt_len"])
                if saved != request.prompt_ids:
                    raise BufferMismatch(f"prompt block {f['block']} was saved as {len(saved)} completions, and "
                                         f"this job draws {len(request.prompt_ids)} other ones for it"
                                         if len(saved) != len(request.prompt_ids) else
                                         f"prompt block {f['block']}'s saved prompts are not the ones this job "
                                         "draws for it")
                routes = None
                if f["routes"]:
                    routes = np.split(z[f"{i}/routes"], np.cumsum(z[f"{i}/routes_len"])[:-1])
                lens = z[f"{i}/response_len"]
                token_versions = _unragged(z[f"{i}/token_versions"], lens) if f"{i}/token_versions" in z else None
                rollout = Rollout(request.examples, saved,
                                  _unragged(z[f"{i}/response"], lens), _unragged(z[f"{i}/logprobs"], lens),
                                  f["finish_reasons"], routes, [f["version"]] * len(f["finish_reasons"]),
                                  token_versions)
                self._ahead.append(Flight(f["block"], f["version"], rollout=rollout, request=request,
                                          segment_version=f.get("segment_version", f["version"]),
                                          cut=f.get("cut", [])))


def segment_seed(seed: int, tokens_so_far: int) -> int:
    """The sampling seed of a completion's segment that starts after `tokens_so_far` tokens (partial
    rollouts): the completion's own seed for the first, a pure function of both for the others."""
    return seed if tokens_so_far == 0 else zlib.crc32(f"{seed}:{tokens_so_far}".encode()) & 0x7FFFFFFF


def _ragged(rows: list[list], dtype) -> tuple[np.ndarray, np.ndarray]:
    lens = np.fromiter(map(len, rows), np.int64, count=len(rows))
    flat = np.fromiter((x for row in rows for x in row), dtype, count=int(lens.sum()))
    return flat, lens


def _unragged(flat: np.ndarray, lens: np.ndarray) -> list[list]:
    return [part.tolist() for part in np.split(flat, np.cumsum(lens)[:-1])] if len(lens) else []
