"""The reference server as a real subprocess, driven over real HTTP by EngineClient and, for weight sync,
joined over gloo by this test process as rank 0 of SGLang's weight-update group (WeightSender).

Answers are checked against a twin ReferenceModel in this process with the server's weights. A request
the twin runs in the same batch gives the same bits: the same code on the same inputs, one thread each,
the same CPU kernels (the server inherits this environment). Requests the server batches as they come
(another batch shape) are compared within the fp32 rounding bound (numerics.logit_bound), and their
sampled tokens exactly, with seeds whose draws the test first shows to be clear of every near-tie
within that bound (`_clear_seed`): no rounding can then change a token.
"""

from __future__ import annotations

import http.client
import json
import math
import threading

import pytest
import torch
from numerics import U_FP32, logit_bound, logprob_bound, longest_reduction, routing_margin_ratio

from hpcrl.dist import free_port
from hpcrl.rollout.client import EngineClient, EngineError
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.hf_names import checkpoint_state_dict
from hpcrl.rollout.weight_sender import WeightSender, dtype_name, flatten_bucket
from reference_engine import GREEDY, HF_CONFIG, PROMPTS, reference_server

pytestmark = pytest.mark.timeout(300)
KEYS = HF_CONFIG["max_position_embeddings"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with reference_server(log) as (proc, client):
        yield proc, client, log


@pytest.fixture(scope="module")
def twin() -> ReferenceModel:
    """The server's model: the preset drawn from seed 0, as reference_server starts it."""
    return ReferenceModel(HF_CONFIG, seed=0)


def _logprobs(answer: dict) -> list[float]:
    return [lp for lp, _tok, _text in answer["meta_info"]["output_token_logprobs"]]


def _draw_is_clear(logits_V: torch.Tensor, token: int, u: float, temperature: float, apart: float) -> bool:
    """Whether the engine's unfiltered sampler (inverse CDF over the probabilities sorted in descending
    order, engine.py) draws `token` with uniform `u` from every logit vector within `apart` of logits_V
    (max norm): no other logit lies within 2 * apart of the token's (the tokens sorted before it stay
    the same; 8 ulps more for the sampler's own rounding of the order), and u lies a factor
    r = e^(4 apart / T) * (1 + 4 V u32) inside the token's CDF interval (each probability moves by at most
    e^(+-2 apart / T), the cumulative sums by the same factor plus their V-term rounding)."""
    z = logits_V.double() / temperature
    slack = 2 * apart / temperature + 8 * U_FP32 * (1 + z.abs().max().item())
    others = torch.cat([z[:token], z[token + 1:]])
    if (others - z[token]).abs().min().item() <= slack:
        return False
    p = torch.softmax(z, -1)
    before = p[z > z[token]].sum().item()
    r = math.exp(4 * apart / temperature) * (1 + 4 * z.numel() * U_FP32)
    return before * r < u and u * r < before + p[token].item()


def _clear_seed(twin: ReferenceModel, prompt: list[int], params: dict, first: int) -> tuple[dict, dict]:
    """The first of seeds first, first + 1000, ... whose twin answer draws every token clear of
    near-ties (`_draw_is_clear` on a full forward of the answer, within logit_bound of any evaluation)
    and routes every token clear of them: its params with that seed, and the twin's answer."""
    steps = params["max_new_tokens"]
    for seed in range(first, first + 50_000, 1000):
        sp = {**params, "sampling_seed": seed}
        (out,) = twin.generate([prompt], [sp])
        with torch.inference_mode():
            full = twin.model(input_ids=torch.tensor([prompt + out["output_ids"]]), output_router_logits=True)
        if routing_margin_ratio(list(full.router_logits), HF_CONFIG["num_experts_per_tok"],
                                longest_reduction(HF_CONFIG, KEYS)) <= 1:
            continue
        logits = full.logits[0, len(prompt) - 1:-1].float()
        apart = logit_bound(HF_CONFIG, logits.abs().max().item(), KEYS)
        u = torch.rand(steps, generator=torch.Generator().manual_seed(seed))  # the engine's draws
        if all(_draw_is_clear(logits[t], tok, u[t].item(), sp["temperature"], apart)
               for t, tok in enumerate(out["output_ids"])):
            return sp, {**out, "bound": logprob_bound(apart, HF_CONFIG["vocab_size"], sp["temperature"])}
    raise AssertionError(f"no seed of 50 draws clear of near-ties for prompt {prompt}")


def test_generate_answers_in_sglang_shapes(server, twin):
    _, client, log = server
    assert log.read_text().count("ready on http://127.0.0.1:") == 1
    single = client.generate(PROMPTS[0], GREEDY, return_logprob=True, rid="req-1")
    assert set(single) == {"text", "output_ids", "meta_info"}
    meta = single["meta_info"]
    assert meta["id"] == "req-1" and meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["cached_tokens"] == 0 and isinstance(meta["e2e_latency"], float) and meta["weight_version"]
    triples = meta["output_token_logprobs"]
    assert [t for _, t, _ in triples] == single["output_ids"] and all(x is None for _, _, x in triples)
    assert all(lp < 0 for lp, _, _ in triples)
    assert single["output_ids"] == twin.generate([PROMPTS[0]], [GREEDY])[0]["output_ids"]
    batch = client.generate(PROMPTS, [GREEDY] * 3)
    assert isinstance(batch, list) and len(batch) == 3
    # in request order: the twin's batch of the same three prompts gives the same bits
    assert [a["output_ids"] for a in batch] == [a["output_ids"] for a in twin.generate(PROMPTS, [GREEDY] * 3)]
    assert "output_token_logprobs" not in batch[0]["meta_info"]
    again = client.generate(PROMPTS, [GREEDY] * 3)
    ids = [a["meta_info"]["id"] for a in batch + again]  # SGLang's shape: 32 hex digits, all distinct
    assert len(set(ids)) == 6 and all(len(i) == 32 and int(i, 16) >= 0 for i in ids), ids
    by_text = client.generate(text="12+3=", sampling_params={"max_new_tokens": 2, "temperature": 0})
    assert by_text["meta_info"]["prompt_tokens"] == 6 and isinstance(by_text["text"], str)
    assert client.model_info()["model_type"] == "qwen3_moe"
    assert client.server_info()["tp_size"] == 1
    client.flush_cache()


def test_concurrent_requests_are_answered_as_if_alone(server, twin):
    """Eight concurrent requests: the server runs each as a batch of its own, so each answer is the
    server's answer to that request sent alone, bit for bit (log-probs too: an asynchronous run's
    resume depends on it), and the twin's tokens. The same eight as one batched request: tokens
    exactly, log-probs within the bound of the twin's (other rows and their padding move them by
    rounding), each seed chosen so that no near-tie lets rounding change a token."""
    _, client, _ = server
    prompts = [PROMPTS[i % 3] for i in range(8)]
    chosen = [_clear_seed(twin, prompts[i], {"temperature": 1.0, "max_new_tokens": 8}, 100 + i)
              for i in range(8)]
    params = [sp for sp, _ in chosen]
    alone = [out for _, out in chosen]
    batched = client.generate(prompts, params, return_logprob=True)
    got: dict[int, dict] = {}

    def one(i: int) -> None:
        got[i] = client.generate(prompts[i], params[i], return_logprob=True)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    one_by_one = [client.generate(prompts[i], params[i], return_logprob=True) for i in range(8)]
    assert len({tuple(a["output_ids"]) for a in alone}) == 8  # a mixed-up answer would show
    for i in range(8):
        assert got[i]["output_ids"] == one_by_one[i]["output_ids"] == alone[i]["output_ids"], i
        assert _logprobs(got[i]) == _logprobs(one_by_one[i]), i  # bit for bit: the request alone decides
        for answer in (got[i], batched[i]):
            assert answer["output_ids"] == alone[i]["output_ids"], i
            want = torch.tensor(alone[i]["output_logprobs"])
            torch.testing.assert_close(torch.tensor(_logprobs(answer)), want, atol=alone[i]["bound"], rtol=0)


@pytest.mark.parametrize("body, status, match", [
    (b"{not json", 400, "not valid JSON"),
    (b'{"input_ids": [1, 2], "sampling_params": {"top_p": 0}}', 400, "sampling_params.top_p=0"),
    (b'{"input_ids": [1, 2], "text": "ab"}', 400, "exactly one of 'input_ids' and 'text'"),
    (b'{"input_ids": [1, 2], "stream": true}', 400, "stream=true is not supported"),
    (b'{"input_ids": [[1, 2], [3]], "sampling_params": [{}]}', 400, "list of 1 but the request has 2"),
    (b'{"input_ids": [1, 2], "lora_path": "x"}', 400, "'lora_path' is not supported"),
    (b'{"input_ids": [1, 2], "return_hidden_states": true}', 400, "'return_hidden_states' is not supported"),
    (b'{"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}, "not_a_field": 3}', 200, None),
])
def test_bad_generate_requests_get_400_with_a_message(server, body, status, match):
    """Refusals as SGLang's, and loud where the reference engine does not serve what SGLang would."""
    _, client, _ = server
    conn = http.client.HTTPConnection(client.host, client.port, timeout=30)
    conn.request("POST", "/generate", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    assert resp.status == status
    if match is None:  # SGLang ignores a key /generate does not have, and so does the reference engine
        assert len(payload["output_ids"]) == 1
    else:
        assert match in payload["error"]["message"]


def test_client_errors_name_url_route_status_and_message(server):
    _, client, _ = server
    with pytest.raises(EngineError) as info:
        client.generate([1, 70], {})
    err = info.value
    assert err.status == 400 and err.route == "/generate" and err.url == client.base_url
    assert "input_ids[0] holds 70" in str(err) and client.base_url in str(err)
    with pytest.raises(EngineError, match="not a route") as info:
        client.request("GET", "/no_such_route")
    assert info.value.status == 404
    dead = EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    assert dead.health() is False
    with pytest.raises(EngineError, match="no HTTP answer"):
        dead.flush_cache()


def test_started_requests_answer_later_and_survive_a_closed_connection(server):
    """`start` writes the request and returns; `result` reads the answer on the same thread. A
    kept-alive connection that the server has closed is replaced before writing (nothing is lost)."""
    import socket

    _, client, _ = server
    pending = client.start("POST", "/generate", {"input_ids": PROMPTS[0], "sampling_params": GREEDY})
    answer = pending.result()
    assert answer["output_ids"] == client.generate(PROMPTS[0], GREEDY)["output_ids"]
    version = client.request("GET", "/get_weight_version")
    old = client._local.conn
    assert not client._dropped()
    old.sock.shutdown(socket.SHUT_RD)  # what a server's idle close looks like from here: EOF
    assert client._dropped()
    assert client.start("GET", "/get_weight_version").result() == version
    assert client._local.conn is not old
    with pytest.raises(EngineError, match="not a route") as info:
        client.start("POST", "/no_such_route", {}).result()
    assert info.value.status == 404
    dead = EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=5)
    with pytest.raises(EngineError, match="no HTTP answer"):
        dead.start("POST", "/flush_cache")


def test_weight_routes_refuse_bad_calls(server):
    _, client, _ = server
    client.begin_weight_update()
    try:
        with pytest.raises(EngineError, match="Please call `init_weights_update_group` first") as info:
            client.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[64]])
        assert info.value.status == 400
    finally:
        client.end_weight_update()
    with pytest.raises(EngineError, match="no weight-update session is open"):
        client.end_weight_update()
    with pytest.raises(EngineError, match="does not exist"):
        client.destroy_weights_update_group("nope")
    with pytest.raises(EngineError, match="backend 'nccl' needs CUDA"):
        client.init_weights_update_group("127.0.0.1", free_port(), 1, 2, backend="nccl")


