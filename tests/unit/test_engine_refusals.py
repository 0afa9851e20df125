"""SGLang's error semantics against the reference engine (a real subprocess over HTTP + gloo): an
update refused before its receive fails the push at once (not at the group timeout), naming the
engine and SGLang's message, closes the session and drops the group, which connect() re-forms; an
engine that neither receives nor answers fails the push at the sender's deadline;
/pause_generation aborts what is in flight by default and holds new requests until continue."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from hpcrl.rollout.client import EngineClient
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.hf_names import checkpoint_state_dict
from hpcrl.rollout.weight_sender import WeightSender
from reference_engine import GREEDY, HF_CONFIG, PROMPTS, reference_server

pytestmark = pytest.mark.timeout(300)

@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with reference_server(tmp_path_factory.mktemp("engine") / "engine.log") as (_, client):
        yield client


def _greedy(client: EngineClient) -> list[dict]:
    return client.generate(PROMPTS, [GREEDY] * 3, return_logprob=True)


def test_refusal_before_receive_fails_the_push_at_once_and_closes_the_session(server):
    client = server
    sender = WeightSender([client], backend="gloo", timeout_s=120, engine_ids=[3])
    sender.connect()
    local = ReferenceModel(HF_CONFIG, seed=11)
    named = list(checkpoint_state_dict(local.model).items())
    before = _greedy(client)
    client.release_memory_occupation(["weights"])
    try:
        t0 = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            sender.push(named, bucket_bytes=1 << 20, weight_version="refused")
        assert time.monotonic() - t0 < 10, "the sender waited for a broadcast nobody receives"
        message = str(info.value)
        assert f"engine 3 ({client.base_url}): " in message and "refused before receiving" in message
        assert "weights are released" in message and "(bucket 1/" in message
        state = client.server_info()["internal_states"][0]
        assert state["weight_update_session"] is False  # the failed push closed its session
        assert state["weight_update_groups"] == [] and sender.group is None  # dropped on both sides
    finally:
        client.resume_memory_occupation()
    after = _greedy(client)
    assert [a["output_ids"] for a in after] == [b["output_ids"] for b in before]  # nothing changed
    assert after[0]["meta_info"]["weight_version"] == before[0]["meta_info"]["weight_version"]

    sender.connect()  # the dropped group forms again and the next push lands bit-exact
    try:
        sender.push(named, bucket_bytes=1 << 20, weight_version="ok")
        expected = local.generate(PROMPTS, [GREEDY] * 3)
        got = _greedy(client)
        assert [g["output_ids"] for g in got] == [e["output_ids"] for e in expected]
        assert got[0]["meta_info"]["weight_version"] == "ok"
    finally:
        sender.close()


_SILENT_ENGINE = textwrap.dedent("""
    import json, sys, time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from hpcrl.rollout.weight_sender import init_custom_process_group
    groups = []
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a): pass
        def do_POST(self):
            req = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
            if self.path == "/update_weights_from_distributed":
                time.sleep(3600)  # neither receives nor answers
            if self.path == "/init_weights_update_group":
                groups.append(init_custom_process_group(
                    "gloo", f"tcp://{req['master_address']}:{req['master_port']}", req["world_size"],
                    req["rank_offset"], req["group_name"], 60))
            body = json.dumps({"success": True, "message": "Success"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), H)
    httpd.daemon_threads = True
    print(httpd.server_address[1], flush=True)
    httpd.serve_forever()
