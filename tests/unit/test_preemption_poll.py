"""The long waits inside a phase run the controller's preemption poll (Checkpointer.poll), so a
preemption can end them: the engines' generation (RolloutGroup) and the reward workers (RewardPool).
Without the poll these waits hold the controller until the engine or reward answers: the tests'
timeouts would end them instead (tests/e2e/test_resume.py runs the whole path)."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from hpcrl.controller.groups import PendingRollout, RolloutGroup
from hpcrl.rewards.pool import RewardPool
from hpcrl.rollout.client import EngineClient


class Abandoned(Exception):
    pass


def looping(prompt, completion, answer, extra=None):
    while True:
        pass


def _poll_raising_at(n: int):
    calls = []

    def poll() -> None:
        calls.append(1)
        if len(calls) >= n:
            raise Abandoned

    return poll, calls


@pytest.mark.timeout(60)
def test_a_reward_wait_runs_the_poll_and_ends_with_what_it_raises():
    poll, calls = _poll_raising_at(3)
    with RewardPool(f"{__name__}:looping", num_workers=1, timeout_s=600) as pool:
        with pytest.raises(Abandoned):
            pool.score([("p", "c", "a", {})] * 2, poll)  # without the poll: 600 s per item
    assert len(calls) == 3


@pytest.fixture
def restore_signals():
    """The signal handlers a PreemptionWatch takes over, given back after the test."""
    import signal

    saved = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


@pytest.fixture
def held_engine():
    """An HTTP server whose POST answers once `release` is set."""
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            release.wait(60)
            body = b'{"ok": true}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", release
    release.set()
    server.shutdown()


def _group() -> RolloutGroup:
    return RolloutGroup(SimpleNamespace(ranks_of=lambda role: []), timeout_s=600)


@pytest.mark.timeout(60)
def test_a_generation_wait_runs_the_poll_and_ends_with_what_it_raises(held_engine):
    url, release = held_engine
    engine = EngineClient(url, timeout_s=600, keys=None)
    answer = engine.start("POST", "/generate", {"text": "x"})
    poll, calls = _poll_raising_at(3)
    with pytest.raises(Abandoned):
        _group()._await(PendingRollout(0, None, [(1, answer)]), poll)  # without the poll: 600 s
    assert len(calls) == 3 and not answer.ready()
    release.set()
    assert answer.result() == {"ok": True}


@pytest.mark.timeout(60)
def test_a_generation_wait_returns_once_every_engine_answered(held_engine):
    url, release = held_engine
    engines = [EngineClient(url, timeout_s=600, keys=None) for _ in range(2)]
    answers = [e.start("POST", "/generate", {"text": "x"}) for e in engines]
    calls = []

    def poll() -> None:
        calls.append(1)
        if len(calls) == 2:
            release.set()

    _group()._await(PendingRollout(0, None, [(1, answers[0]), (2, answers[1])]), poll)
    assert all(a.ready() for a in answers) and [a.result() for a in answers] == [{"ok": True}] * 2
    # answers that arrived are collected without a poll: a wait that does not wait cannot be abandoned
    # (the save after an abandoned step collects them; a poll there ended the save)
    answer = engines[0].start("POST", "/generate", {"text": "x"})
    while not answer.ready():
        pass
    _group()._await(PendingRollout(0, None, [(1, answer)]), _poll_raising_at(1)[0])


@pytest.mark.timeout(60)
def test_a_stopping_save_does_not_wait_for_generation_and_the_poll_fires_once(held_engine, tmp_path, monkeypatch,
                                                                              restore_signals):
    """An asynchronous run stopping after a step: the push it collects starts the batches ahead, and
    the save waited for them (a whole generation, past the grace). A stopping save drops the unanswered
    tail and moves the prompt cursor back to it (the resume samples it with the same version). The
    preemption poll fires once: a second raise inside the save ended the controller unsaved."""
    import time

    from hpcrl.config import job_from_dict
    from hpcrl.controller.checkpointing import Checkpointer
    from hpcrl.controller.groups import GenerateRequest
    from hpcrl.controller.pipeline import Flight, GenerationPipeline
    from hpcrl.controller.preemption import Preempted

    monkeypatch.delenv("HPCRL_JOB_END_TIME", raising=False)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    url, _ = held_engine
    saved = []
    policy = SimpleNamespace(queued_push=None, changed_step=None, policy_step=3, collect_push=lambda: None,
                             save_checkpoint=lambda *a, **k: saved.append(a[1]))
    ck = Checkpointer(job_from_dict({"rollout": {"max_staleness": 1}, "checkpoint": {"grace_s": 30}}), tmp_path,
                      policy)
    pipe = ck.pipeline = GenerationPipeline(_group(), None, ck.prompt_cursor.take, 1, 10)
    ck.prompt_cursor.next_block = 6
    held = EngineClient(url, timeout_s=600, keys=None).start("POST", "/generate", {"text": "x"})
    pipe._ahead.append(Flight(5, 4, pending=PendingRollout(4, GenerateRequest([], [], []), [(1, held)]),
                              segment_version=4))
    ck.save(4, stopping=True)  # without stopping: 600 s for the held answer
    assert saved == [4] and ck.prompt_cursor.next_block == 5 and not pipe._ahead
    ck.check_abandon(5, "generate")  # the phase boundary, before the signal
    ck.watch.signal_time, ck.watch.signal_name = time.monotonic() - 29, "SIGTERM"  # 1 s of grace left
    with pytest.raises(Preempted, match="step 5 abandoned in phase 'generate'"):
        ck.poll()
    ck.poll()  # fired: the save that follows runs its waits without it