def test_shard_route_refuses_bad_calls(server):
    """hpcrl's /hpcrl/update_weights_reshard names the bad field, a model mismatch, a missing group."""
    from hpcrl.rollout.reshard_route import PlanRequest, spec_at_dtype, spec_fingerprint
    from moe.layouts import RolloutLayout, TrainerLayout

    _, client, _ = server
    spec = spec_at_dtype(HF_CONFIG, "float32")
    good = {**PlanRequest(TrainerLayout(ep=2, dp=2, vocab_divisible_by=1), RolloutLayout(), 1 << 20).to_json(),
            "group_name": "g", "engine_rank": 0, "deadline_s": 5, "spec_sha256": spec_fingerprint(spec)}
    with pytest.raises(EngineError, match="field 'trainer' must be a dict"):
        client.update_weights_reshard({**good, "trainer": 3})
    with pytest.raises(EngineError, match="bad layout or topology fields"):
        client.update_weights_reshard({**good, "rollout": {"engines": 2}})
    with pytest.raises(EngineError, match="field 'topology' must be a dict"):
        client.update_weights_reshard({**good, "topology": "one host"})
    with pytest.raises(EngineError, match="bad layout or topology fields"):
        client.update_weights_reshard({**good, "topology": {"hosts": 1}})
    with pytest.raises(EngineError, match=r"Topology.gpus_per_node=0 must be a positive int"):
        client.update_weights_reshard({**good, "topology": {"gpus_per_node": 0}})
    other = spec_at_dtype({**HF_CONFIG, "num_hidden_layers": 1}, "float32")
    with pytest.raises(EngineError, match="trainer and engine would plan different models"):
        client.update_weights_reshard({**good, "spec_sha256": spec_fingerprint(other)})
    with pytest.raises(EngineError, match="engine_rank=1"):
        client.update_weights_reshard({**good, "engine_rank": 1})
    with pytest.raises(EngineError, match=r"field 'verify'='crc32' must be one of sampled, full, off"):
        client.update_weights_reshard({**good, "verify": "crc32"})
    with pytest.raises(EngineError, match="Please call `init_weights_update_group` first") as info:
        client.update_weights_reshard(good)
    assert info.value.status == 400


