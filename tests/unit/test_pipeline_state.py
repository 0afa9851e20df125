"""The generation pipeline's checkpoint state (hpcrl/controller/pipeline.py): the batches sampled
ahead survive to_bytes / restore exactly (token ids, float64 log-probs bit for bit, routes with their
dtype, versions, finish reasons), in order; and the state is what no completed step took."""

import numpy as np
import pytest

from hpcrl.controller.checkpointing import PromptCursor
from hpcrl.controller.groups import GenerateRequest, PendingRollout, Rollout
from hpcrl.controller.pipeline import BufferMismatch, Flight, GenerationPipeline
from hpcrl.tasks import Example


def _examples(block: int, n: int) -> list[Example]:
    return [Example(prompt=f"p{block}-{i}", prompt_ids=(block, i), answer="a") for i in range(n)]


def _pipeline() -> GenerationPipeline:
    request_of = lambda block: GenerateRequest(_examples(block, 2), [[block, 0], [block, 1]], [])  # noqa: E731
    return GenerationPipeline(rollouts=None, request_of=request_of, take_block=lambda: 0, max_staleness=2,
                              num_steps=10)


def _rollout(block: int, version: int, routes: bool) -> Rollout:
    rng = np.random.default_rng(block)
    responses = [[5, 6, 7], []]
    logprobs = [rng.standard_normal(3).tolist(), []]  # full float64 mantissas
    r = [rng.integers(0, 200, (4, 2, 3)).astype(np.uint8), rng.integers(0, 200, (1, 2, 3)).astype(np.uint8)]
    return Rollout(_examples(block, 2), [[block, 0], [block, 1]], responses, logprobs, ["length", "stop"],
                   r if routes else None, [version, version])


def test_state_round_trips_exactly_in_order():
    p = _pipeline()
    flights = [Flight(3, 1, rollout=_rollout(3, 1, True)), Flight(4, 2, rollout=_rollout(4, 2, False))]
    p._taken.append(flights[0])  # taken by the step in progress: still state
    p._ahead.append(flights[1])
    data = p.to_bytes()
    q = _pipeline()
    q.restore(data)
    assert [(f.block, f.version) for f in q._ahead] == [(3, 1), (4, 2)]
    for f, g in zip(flights, q._ahead):
        a, b = f.rollout, g.rollout
        assert (b.prompt_ids, b.response_ids, b.finish_reasons, b.versions) == \
               (a.prompt_ids, a.response_ids, a.finish_reasons, a.versions)
        assert [x.hex() for row in b.engine_logprobs for x in row] == \
               [x.hex() for row in a.engine_logprobs for x in row]
        assert [e.prompt for e in b.examples] == [e.prompt for e in a.examples]
        if a.routes is None:
            assert b.routes is None
        else:
            assert all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a.routes, b.routes))


def test_a_completed_step_takes_its_batches_out_of_the_state():
    p = _pipeline()
    p._taken.append(Flight(3, 1, rollout=_rollout(3, 1, False)))
    p.step_done(3, updated=True)
    assert p.to_bytes() is None
    p._ahead.append(Flight(4, 1, rollout=_rollout(4, 1, False)))
    q = _pipeline()
    q.restore(p.to_bytes())
    assert [f.block for f in q._ahead] == [4]


def test_a_job_that_draws_other_prompts_for_a_saved_block_is_refused():
    """Resumed with another group_size (or prompts per step, or data), the saved completions were
    paired with the new job's examples: an IndexError in Rollout.select, or rows scored against other
    answers without a word when the row count stayed (an audit's run)."""
    p = _pipeline()
    p._ahead.append(Flight(4, 1, rollout=_rollout(4, 1, False)))
    data = p.to_bytes()
    four = lambda block: GenerateRequest(_examples(block, 4), [[block, i % 2] for i in range(4)], [])  # noqa: E731
    other = lambda block: GenerateRequest(_examples(block, 2), [[block, 1], [block, 0]], [])  # noqa: E731
    for request_of, match in [(four, "prompt block 4 was saved as 2 completions, and this job draws 4 other ones"),
                              (other, "prompt block 4's saved prompts are not the ones this job draws for it")]:
        q = GenerationPipeline(rollouts=None, request_of=request_of, take_block=lambda: 0, max_staleness=2,
                               num_steps=10)
        with pytest.raises(BufferMismatch, match=match):
            q.restore(data)


class _Answer:
    """An engine's answer as the pipeline sees it (PendingResponse.ready)."""

    def __init__(self, arrived: bool) -> None:
        self.arrived = arrived

    def ready(self) -> bool:
        return self.arrived


class _Engines:
    """RolloutGroup.collect for answers that arrived: block b's rollout, sampled by version 1."""

    def collect(self, pending: PendingRollout, poll=None) -> Rollout:
        return _rollout(pending.step, 1, False)


def _in_flight(block: int, arrived: bool = False, rows: list[int] | None = None) -> Flight:
    pending = PendingRollout(block, GenerateRequest(_examples(block, 2), [[block, 0], [block, 1]], []),
                             [(9, _Answer(arrived))])
    return Flight(block, 1, pending=pending, segment_version=1, rows=rows)


def test_a_step_abandoned_in_generation_drops_its_unanswered_blocks_and_rewinds_the_cursor():
    """Checkpointer.poll abandoned step 4 while block 4 (taken) and 5 (sampled ahead) were in flight:
    the save keeps block 3 (answered before) and no unanswered one, and the cursor goes back to 4, so
    the resume samples blocks 4 and 5 again, as the uninterrupted run did. Answers that arrived are
    collected, not dropped."""
    p = _pipeline()
    p.rollouts = _Engines()
    cursor = PromptCursor()
    cursor.next_block = 7
    p._taken.append(Flight(3, 1, rollout=_rollout(3, 1, False)))
    p._ahead.extend([_in_flight(4), _in_flight(5), _in_flight(6, arrived=True)])
    # the answered block 6 ends the unanswered tail: nothing can be dropped without skipping it
    assert p.drop_in_flight(cursor) == 0 and cursor.next_block == 7
    assert [f.block for f in [*p._taken, *p._ahead] if f.pending is None] == [3, 6]
    p._ahead.pop()
    cursor.next_block = 6
    assert p.drop_in_flight(cursor) == 2
    assert cursor.next_block == 4
    q = _pipeline()
    q.restore(p.to_bytes())  # to_bytes would have waited for the dropped ones
    assert [f.block for f in q._ahead] == [3]


def test_blocks_in_flight_that_a_resume_could_not_sample_again_are_kept():
    """A continued segment (partial rollouts: its first tokens are the state) and blocks that are not
    the last ones drawn (the cursor cannot skip back over them) stay for the save to wait for."""
    for flight, cursor_at in [(_in_flight(4, rows=[1]), 5), (_in_flight(2), 5)]:
        p = _pipeline()
        p._ahead.append(flight)
        cursor = PromptCursor()
        cursor.next_block = cursor_at
        assert p.drop_in_flight(cursor) == 0
        assert cursor.next_block == cursor_at and list(p._ahead) == [flight]
