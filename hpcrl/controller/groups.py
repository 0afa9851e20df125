"""Controller-side handles on the worker roles, one typed method per phase of a step.

`PolicyGroup` (trainer ranks, Megatron) and `RolloutGroup` (one rank per engine) translate the
algorithm's calls into commands on the MPI control plane and merge the per-rank replies; generation
requests go straight to the engines' HTTP servers. Each `async_*` method returns a handle whose
`wait()` enforces the phase deadline.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from hpcrl.controller.comm import PendingCall, RankFailure, RoleGroup, World
from hpcrl.controller.routes import RouteFormat
from hpcrl.rollout.client import EngineClient, EngineError, PendingResponse, routed_experts_fields, wait_answers
from hpcrl.rollout.engine_watch import first_death
from hpcrl.rollout.shard_requests import ShardRequests
from hpcrl.tasks import Example

POLL_S = 0.25  # how often a generation's wait runs its preemption poll (RolloutGroup.collect)
DEATH_CHECK_S = 2.0  # how often it reads the engines' records (hpcrl/rollout/engine_watch.py)


@dataclass
class Rollout:
    """One step's completions, group after group (G completions of each prompt are adjacent).
    `routes` (rollout.routing_replay): per completion the engine's MoE routes [P + R - 1, MoE layers,
    top_k] (hpcrl/controller/routes.py); select/concat move references to them, never the routes.
    `versions`: per completion the policy version that sampled it (its first token's, with partial
    rollouts); `token_versions` (partial rollouts only): per completion the version of every response
    token (hpcrl/controller/pipeline.py); `steps`: per completion the step whose rl.generate() handed
    it out (RL's check that a synchronous step updates on its own samples)."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    engine_logprobs: list[list[float]]
    finish_reasons: list[str]
    routes: list[np.ndarray] | None = None
    versions: list[int] | None = None
    token_versions: list[list[int]] | None = None
    steps: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def token_batch(self, routes: bool = True) -> dict:
        """The trainer's payload of the completions' tokens, and their routes (with `routes`: only the
        policy's forwards replay or compare them)."""
        batch = {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids}
        return batch if self.routes is None or not routes else {**batch, "routes": self.routes}

    def select(self, rows: list[int]) -> Rollout:
        """The completions at `rows`, in that order."""
        return Rollout(*(None if getattr(self, f.name) is None else [getattr(self, f.name)[i] for i in rows]
                         for f in fields(self)))

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """The completions of `parts`, one after the other (routes only when every part has them)."""
        return Rollout(*(None if any(getattr(part, f.name) is None for part in parts) else
                         [x for part in parts for x in getattr(part, f.name)] for f in fields(Rollout)))

    def response_mask_BT(self) -> np.ndarray:
        """Bool [B, T]: True on response tokens (T = the longest response, at least 1: the trainer's
        [B, T] alignment, hpcrl/trainer/batch.py)."""
        lens_B = np.fromiter(map(len, self.response_ids), dtype=np.int64, count=len(self.response_ids))
        return np.arange(max(1, int(lens_B.max(initial=0))))[None, :] < lens_B[:, None]

    def engine_logprobs_BT(self) -> np.ndarray:
        """Float32 [B, T] log-probs the engines gave the sampled tokens (the behaviour policy), 0 on padding."""
        mask_BT = self.response_mask_BT()
        out_BT = np.zeros(mask_BT.shape, dtype=np.float32)
        out_BT[mask_BT] = np.fromiter(itertools.chain.from_iterable(self.engine_logprobs), dtype=np.float32,
                                      count=int(mask_BT.sum()))
        return out_BT


@dataclass
class TrainResult:
    """One optimizer step: its metrics and the trainer's log-probs of the rollout's response
    tokens before the update ([B, T], zeros on padding) -- the old log-probs of the step."""

    metrics: dict[str, float]
    logprobs_BT: np.ndarray


@dataclass
class GenerateRequest:
    """A step's generation requests, ready to send: one encoded /generate body per engine (None
    for an engine with no prompt), and the sampling parameters they hold, per completion."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    bodies: list[bytes | None]
    sampling_params: list[dict] | None = None
    routes: bool = False  # the bodies ask for the routed experts


@dataclass
class PendingRollout:
    step: int
    request: GenerateRequest
    answers: list[tuple[int, PendingResponse]]  # (rollout rank, its engine's answer)
    latency_s: float = 0.0  # the slowest engine's e2e_latency, once collected


def weight_version(policy_version: int) -> str:
    """The engines' weight_version of policy `policy_version` (after that many optimizer steps): the
    push after step s names its weights str(s), the initial push "-1"."""
    return str(policy_version - 1)


def policy_version(weight_version: str | None) -> int:
    """The inverse of `weight_version` (-1 for an engine that was never pushed to: "default")."""
    try:
        return int(weight_version) + 1
    except (TypeError, ValueError):
        return -1


def _leader(replies: dict[int, object]) -> object:
    """The one non-None reply (workers that hold no result answer None), or None if none has one."""
    values = [v for v in replies.values() if v is not None]
    assert len(values) <= 1, f"expected at most one result, got {len(values)}"
    return values[0] if values else None


class _Handle:
    def __init__(self, call: PendingCall, timeout_s: float, merge) -> None:
        self.call, self.timeout_s, self.merge = call, timeout_s, merge

    def wait(self, watch=None):
        return self.merge(self.call.wait(self.timeout_s, watch))


class PolicyGroup:
    """The Megatron trainer ranks.

    `train` queues the step's weight sync right behind the train command, so the trainer ranks start
    pushing weights as soon as the update is done, with no controller round trip in between;
    `push_weights` collects that sync, or (asynchronous runs) it stays queued until the next command
    needs it: a queued sync is collected before any other command is sent, except the next train
    command, which is sent first and then waits behind it on the trainer ranks. Replies are taken in
    the order the commands were sent (the queued sync's first), so none is taken for another's.
    `on_pushed` runs whenever a sync was collected: the engines then hold the new version. With the
    shard route the engines' requests are this side's (`ShardRequests`): written with the queued
    sync, before the update, and answered here while the trainer ranks send.
    """

    def __init__(self, world: World, timeout_s: float) -> None:
        self.group = RoleGroup(world, "trainer")
        self.timeout_s = timeout_s
        self._queued_sync: tuple[int, _Handle] | None = None  # (step, handle)
        self.on_pushed: Callable[[int, dict[str, float]], None] = lambda step, sync: None
        """Runs with (step, the sync's {"bytes", "seconds"}) once the push after `step` completed."""
        self._shard_requests: ShardRequests | None = None  # the shard route's engine requests
        self.changed_step: int | None = None
        """The last step that sent a command changing the trainers' state (policy or critic update)."""
        self.policy_step: int | None = None
        """The last step that sent a policy update (its weight push queued behind it)."""

    def _async(self, op: str, step: int, payload: object = None) -> _Handle:
        self.collect_push()
        return self._send(op, step, payload)

    def _send(self, op: str, step: int, payload: object = None) -> _Handle:
        return _Handle(self.group.async_call(op, step, payload, timeout_s=self.timeout_s), self.timeout_s,
                       _leader)

    def collect_push(self) -> None:
        """Wait for the queued sync, if any (then `on_pushed`)."""
        if self._queued_sync is not None:
            (step, handle), self._queued_sync = self._queued_sync, None
            self._pushed(step, self._wait_sync(handle))

    @property
    def queued_push(self) -> int | None:
        """The step whose weight sync is queued and not yet collected, if any."""
        return self._queued_sync[0] if self._queued_sync is not None else None

    def _pushed(self, step: int, sync: dict[str, float]) -> dict[str, float]:
        self.on_pushed(step, sync)
        return sync

    def _send_sync(self, step: int, deadline_s: float) -> _Handle:
        """The sync command of `step`, the engines' shard-route requests written first."""
        if self._shard_requests is not None:
            self._shard_requests.start(str(step), deadline_s)
        return self._send("sync", step, {"weight_version": str(step)})

    def _wait_sync(self, handle: _Handle) -> dict[str, float]:
        """The trainer ranks' sync replies, then the engines' answers (a refusal ends the wait)."""
        requests = self._shard_requests
        if requests is None:
            return handle.wait()
        out = handle.wait(requests.watch)
        requests.finish()
        return out

    def async_init(self, startup_timeout_s: float) -> _Handle:
        return _Handle(self.group.async_call("init", -1, None, timeout_s=startup_timeout_s),
                       startup_timeout_s, lambda replies: None)

    def connect_engines(self, engine_urls: list[str]) -> None:
        """Join the trainer ranks and the engines for weight syncs (the shard route's trainer rank 0
        answers what the engines' requests need: ShardSync.engine_request)."""
        info = self._async("connect", -1, engine_urls).wait()
        if info is not None:
            self._shard_requests = ShardRequests(engine_urls, info["request"], info["tp"], info["sglang"],
                                                 self.timeout_s)

    def ref_logprobs(self, step: int, rollout: Rollout, temperature: float) -> np.ndarray:
        """Log-probs of the response tokens under the frozen reference policy, [B, T]."""
        payload = {**rollout.token_batch(routes=False), "temperature": temperature}
        return self._async("ref_logprobs", step, payload).wait()

    def values(self, step: int, rollout: Rollout) -> np.ndarray:
        """The critic's values of the response positions, [B, T] (hpcrl/trainer/critic.py)."""
        return self._async("values", step, rollout.token_batch(routes=False)).wait()

    def train_critic(self, step: int, rollout: Rollout, returns: np.ndarray, old_values: np.ndarray,
                     epochs: int, mini_batch_size: int) -> dict[str, float]:
        """The critic's value-loss updates on the rollout; metrics."""
        self.changed_step = step
        return self._async("train_critic", step, {**rollout.token_batch(routes=False), "returns": returns,
                                                  "old_values": old_values, "epochs": epochs,
                                                  "mini_batch_size": mini_batch_size}).wait()

    def train(self, step: int, rollout: Rollout, advantages: np.ndarray, ref_BT: np.ndarray | None,
              temperature: float, loss: str = "grpo", tensors: dict[str, np.ndarray] | None = None,
              epochs: int = 1, mini_batch_size: int = 0,
              before_sync: Callable[[], None] = lambda: None) -> TrainResult:
        """The updates of `loss` on the rollout (one on-policy optimizer step, or `epochs` passes in
        mini-batches: MegatronPolicy.update). The step's sync is queued behind it, its engine requests
        (shard route) written once `before_sync` returns (it waits, while the trainer trains, for what
        a push must not overtake): the engines prepare while the trainer trains, and wait out the
        update (twice the phase timeout). A sync still queued (the last step's, left there by an
        asynchronous run) goes first: the train command waits behind it on the trainer ranks, and it
        is collected before `before_sync` runs."""
        payload = {**rollout.token_batch(), "advantages": advantages, "ref_logprobs": ref_BT,
                   "temperature": temperature, "loss": loss,
                   "tensors": tensors or {}, "epochs": epochs, "mini_batch_size": mini_batch_size}
        self.changed_step = self.policy_step = step
        train = self._send("train", step, payload)
        self.collect_push()
        before_sync()
        self._queued_sync = (step, self._send_sync(step, 2 * self.timeout_s))
        out = train.wait()
        return TrainResult(out["metrics"], out["logprobs"])

    def push_weights(self, step: int) -> dict[str, float]:
        """Export Megatron shards as HF tensors and send them into every engine (the sync `train`
        queued for this step, else a new one)."""
        if self._queued_sync is not None and self._queued_sync[0] == step:
            (_, handle), self._queued_sync = self._queued_sync, None
            return self._pushed(step, self._wait_sync(handle))
        self.collect_push()
        return self._pushed(step, self._wait_sync(self._send_sync(step, self.timeout_s)))

    def save_checkpoint(self, ckpt_dir: str, step: int, attempt_id: str, keep: int, metadata: dict,
                        blobs: dict[str, bytes] | None = None) -> None:
        """Collective save of policy, reference, Adam state and RNG (and `blobs`, stored by trainer
        rank 0); committed when this returns."""
        self._async("save", step, {"dir": ckpt_dir, "attempt_id": attempt_id, "keep": keep,
                                   "metadata": metadata, "blobs": blobs or {}}).wait()

    def load_checkpoint(self, ckpt_dir: str, step: int) -> dict:
        """Collective load (any saved layout); returns the checkpoint's metadata."""
        return self._async("load", step, {"dir": ckpt_dir}).wait()

    def policy_sha256(self, step: int) -> str:
        return self._async("sha256", step).wait()

    def critic_sha256(self, step: int) -> str:
        """The critic's hash (hpcrl/trainer/critic.py), when the job has one."""
        return self._async("critic_sha256", step).wait()

    def shutdown(self) -> None:
        self.collect_push()
        self.group.call("shutdown", -1, None, timeout_s=self.timeout_s)


class RolloutGroup:
    """One rank per generation engine node; prompts are split evenly across engines.

    The ranks launch and stop the engines. Generation goes from the controller straight to the
    engines over SGLang's HTTP API, all engines at once (`start` writes each request before
    `collect` reads any answer), with the phase deadline as the socket timeout: no MPI hop per
    step. A failed request is reported as a RankFailure naming the engine's rollout rank. Each step
    also posts a heartbeat to the ranks, collected at the next step, so a rollout rank that died is
    named even if its engine still answers, and idle ranks keep hearing from the controller.
    An engine over `nodes_per_engine` nodes has as many consecutive ranks; the first (`leaders`)
    serves its HTTP API, the others start and watch its follower nodes and answer heartbeats. With
    such engines, while it waits for a generation the group reads the engines' records in `run_dir`
    every DEATH_CHECK_S and stops at the first death: an SGLang engine whose follower node died hangs
    in its collectives instead of failing the request, and the heartbeats come only at the next step
    (an engine of one node that dies closes its requests' connections: no records are read).
    """

    def __init__(self, world: World, timeout_s: float, routes: RouteFormat | None = None,
                 nodes_per_engine: int = 1, run_dir: Path | None = None) -> None:
        self.group = RoleGroup(world, "rollout")
        self.run_dir = run_dir if nodes_per_engine > 1 else None  # where follower deaths are read
        self.leaders = self.group.ranks[::nodes_per_engine]  # engine i's node 0 rank
        self.timeout_s = timeout_s
        self.routes = routes  # ask the engines for their MoE routes (rollout.routing_replay)
        self.engines: list[EngineClient] = []
        self._heartbeat: PendingCall | None = None

    def async_init(self, startup_timeout_s: float) -> _Handle:
        def connect(replies: dict[int, object]) -> list[str]:
            urls = [replies[r] for r in self.leaders]
            self.engines = [EngineClient(url, timeout_s=self.timeout_s) for url in urls]
            return urls

        return _Handle(self.group.async_call("init", -1, None, timeout_s=startup_timeout_s),
                       startup_timeout_s, connect)

    def prepare(self, examples: list[Example], prompt_ids: list[list[int]],
                sampling_params: list[dict], routes: bool = True) -> GenerateRequest:
        """Split a step's prompts evenly across the engines and encode each engine's /generate body
        (asking for the routed experts when `self.routes` is set, rollout.routing_replay, unless
        `routes` is False: evaluation trains on nothing)."""
        bounds = np.linspace(0, len(prompt_ids), len(self.engines) + 1).astype(int)
        routes = routes and self.routes is not None
        extra = routed_experts_fields() if routes else {}
        bodies = [json.dumps({"input_ids": prompt_ids[lo:hi], "sampling_params": sampling_params[lo:hi],
                              "return_logprob": True, **extra}).encode() if hi > lo else None
                  for lo, hi in zip(bounds[:-1], bounds[1:])]
        return GenerateRequest(examples, prompt_ids, bodies, sampling_params, routes)

    def prepare_scoring(self, rollout: Rollout) -> GenerateRequest:
        """The rollout's completions as scoring requests, split evenly across the engines: prompt +
        response in, nothing generated, the response tokens' log-probs asked back (SGLang's
        input-token log-probs: hpcrl.rollout.client.scoring_body)."""
        from hpcrl.rollout.client import scoring_body

        pairs = list(zip(rollout.prompt_ids, rollout.response_ids))
        bounds = np.linspace(0, len(pairs), len(self.engines) + 1).astype(int)
        bodies = [json.dumps(scoring_body(pairs[lo:hi])).encode() if hi > lo else None
                  for lo, hi in zip(bounds[:-1], bounds[1:])]
        return GenerateRequest(rollout.examples, rollout.prompt_ids, bodies)

    def collect_scores(self, started: PendingRollout, rollout: Rollout) -> tuple[list[list[float]], list[int]]:
        """The engines' log-probs of every completion's response tokens, and per completion the policy
        version that scored it."""
        from hpcrl.rollout.client import parse_scores

        outs = []
        for rank, answer in started.answers:
            with self._engine_of(rank, started.step, "sync check"):
                outs += answer.result()
        scores = parse_scores(outs, list(zip(rollout.prompt_ids, rollout.response_ids)))
        return scores, [policy_version(o["meta_info"].get("weight_version")) for o in outs]

    def start(self, step: int, request: GenerateRequest) -> PendingRollout:
        """Write every engine's request (all before any answer is read); `collect` reads them."""
        self._beat(step)
        pending = []
        for rank, engine, body in zip(self.leaders, self.engines, request.bodies):
            if body is not None:
                with self._engine_of(rank, step):
                    pending.append((rank, engine.start("POST", "/generate", body)))
        return PendingRollout(step, request, pending)

    def collect(self, started: PendingRollout, poll: Callable[[], None] | None = None) -> Rollout:
        """The engines' answers to `started`, as a Rollout. `poll` (the checkpointer's preemption poll,
        where the wait may be abandoned: a step's generation, an evaluation) runs every POLL_S while
        an answer is still to come; what it raises ends the wait."""
        self._await(started, poll)
        outs = []
        for rank, answer in started.answers:
            with self._engine_of(rank, started.step):
                outs += answer.result()
        r = started.request
        routes = None
        if r.routes:
            routes = [self.routes.decode(o["meta_info"], len(p) + len(o["output_ids"]),
                                         f"step {started.step}, completion {i}")
                      for i, (p, o) in enumerate(zip(r.prompt_ids, outs))]
        started.latency_s = max((o["meta_info"].get("e2e_latency") or 0.0 for o in outs), default=0.0)
        return Rollout(r.examples, r.prompt_ids, [o["output_ids"] for o in outs],
                       [[lp[0] for lp in o["meta_info"]["output_token_logprobs"]] for o in outs],
                       [o["meta_info"]["finish_reason"]["type"] for o in outs], routes,
                       [policy_version(o["meta_info"].get("weight_version")) for o in outs])

    def _await(self, started: PendingRollout, poll: Callable[[], None] | None) -> None:
        """Wait for every engine's answer until the phase deadline, running `poll` between polls (a
        request past the deadline is then reported as hung by its `result()`)."""
        deadline = time.monotonic() + self.timeout_s
        waiting = [answer for _, answer in started.answers]
        next_check = time.monotonic() + DEATH_CHECK_S
        while waiting and time.monotonic() < deadline:
            waiting = wait_answers(waiting, min(POLL_S, max(deadline - time.monotonic(), 0.0)))
            if waiting and poll is not None:
                poll()
            if waiting and self.run_dir is not None and time.monotonic() >= next_check:
                next_check = time.monotonic() + DEATH_CHECK_S
                death = first_death(self.run_dir)
                if death is not None:
                    raise RankFailure(death)
        for answer in waiting:
            answer.expire()

    @contextmanager
    def _engine_of(self, rank: int, step: int, phase: str = "generate") -> Iterator[None]:
        """Turn an engine's EngineError into a RankFailure naming its rollout rank."""
        try:
            yield
        except EngineError as exc:
            world = self.group.world
            who = world.ranks[rank].describe()
            log = f"RUN_DIR/logs/engine{self.leaders.index(rank)}.log"
            if world.gone([rank]):
                raise RankFailure(f"{who} exited during phase '{phase}' of step {step}; its engine at "
                                  f"{exc.url} is gone with it (see its log in RUN_DIR/logs/)") from None
            if exc.status is None and "timed out" in exc.message:
                raise RankFailure(f"no answer within {self.timeout_s:.0f} s in phase '{phase}' of step "
                                  f"{step} from the engine of {who} at {exc.url} (hung; see {log})") from None
            raise RankFailure(f"the engine of {who} failed in phase '{phase}' of step {step}: {exc} "
                              f"(see {log})") from None

    def start_profile(self, out_dir: str, profile_id: str, cuda: bool) -> list[str]:
        """SGLang's /start_profile on every engine, engine i's trace into `out_dir`/engine<i>/ (stack
        and shapes off, as the trainer ranks' traces: smaller files); the failures, one line per engine."""
        body = {"profile_id": profile_id, "activities": ["CPU", "GPU"] if cuda else ["CPU"], "with_stack": False,
                "record_shapes": False}
        return self._each_engine("/start_profile", lambda i: {**body, "output_dir": f"{out_dir}/engine{i}"})

    def stop_profile(self) -> list[str]:
        """SGLang's /stop_profile on every engine (each writes its trace); the failures."""
        return self._each_engine("/stop_profile", lambda i: None)

    def _each_engine(self, route: str, body_of: Callable[[int], dict | None]) -> list[str]:
        """POST `route` to every engine at once (SGLang's /stop_profile returns once its trace is
        written); the failures, one line per engine."""
        failed, answers = [], []
        for i, engine in enumerate(self.engines):
            try:
                answers.append((i, engine.start("POST", route, body_of(i))))
            except EngineError as exc:
                failed.append(f"engine {i}: {exc}")
        for i, answer in answers:
            try:
                answer.result()
            except EngineError as exc:
                failed.append(f"engine {i}: {exc}")
        return sorted(failed)

    def _beat(self, step: int) -> None:
        """Collect the previous step's heartbeat answers and post this step's."""
        self._collect_heartbeat()
        self._heartbeat = self.group.async_call("heartbeat", step, None, timeout_s=self.timeout_s)

    def _collect_heartbeat(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.wait(self.timeout_s)
            self._heartbeat = None

    def shutdown(self) -> None:
        self._collect_heartbeat()
        self.group.call("shutdown", -1, None, timeout_s=self.timeout_s)