def _server_greedy(client: EngineClient) -> list[dict]:
    return client.generate(PROMPTS, [GREEDY] * 3, return_logprob=True)


def _assert_matches_local(answers: list[dict], local: ReferenceModel) -> None:
    """The server's answers to the three greedy prompts are `local`'s bit for bit: the same batch
    through the same code on the same weights (any weight that did not arrive changes them)."""
    expected = local.generate(PROMPTS, [GREEDY] * 3)
    for got, exp in zip(answers, expected):
        assert got["output_ids"] == exp["output_ids"]
        assert _logprobs(got) == exp["output_logprobs"]


def test_weight_sync_per_tensor_and_flattened_bucket(server):
    _, client, _ = server
    sender = WeightSender([client], backend="gloo", timeout_s=120)
    sender.connect()
    try:
        before = _server_greedy(client)
        local = ReferenceModel(HF_CONFIG, seed=123)
        expected = local.generate(PROMPTS, [GREEDY] * 3)
        diff = max(abs(a - b) for ans, exp in zip(before, expected)
                   for a, b in zip(_logprobs(ans), exp["output_logprobs"]))
        assert diff > 1e-3, "server and local model should start from different weights"

        # SGLang's refusals come before the receive: no broadcast is posted for them
        name, tensor = "model.norm.weight", torch.full((64,), 3.0)
        with pytest.raises(EngineError, match=r"must run between begin_weight_update\(\) and "
                                              r"end_weight_update\(\)") as info:
            client.update_weights_from_distributed([name], ["float32"], [[64]],
                                                   load_format="flattened_bucket")
        assert info.value.status == 400
        with pytest.raises(EngineError, match="no weight-update session is open") as info:
            client.end_weight_update()
        assert info.value.status == 400
        client.begin_weight_update()
        with pytest.raises(EngineError, match="a weight-update session is already open") as info:
            client.begin_weight_update()
        assert info.value.status == 400
        with pytest.raises(EngineError, match=r"Failed to receive weights: Group nope not in") as info:
            client.update_weights_from_distributed([name], ["float32"], [[64]], group_name="nope")
        client.end_weight_update()
        _assert_same_answers(_server_greedy(client), before)

        # per tensor, several buckets
        named = list(checkpoint_state_dict(local.model).items())
        sent = sender.push(named, bucket_bytes=32 << 10, flattened=False, weight_version="v1")
        assert sent == sum(t.numel() * t.element_size() for _, t in named)
        after = _server_greedy(client)
        _assert_matches_local(after, local)
        assert after[0]["meta_info"]["weight_version"] == "v1"

        # flattened buckets with mixed dtypes: some tensors travel as bfloat16
        local2 = ReferenceModel(HF_CONFIG, seed=456)
        named2 = [(n, t.to(torch.bfloat16) if i % 3 == 0 else t)
                  for i, (n, t) in enumerate(checkpoint_state_dict(local2.model).items())]
        local2.load_weights(named2)  # the local twin holds the same bf16-rounded values
        assert {dtype_name(t.dtype) for _, t in named2} == {"bfloat16", "float32"}
        sender.push(named2, bucket_bytes=20 << 10, flattened=True, weight_version="v2")
        after2 = _server_greedy(client)
        _assert_matches_local(after2, local2)
        assert after2[0]["meta_info"]["weight_version"] == "v2"
        weight = client.get_weights_by_name("model.layers.1.mlp.experts.2.down_proj.weight", truncate_size=5)
        torch.testing.assert_close(torch.tensor(weight),
                                   local2.get_weight("model.layers.1.mlp.experts.2.down_proj.weight")[:5],
                                   atol=0, rtol=0)

        # an unknown name inside a session: refused after the broadcast, nothing changes
        fused = "model.layers.0.mlp.experts.gate_up_proj"
        with pytest.raises(RuntimeError, match=f"unknown weight name '{fused}'"):
            sender.push([("model.norm.weight", tensor), (fused, torch.zeros(4, 64, 64))],
                        bucket_bytes=1 << 20)
        _assert_same_answers(_server_greedy(client), after2)
    finally:
        sender.close()
    assert client.server_info()["internal_states"][0]["weight_update_groups"] == []


