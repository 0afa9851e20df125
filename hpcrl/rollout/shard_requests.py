"""The engines' side of a shard-route push, driven by the controller: the HTTP requests that make
each engine receive its planned slices from the trainer ranks, and their answers.

The trainer ranks only send (hpcrl/trainer/shard_sync.py). The controller writes every engine's
request -- when a push is queued behind an update, before that update, so the engines parse and
plan while the trainer trains and then wait in their receives -- and reads the answers itself:
an engine's answer reaches the controller in one hop instead of two (through trainer rank 0), and
a refusal (SGLang judges a request before it posts its receive) ends the push at once, named,
instead of at the trainer ranks' round deadline.

Requests: the reference engine's POST /hpcrl/update_weights_reshard (hpcrl/rollout/reshard_route.py);
for SGLang one weight-update session per engine and push: /begin_weight_update (every engine at
once), /update_weights_from_tensor naming hpcrl's loader (sglang_shard_loader.tensor_request_body),
/end_weight_update -- after a failure too, so that the next push can begin.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from hpcrl import faults
from hpcrl.rollout.client import EngineClient, PendingResponse
from hpcrl.rollout.sglang_shard_loader import tensor_request_body
from hpcrl.rollout.weight_sender import end_sessions


class ShardPushError(RuntimeError):
    """An engine refused or failed its part of a shard-route push (the message names it)."""


@dataclass
class _Push:
    version: str
    answers: list[PendingResponse | None]  # per engine; None: not asked, or already answered
    errors: list[str] = field(default_factory=list)


class ShardRequests:
    """The controller's requests of shard-route pushes into `urls` (engine i at urls[i]).

    `request_json` is the trainer's plan request (ShardSync.engine_request: layouts, budget,
    topology, group name, spec fingerprint, checksum mode), `tp` the engines' TP size. Per push:
    `start(version, deadline_s)`, then `watch()` while the trainer ranks send (raises at the first
    refusal), then `finish()` once they are done (reads every answer; raises naming each engine that
    failed). One push at a time.
    """

    def __init__(self, urls: list[str], request_json: dict[str, Any], tp: int, sglang: bool,
                 timeout_s: float) -> None:
        self.clients = [EngineClient(url, timeout_s=timeout_s) for url in urls]
        self.request_json, self.tp, self.sglang, self.timeout_s = request_json, tp, sglang, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(urls)), thread_name_prefix="shard-requests")
        self._push: _Push | None = None

    def start(self, version: str, deadline_s: float) -> None:
        """Write every engine's request for the push of `version`; each engine's receive must finish
        within `deadline_s` per round. An engine that cannot be asked is reported by `finish`."""
        assert self._push is None, f"push {self._push.version} not finished before {version}"
        push = self._push = _Push(version, [None] * len(self.clients))
        if faults.planned_sync(version) == "skip":  # tests only: the engines are not told either
            return
        opened = [True] * len(self.clients)
        if self.sglang:
            begins = [self._pool.submit(c.begin_weight_update) for c in self.clients]
            for i, fut in enumerate(begins):
                try:
                    fut.result(timeout=self.timeout_s)
                except Exception as exc:  # noqa: BLE001 - reported with the others
                    opened[i] = False
                    push.errors.append(f"{self._name(i)}: begin_weight_update: {exc}")
        body = {**self.request_json, "weight_version": version, "deadline_s": deadline_s}
        for i, client in enumerate(self.clients):
            if not opened[i]:
                continue
            try:
                push.answers[i] = (client.start_update_weights_from_tensor(
                    tensor_request_body(body, i, self.tp, version)) if self.sglang else
                    client.start_update_weights_reshard({**body, "engine_rank": i}))
            except Exception as exc:  # noqa: BLE001 - reported with the others
                push.errors.append(f"{self._name(i)}: {exc}")

    def watch(self) -> None:
        """Read the answers that are in; ShardPushError at once if an engine refused or failed (the
        trainer ranks would otherwise wait for its receive until their round deadline)."""
        push = self._push
        if push is None:
            return
        if push.errors:
            self._fail()
        for i, answer in enumerate(push.answers):
            if answer is not None and answer.ready():
                push.answers[i] = None
                try:
                    answer.result()
                except Exception as exc:  # noqa: BLE001 - the message names the engine
                    push.errors.append(f"{self._name(i)}: {exc}")
                    self._fail()

    def finish(self) -> None:
        """Wait for every answer of the push (each within the client's timeout), close SGLang's
        sessions; ShardPushError naming each engine that failed."""
        push = self._push
        if push is None:
            return
        for i, answer in enumerate(push.answers):
            if answer is not None:
                try:
                    answer.result()
                except Exception as exc:  # noqa: BLE001 - every engine's failure is reported together
                    push.errors.append(f"{self._name(i)}: {exc}")
        if push.errors:
            self._fail()
        self._push = None
        if self.sglang and faults.planned_sync(push.version) != "skip":
            failed = self._end_sessions(self.timeout_s)
            if failed:
                raise ShardPushError(f"weight push {push.version}: end_weight_update failed on "
                                     + "; ".join(failed))

    def _fail(self) -> None:
        """End the push: close SGLang's sessions (best effort) and raise its errors."""
        push, self._push = self._push, None
        assert push is not None
        if self.sglang:
            self._end_sessions(min(self.timeout_s, 30.0))
        raise ShardPushError(f"shard-to-shard weight push {push.version} failed: " + "; ".join(push.errors))

    def _end_sessions(self, timeout_s: float) -> list[str]:
        return end_sessions(self._pool, self.clients, list(range(len(self.clients))), timeout_s)

    def _name(self, i: int) -> str:
        return f"engine {i} ({self.clients[i].base_url})"