""")


def test_shard_route_refusal_is_read_by_the_controller_at_its_next_poll(server):
    """The controller's side of the shard route (hpcrl/rollout/shard_requests.py): a request the
    engine refuses before receiving (a plan for another model) fails the push at the first `watch`
    after the answer, naming the engine and its message, with no trainer rank involved."""
    from hpcrl.rollout.reshard_route import PlanRequest
    from hpcrl.rollout.shard_requests import ShardPushError, ShardRequests
    from moe.layouts import RolloutLayout, TrainerLayout

    plan = PlanRequest(TrainerLayout(vocab_divisible_by=1), RolloutLayout(num_engines=1), 1 << 20)
    request = {**plan.to_json(), "group_name": "hpcrl_reshard", "spec_sha256": "0" * 64, "verify": "sampled"}
    requests = ShardRequests([server.base_url], request, tp=1, sglang=False, timeout_s=60)
    requests.start("refused", deadline_s=60)
    with pytest.raises(ShardPushError) as info:
        for _ in range(3000):  # the controller's polls; the engine answers within milliseconds
            requests.watch()
            time.sleep(0.01)
    message = str(info.value)
    assert message.startswith(f"shard-to-shard weight push refused failed: engine 0 ({server.base_url}): ")
    assert "spec_sha256 '0000" in message and "would plan different models" in message
    requests.finish()  # the failed push is over: nothing left to read


def test_an_engine_that_never_answers_fails_the_push_at_the_deadline():
    proc = subprocess.Popen([sys.executable, "-c", _SILENT_ENGINE], stdout=subprocess.PIPE, text=True)
    try:
        client = EngineClient(f"http://127.0.0.1:{proc.stdout.readline().strip()}", timeout_s=30)
        sender = WeightSender([client], backend="gloo", timeout_s=3)
        sender.connect()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"not received within 3 s; broadcast abandoned .* "
                                               r"engine 0 \(http://127.0.0.1:\d+\): no answer"):
            sender.push([("model.norm.weight", torch.ones(64))], bucket_bytes=1 << 20)
        assert time.monotonic() - t0 < 3 + 15  # the deadline, the best-effort session ends, no more
        assert sender.group is None
    finally:
        proc.kill()
        proc.wait()


def test_pause_aborts_what_is_in_flight_by_default_and_holds_new_requests(server):
    client = server
    answers: dict[str, dict] = {}

    def generate(key: str, prompt: list[int]) -> threading.Thread:
        worker = threading.Thread(target=lambda: answers.setdefault(key, client.generate(prompt, GREEDY)))
        worker.start()
        return worker

    client.pause_generation(mode="in_place")  # requests now wait inside the server
    running = generate("taken", PROMPTS[0])  # takes the next batch, waits for the pause to end
    time.sleep(0.5)
    queued = generate("queued", PROMPTS[1])  # waits behind it
    time.sleep(0.5)
    client.pause_generation()  # SGLang's default mode "abort"
    running.join(30)
    queued.join(30)
    for key in ("taken", "queued"):
        assert answers[key]["output_ids"] == []
        assert answers[key]["meta_info"]["finish_reason"] == {"type": "abort",
                                                              "message": "Abort in waiting queue"}
    later = generate("later", PROMPTS[2])  # arrived while paused: held, not aborted
    later.join(1.0)
    assert later.is_alive()
    client.continue_generation()
    later.join(60)
    assert len(answers["later"]["output_ids"]) == 12
    with pytest.raises(Exception, match="mode 'drop' must be one of"):
        client.pause_generation(mode="drop")


def test_a_weight_session_waits_for_generation_in_flight_unless_paused():
    """SGLang 0.5.23 (TokenizerManager._weight_update_session_call): /begin_weight_update and
    /end_weight_update take the model-update lock as its writer, so they wait for every /generate in
    flight (readers of it), unless generation is paused, whose pauser holds the engine. A request in
    flight is the test's read hold of the in-process server's lock: the begin stays blocked while it
    lasts (a wait that ends only when the test lets go: no timing decides it), and goes through while
    paused."""
    import argparse

    from hpcrl.rollout.reference_server import ReferenceServer, _Handler, _HTTPServer

    app = ReferenceServer(ReferenceModel(HF_CONFIG, seed=0), None, "tiny.json", argparse.Namespace())
    httpd = _HTTPServer(("127.0.0.1", 0), _Handler)
    httpd.app = app
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    client = EngineClient(f"http://127.0.0.1:{httpd.server_address[1]}", timeout_s=60)
    try:
        for route, session_after in ((client.begin_weight_update, True), (client.end_weight_update, False)):
            with app.update_lock.reading():  # a /generate in flight
                call = threading.Thread(target=route)
                call.start()
                call.join(1.0)
                assert call.is_alive(), f"{route.__name__} did not wait for the generation in flight"
                assert app.session_open is not session_after
            call.join(30)
            assert not call.is_alive() and app.session_open is session_after
        client.pause_generation(mode="in_place")
        with app.update_lock.reading():  # paused: the session goes through beside it
            client.begin_weight_update()
            client.end_weight_update()
        client.continue_generation()
    finally:
        client.close()
        httpd.shutdown()


def test_a_refusal_ends_the_wait_for_a_broadcast_nccl_has_only_queued(monkeypatch):
    """On NCCL a broadcast's future is done once the broadcast is queued on the stream (torch's
    Work.get_future), long before an engine that refused it could receive it. WeightSender asks the
    work itself (is_completed), so the refusal still ends the wait and names the engine. The work
    here is NCCL's as seen from the host: future done at once, not completed."""
    from concurrent.futures import Future

    import torch.distributed as dist

    class QueuedOnly:
        def get_future(self):
            done = torch.futures.Future()
            done.set_result(None)
            return done

        def is_completed(self):
            return False

    monkeypatch.setattr(dist, "broadcast", lambda *a, **k: QueuedOnly())
    sender = WeightSender.__new__(WeightSender)
    sender.group, sender.timeout_s, sender.group_name = object(), 60.0, "g"
    sender.clients, sender.engine_ids = [type("C", (), {"base_url": "http://e:1"})()], [5]
    dropped = []
    monkeypatch.setattr(WeightSender, "abandon", lambda self: dropped.append(True))
    refused: Future = Future()
    refused.set_exception(RuntimeError("update refused: weights are released"))
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match=r"refused before receiving; .* engine 5 \(http://e:1\): update refused"):
        sender._broadcast([torch.zeros(4)], [refused], "update_weights_from_distributed (bucket 1/1)")
    assert dropped == [True] and time.monotonic() - t0 < 30