def test_release_and_resume_memory(server):
    _, client, _ = server
    client.release_memory_occupation(["weights", "kv_cache"])
    with pytest.raises(EngineError, match=r"released \(tags \['kv_cache', 'weights'\]\)") as info:
        client.generate(PROMPTS[0], GREEDY)
    assert info.value.status == 400
    client.resume_memory_occupation(["weights"])
    with pytest.raises(EngineError, match=r"tags \['kv_cache'\]"):
        client.generate(PROMPTS[0], GREEDY)
    with pytest.raises(EngineError, match=r"cannot resume \['weights'\]: not released"):
        client.resume_memory_occupation(["weights"])
    with pytest.raises(EngineError, match="unknown memory tags"):
        client.release_memory_occupation(["gpu"])
    client.resume_memory_occupation()
    assert len(client.generate(PROMPTS[0], GREEDY)["output_ids"]) == 12


def test_pause_holds_generation_until_continue(server):
    _, client, _ = server
    client.pause_generation()
    result: list = []
    worker = threading.Thread(target=lambda: result.append(client.generate(PROMPTS[1], GREEDY)))
    worker.start()
    worker.join(1.0)
    assert worker.is_alive() and not result
    client.continue_generation()
    worker.join(60)
    assert len(result[0]["output_ids"]) == 12


