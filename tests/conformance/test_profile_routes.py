"""logging.profile_steps' engine side against SGLang 0.5.23's code: the /start_profile body hpcrl
sends holds only ProfileReq's fields (io_struct.py; SGLang's HTTP layer drops unknown keys without a
word), the reference engine's profile routes answer with SGLang's texts and refusals
(entrypoints/http_server.py, scheduler_components/profiler_manager.py) and name the trace as SGLang
does, and every ProfileReq field is either served or refused by the reference engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_request_bodies import _struct_fields

from hpcrl.controller.groups import RolloutGroup
from hpcrl.rollout import engine_profile
from hpcrl.rollout.client import EngineClient

SERVED = {"output_dir", "activities", "with_stack", "record_shapes", "profile_id", "profile_prefix"}


@pytest.fixture(scope="module")
def profile_req(sglang_root) -> dict[str, bool]:
    return _struct_fields(sglang_root)["ProfileReq"]


def test_the_start_body_hpcrl_sends_holds_profile_req_fields(profile_req):
    sent = []
    mp = pytest.MonkeyPatch()
    mp.setattr(EngineClient, "start", lambda self, method, route, payload=None, timeout_s=None:
               sent.append((route, payload)) or SimpleNamespace(result=lambda: "ok"))
    try:
        group = RolloutGroup(SimpleNamespace(ranks_of=lambda role: []), timeout_s=10)
        group.engines = [EngineClient("http://127.0.0.1:1"), EngineClient("http://127.0.0.1:2")]
        assert group.start_profile("/runs/x/profile/step_000003", "step3", cuda=True) == []
        assert group.stop_profile() == []
    finally:
        mp.undo()
    assert [route for route, _ in sent] == ["/start_profile"] * 2 + ["/stop_profile"] * 2
    for i, (_, body) in enumerate(sent[:2]):
        assert set(body) <= set(profile_req), sorted(set(body) - set(profile_req))
        assert body["output_dir"] == f"/runs/x/profile/step_000003/engine{i}" and body["activities"] == ["CPU", "GPU"]
    assert all(body is None for _, body in sent[2:])


def test_every_profile_req_field_is_served_or_refused(profile_req):
    fields = set(profile_req) - {"req_type", "rid", "http_worker_ipc"}  # set by SGLang, not by callers
    handled = SERVED | set(engine_profile.UNSERVED_FIELDS)
    assert fields == handled, sorted(fields ^ handled)
    assert not any(required for required in profile_req.values())


def test_answers_refusals_and_trace_names_are_sglangs(sglang_root):
    server = (sglang_root / "src/sglang/srt/entrypoints/http_server.py").read_text()
    manager = (sglang_root / "src/sglang/srt/managers/scheduler_components/profiler_manager.py").read_text()
    profile = engine_profile.EngineProfile(cuda=False)
    started = profile.start({"output_dir": "/nonexistent"})
    assert f'content="{started.encode("unicode_escape").decode()}"' in server
    for call, message in [(lambda: profile.start({}), "Profiling is already in progress. Call /stop_profile first."),
                          (lambda: engine_profile.EngineProfile(False).stop(),
                           "Profiling is not in progress. Call /start_profile first.")]:
        with pytest.raises(engine_profile.ProfileRefused, match=message.replace(".", r"\.")):
            call()
        assert f'message="{message}"' in manager
    stopped = "Stop profiling. This will take some time.\n"
    assert f'content="{stopped.encode("unicode_escape").decode()}"' in server
    # the trace's name: [prefix-]<profile_id>-TP-<tp rank>.trace.json.gz (DP/PP/EP parts only above size 1)
    assert 'filename_parts = [self.profile_id, f"TP-{get_parallel().tp_rank}"]' in manager
    assert '+ ".trace.json.gz"' in manager and 'stage_prefix = self.profile_prefix + "-"' in manager
    assert engine_profile.TRACE_SUFFIX == ".trace.json.gz"
