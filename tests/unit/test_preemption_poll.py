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


def _group(poll) -> RolloutGroup:
    group = RolloutGroup(SimpleNamespace(ranks_of=lambda role: []), timeout_s=600)
    group.poll = poll
    return group


@pytest.mark.timeout(60)
def test_a_generation_wait_runs_the_poll_and_ends_with_what_it_raises(held_engine):
    url, release = held_engine
    engine = EngineClient(url, timeout_s=600, keys=None)
    answer = engine.start("POST", "/generate", {"text": "x"})
    poll, calls = _poll_raising_at(3)
    with pytest.raises(Abandoned):
        _group(poll)._await(PendingRollout(0, None, [(1, answer)]))  # without the poll: 600 s
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

    _group(poll)._await(PendingRollout(0, None, [(1, answers[0]), (2, answers[1])]))
    assert all(a.ready() for a in answers) and [a.result() for a in answers] == [{"ok": True}] * 2