def _call_and_catch(fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except EngineError as exc:
        return exc


def _assert_same_answers(a: list[dict], b: list[dict]) -> None:
    for x, y in zip(a, b):
        assert x["output_ids"] == y["output_ids"]
        assert _logprobs(x) == _logprobs(y)


def _trace_ops(path) -> list[str]:
    import gzip

    return [e["name"] for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"]


def test_profile_routes_trace_the_batches_between_start_and_stop_as_sglang_names_them(server, tmp_path):
    """SGLang's /start_profile and /stop_profile (hpcrl/rollout/engine_profile.py): the forward batches
    in between, in <output_dir>/<profile_id>-TP-0.trace.json.gz; SGLang's refusals of a second start
    and of a stop without a start (its RuntimeError: HTTP 500); what the engine cannot do is refused."""
    _, client, _ = server
    client.generate(PROMPTS[:1], [GREEDY], return_logprob=True)  # before the profile: not in it
    assert client.request("POST", "/start_profile", {"output_dir": str(tmp_path), "profile_id": "p1",
                                                      "activities": ["CPU"]}) == "Start profiling.\n"
    with pytest.raises(EngineError, match=r"Profiling is already in progress\. Call /stop_profile first\.") as exc:
        client.request("POST", "/start_profile", {"output_dir": str(tmp_path)})
    assert exc.value.status == 500
    client.generate(PROMPTS, [GREEDY] * 3, return_logprob=True)
    client.generate(PROMPTS[:1], [GREEDY], return_logprob=True)  # a second batch joins the same trace
    assert client.request("GET", "/stop_profile") == "Stop profiling. This will take some time.\n"
    [trace] = list(tmp_path.iterdir())
    assert trace.name == "p1-TP-0.trace.json.gz"
    ops = _trace_ops(trace)
    assert {"aten::topk", "aten::softmax"} <= set(ops)  # the MoE router's, in every forward
    # the same first batch alone traces about half as many forwards (12 decode steps each)
    client.request("POST", "/start_profile", {"output_dir": str(tmp_path / "one"), "profile_id": "p2"})
    client.generate(PROMPTS, [GREEDY] * 3, return_logprob=True)
    client.request("POST", "/stop_profile")
    assert ops.count("aten::topk") > _trace_ops(tmp_path / "one" / "p2-TP-0.trace.json.gz").count("aten::topk")
    with pytest.raises(EngineError, match=r"Profiling is not in progress\. Call /start_profile first\.") as exc:
        client.request("POST", "/stop_profile")
    assert exc.value.status == 500
    for body, what in [({"num_steps": 3}, "field 'num_steps' is not supported"),
                       ({"activities": ["CPU", "MEM"]}, r"activities \['MEM'\] are not supported")]:
        with pytest.raises(EngineError, match=what) as exc:
            client.request("POST", "/start_profile", body)
        assert exc.value.status == 400
