"""Partial rollouts' schedule (rollout.partial, hpcrl/controller/pipeline.py): driven as the session
drives it (take, collect before each push, fill after it) against a scripted engine group whose
tokens are a pure function of (sampling seed, position, policy version), so every assertion names
which version sampled which token. Checked: with k = 2 a block's first ceil(max_new / k) tokens come
from version s - 2 and the rest from s - 1; completions that stop inside a segment are not
continued; every token keeps its version and log-prob, and the routes are the last segment's; and a
pipeline restored from any step's saved state samples exactly what the uninterrupted one does. And
an asynchronous run's push collected late (after the next step's generate, hpcrl/controller/session.py)
leaves every request to the version and limit of a push collected at once."""

import numpy as np
import pytest

from hpcrl.controller.groups import GenerateRequest, PendingRollout, Rollout
from hpcrl.controller.pipeline import GenerationPipeline, segment_seed
from hpcrl.tasks import Example

STOP = 2
MAX_NEW = 5


def _token(seed: int, position: int, version: int) -> int:
    if (seed + position) % 7 == 0:
        return STOP
    return 3 + (seed * 31 + position * 7 + version * 13) % 50


class ScriptedEngines:
    """RolloutGroup's generate side for the test: greedy-free, deterministic 'sampling' by the
    version the engines hold when a request is written; log-prob -(version + 1) / 10 per token."""

    def __init__(self) -> None:
        self.version = 0
        self.requests: list[tuple[int, list[int]]] = []  # (version, max_new_tokens per completion)

    def prepare(self, examples, prompt_ids, params) -> GenerateRequest:
        return GenerateRequest(examples, prompt_ids, [], params)

    def start(self, step: int, request: GenerateRequest) -> PendingRollout:
        outs = []
        for prompt, p in zip(request.prompt_ids, request.sampling_params):
            ids, reason = [], "length"
            while len(ids) < p["max_new_tokens"]:
                ids.append(_token(p["sampling_seed"], len(prompt) + len(ids), self.version))
                if ids[-1] == STOP:
                    reason = "stop"
                    break
            outs.append((ids, reason))
        self.requests.append((self.version, [p["max_new_tokens"] for p in request.sampling_params]))
        return PendingRollout(step, request, [(self.version, outs)])

    def collect(self, pending: PendingRollout, poll=None) -> Rollout:
        """Routes as the engines return them (rollout.routing_replay): one row per input position of
        the request, P + R - 1, here each holding the version that computed it."""
        version, outs = pending.answers[0]
        r = pending.request
        routes = [np.full((len(p) + len(ids) - 1, 1, 1), version, np.uint8) for p, (ids, _) in zip(r.prompt_ids, outs)]
        return Rollout(r.examples, r.prompt_ids, [ids for ids, _ in outs],
                       [[-(version + 1) / 10] * len(ids) for ids, _ in outs], [reason for _, reason in outs],
                       routes, [version] * len(outs))


def _request_of(block: int) -> GenerateRequest:
    prompts = [[1, block, i] for i in range(6)]
    params = [{"max_new_tokens": MAX_NEW, "sampling_seed": 1000 * block + i, "temperature": 1.0}
              for i in range(6)]
    return GenerateRequest([Example(f"p{block}", (block,), "a")] * 6, prompts, [], params)


class Driver:
    """The session's calls around the pipeline, one generate per step."""

    def __init__(self, k: int, num_steps: int, partial: bool = True) -> None:
        self.engines = ScriptedEngines()
        self.next_block = 0
        self.pipeline = GenerationPipeline(self.engines, _request_of, self._take_block, k, num_steps,
                                           partial=partial)

    def _take_block(self) -> int:
        self.next_block += 1
        return self.next_block - 1

    def start(self, version: int) -> None:
        self.engines.version = self.pipeline.version = version
        self.pipeline.fill(version)

    def step(self, step: int, takes: int = 1) -> list[Rollout]:
        rollouts = [self.pipeline.take(step)[0] for _ in range(takes)]
        self.pipeline.collect_started()
        self.engines.version = self.pipeline.version = step + 1  # the push
        self.pipeline.fill(step + 1)
        self.pipeline.step_done(step, updated=True)
        return rollouts


