"""The reference engine answers hpcrl's /generate body in SGLang 0.5.23's response schema
(api_types.GenerateResponse: meta_info with finish_reason, output_token_logprobs entries as
(logprob, token_id, text) triples, weight_version), so the client code a run uses against the
reference engine reads SGLang's answers the same way."""

from __future__ import annotations


import pytest
from reference_engine import reference_server
from test_wire_formats import _generate_bodies


pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with reference_server(tmp_path_factory.mktemp("engine") / "engine.log") as (_, c):
        yield c


def test_reference_answers_decode_as_sglang_responses(api_types, client):
    (body,), prompts = _generate_bodies(1)
    answers = client.request("POST", "/generate", body)
    assert isinstance(answers, list) and len(answers) == len(prompts)
    for answer, sp in zip(answers, body["sampling_params"]):
        resp = api_types.GenerateResponse.from_json_value(answer)  # raises JsonContractError on a violation
        meta = resp.meta_info
        assert len(resp.output_ids) == meta.completion_tokens == len(meta.output_token_logprobs)
        assert len(resp.output_ids) <= sp["max_new_tokens"]
        assert type(meta.finish_reason).__name__ in ("FinishStop", "FinishLength"), meta.finish_reason
        for entry, token in zip(meta.output_token_logprobs, resp.output_ids):
            assert entry.token_id == token and entry.logprob <= 0.0