class LateDriver(Driver):
    """The session's calls with each push collected late: at the next step's update (after its
    generates), or first where the pipeline `needs_push`."""

    pushed: int | None = None

    def _collect_push(self) -> None:
        if self.pushed is not None:
            self.engines.version = self.pipeline.version = self.pushed + 1
            self.pipeline.fill(self.pushed + 1)
            self.pushed = None

    def step(self, step: int, takes: int = 1) -> list[Rollout]:
        rollouts = []
        for _ in range(takes):
            if self.pipeline.needs_push(step):
                self._collect_push()
            rollouts.append(self.pipeline.take(step)[0])
        self._collect_push()  # the update's train command is sent, the push before it collected
        self.pipeline.collect_started()
        self.pushed = step  # queued behind the update
        self.pipeline.step_done(step, updated=True)
        return rollouts


def _whole(block: int, i: int, versions: list[int], starts: tuple[int, ...] = ()) -> list[int]:
    """The completion the script samples when token t is sampled by versions[t], a segment starting
    at each of `starts` (default: where the version changes) with a seed of its own."""
    seed, ids = 1000 * block + i, []
    starts = starts or tuple(t for t in range(len(versions)) if t == 0 or versions[t] != versions[t - 1])
    for t, v in enumerate(versions):
        ids.append(_token(segment_seed(seed, max(u for u in starts if u <= t)), 3 + t, v))
        if ids[-1] == STOP:
            break
    return ids


def _versions(s: int, k: int) -> list[int]:
    """The version of each token of block s: it waits at queue position min(s, k) from version
    max(0, s - k) on; each version that is not the last before its step adds ceil(MAX_NEW / k)."""
    position, version, out = min(s, k), max(0, s - k), []
    while position >= 2:
        out += [version] * -(-MAX_NEW // k)
        version, position = version + 1, position - 1
    return (out + [version] * MAX_NEW)[:MAX_NEW]


@pytest.mark.parametrize("k,steady,asked", [
    # ceil(5 / 2) = 3 tokens by version s - 2, the rest by s - 1; continuations ask for the 2 left
    (2, lambda s: [s - 2] * 3 + [s - 1] * 2, {3, 2, MAX_NEW}),
    # ceil(5 / 3) = 2 tokens by each of s - 3 and s - 2, the rest by s - 1
    (3, lambda s: [s - 3] * 2 + [s - 2] * 2 + [s - 1], None)])
def test_each_completion_is_split_between_the_versions_before_its_step(k, steady, asked):
    d = Driver(k=k, num_steps=8)
    d.start(0)
    for s in range(8):
        r = d.step(s)[0]
        want_vs = _versions(s, k)
        if s >= k:
            assert want_vs == steady(s)
        for i, (ids, vs, lps) in enumerate(zip(r.response_ids, r.token_versions, r.engine_logprobs)):
            assert ids == _whole(s, i, want_vs)  # stopped early: no tokens after the stop
            assert vs == want_vs[:len(ids)]
            assert lps == [-(v + 1) / 10 for v in vs]
            # routed experts: the last segment's, which cover the whole sequence (3 prompt tokens)
            assert r.routes[i].shape[0] == 3 + len(ids) - 1 and set(r.routes[i].ravel()) == {vs[-1]}
        assert r.versions == [max(0, s - k)] * 6
        if s >= 2:
            assert any(len(set(vs)) > 1 for vs in r.token_versions)  # some completions spanned a push
    first = -(-MAX_NEW // k)
    assert any(ids[-1] == STOP and len(ids) < first for ids in r.response_ids)  # stopped in the first segment
    if asked is not None:  # never more than a completion may take
        assert {n for _, a in d.engines.requests for n in a} == asked


@pytest.mark.parametrize("save_after", [0, 1, 2, 4])
def test_a_restored_pipeline_samples_what_the_uninterrupted_one_does(save_after):
    whole = Driver(k=2, num_steps=8)
    whole.start(0)
    expected = [whole.step(s)[0] for s in range(8)]

    first = Driver(k=2, num_steps=8)
    first.start(0)
    for s in range(save_after + 1):
        first.step(s)
    blob = first.pipeline.to_bytes()  # cut completions and the segment versions travel in it
    resumed = Driver(k=2, num_steps=8)
    resumed.next_block = first.next_block  # the checkpointed prompt cursor
    resumed.pipeline.restore(blob)
    resumed.start(save_after + 1)  # the initial push of the resume
    for s in range(save_after + 1, 8):
        got, want = resumed.step(s)[0], expected[s]
        assert (got.response_ids, got.token_versions, got.engine_logprobs, got.finish_reasons, got.versions) == \
               (want.response_ids, want.token_versions, want.engine_logprobs, want.finish_reasons, want.versions)
        assert all(np.array_equal(a, b) and a.dtype == b.dtype for a, b in zip(got.routes, want.routes))


def test_without_partial_a_block_is_one_request_of_one_version():
    d = Driver(k=2, num_steps=5, partial=False)
    d.start(0)
    for s in range(5):
        r = d.step(s)[0]
        assert r.token_versions is None and r.versions == [max(0, s - 2)] * 6
    assert {n for _, asked in d.engines.requests for n in asked} == {MAX_NEW}


def test_a_block_taken_while_cut_is_finished_by_the_current_version():
    """Three generates in one step (DAPO's refills): the third batch's first segment was bounded for
    a later version, which the step does not wait for: the current version finishes it on the spot,
    in a segment of its own."""
    d = Driver(k=2, num_steps=8)
    d.start(0)
    d.step(0)
    d.step(1)  # waiting: block 2 (finished by version 1), 3 (being finished by 2), 4 (cut, by 2)
    p = d.pipeline
    p.take(2)
    p.take(2)
    r, _, _ = p.take(2)
    want_vs = [2] * MAX_NEW
    for i, (ids, vs) in enumerate(zip(r.response_ids, r.token_versions)):
        assert ids == _whole(4, i, want_vs, starts=(0, 3)) and vs == want_vs[:len(ids)]
    assert any(len(ids) > 3 for ids in r.response_ids)  # the on-the-spot segment added tokens


@pytest.mark.parametrize("k,partial,takes", [(1, False, [1] * 6), (2, False, [1] * 6), (2, True, [1] * 6),
                                             (3, True, [1] * 6), (1, False, [2] * 6), (2, False, [3] * 6),
                                             (2, True, [1, 1, 3, 1, 2, 1])])
def test_a_push_collected_late_leaves_the_schedule_as_it_was(k, partial, takes):
    """Takes past the first are DAPO's refills; with k = 1 the late push waits for none of them (a
    batch sampled ahead is there), otherwise for the first that finds none waiting, or the first
    one cut (partial rollouts; step 2's third take)."""
    now, late = Driver(k, num_steps=6, partial=partial), LateDriver(k, num_steps=6, partial=partial)
    for d in (now, late):
        d.start(0)
    for s, n in enumerate(takes):
        for a, b in zip(now.step(s, n), late.step(s, n)):
            assert (a.response_ids, a.versions, a.token_versions) == (b.response_ids, b.versions, b.token_versions)
    assert late.engines.requests == now.engines.requests  # (version, max_new_tokens) of every request, in order


def test_steps_without_a_push_are_named_not_sampled_again_forever():
    """An asynchronous run whose steps push no weights (ppo's critic warmup did; validation now refuses
    it): once the engines' version is more than k steps behind, every request take() started was stale
    at once, and it started another, without end (a real run flooded its engine). It raises instead."""
    d = Driver(k=1, num_steps=6, partial=False)
    d.start(0)
    started = []
    start = d.engines.start

    def counted(step, req):
        started.append(step)
        assert len(started) < 50, "take() keeps starting requests"
        return start(step, req)

    d.engines.start = counted
    for s in range(2):  # no update, no push
        d.pipeline.take(s)
        d.pipeline.step_done(s, updated=False)
    with pytest.raises(RuntimeError, match=r"step 2: the engines hold policy version 0, more than "
                                           r"rollout.max_staleness=1 steps behind; .* every step"):
        d.pipeline.take(2)


def test_a_synchronous_step_without_an_update_leaves_the_engines_current():
    """ppo's critic warmup: step 0 updates only the critic and pushes nothing. The engines still
    hold the trainer's policy, so step 1 samples with it (it raised: a version behind)."""
    d = Driver(k=0, num_steps=3, partial=False)
    d.start(0)
    d.pipeline.take(0)
    d.pipeline.step_done(0, updated=False)
    _, flight, dropped = d.pipeline.take(1)
    assert dropped == 0 and flight.version == 1
