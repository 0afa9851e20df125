"""Input-token log-probs (SGLang's logprob_start_len, issue 32's scoring requests): hpcrl.rollout.
engine_score directly, and the reference server as a real subprocess driven by EngineClient.

Every value is compared with log_softmax of an independent transformers forward of the one sequence
(unpadded, batch 1, fp32) within numerics.logprob_bound(logit_bound(...)): n = longest_reduction over
the model's context (64 keys), depth = forward_depth of the 2-layer model, magnitude = max|logit| of
that forward. The bound holds only where both evaluations route every token alike, so each test first
shows the routing margin of its sequences above 1.5 (numerics.routing_margin_ratio). A real error, the
values one position off (each token's log-prob read at its own position instead of the one before),
is shown to exceed the bound.
"""

from __future__ import annotations

import http.client
import json

import pytest
import torch
from numerics import grouped_margin_ratio, logit_bound, logprob_bound, longest_reduction, routing_margin_ratio

from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.client import EngineError, parse_scores, scoring_body
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.engine_score import input_token_logprobs
from reference_engine import HF_CONFIG, PROMPTS, reference_server, server_twin

pytestmark = pytest.mark.timeout(300)
KEYS = HF_CONFIG["max_position_embeddings"]
V = HF_CONFIG["vocab_size"]
SAMPLED = {"temperature": 1.0, "max_new_tokens": 10, "ignore_eos": True}


@pytest.fixture(scope="module")
def twin():
    """The server's model, one thread (reference_engine.server_twin)."""
    with server_twin() as model:
        yield model


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with reference_server(tmp_path_factory.mktemp("engine") / "engine.log") as (_, c):
        yield c


def _reference(twin: ReferenceModel, seq: list[int]) -> tuple[torch.Tensor, float]:
    """log_softmax [n, V] of an independent full forward of `seq` alone, and the bound on how far
    another evaluation's log-probs may lie from it; asserts the routing margin the bound needs."""
    with torch.inference_mode():
        out = twin.model(input_ids=torch.tensor([seq]), output_router_logits=True)
    ratio = routing_margin_ratio(list(out.router_logits), HF_CONFIG["num_experts_per_tok"],
                                 longest_reduction(HF_CONFIG, KEYS))
    assert ratio > 1.5, f"{seq}: routing margin {ratio:.2f}; pick other tokens (near-tie in a router)"
    logits = out.logits[0].float()
    apart = logit_bound(HF_CONFIG, logits.abs().max().item(), KEYS)
    return torch.log_softmax(logits, -1), logprob_bound(apart, V)


def _expected(logp: torch.Tensor, seq: list[int], start: int) -> list[float]:
    """log p(seq[p] | seq[:p]) for p = start + 1 .. n - 1 (row p - 1 of the forward scores token p)."""
    return [logp[p - 1, seq[p]].item() for p in range(start + 1, len(seq))]


def _close(got: list[float], want: list[float], bound: float) -> None:
    assert len(got) == len(want)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), atol=bound, rtol=0)


def test_engine_score_positions_values_and_the_first_none(twin):
    """A ragged, left-padded batch: n - L entries from each start L, the first None, the rest equal to
    the independent forward's; L = n - 1 gives [None] and L = n nothing; one position off is caught."""
    seqs = [[1, 5, 6, 7, 8, 9, 24, 22], [1, 20, 21, 63], PROMPTS[2] + [52, 19, 4, 40], [7, 8]]
    starts = [0, 2, 5, 1]
    got = input_token_logprobs(twin, seqs, starts)
    for seq, start, values in zip(seqs, starts, got):
        assert len(values) == len(seq) - start and values[0] is None
        logp, bound = _reference(twin, seq)
        _close(values[1:], _expected(logp, seq, start), bound)
        if len(values) > 2:  # the token's log-prob at its own position instead: far outside the bound
            shifted = [logp[p, seq[p]].item() for p in range(start + 1, len(seq))]
            assert max(abs(a - b) for a, b in zip(values[1:], shifted)) > 10 * bound
    assert input_token_logprobs(twin, [[3, 4, 5], [3, 4, 5]], [3, 2]) == [[], [None]]
    assert input_token_logprobs(twin, [], []) == []


def test_engine_score_through_transformers_forward_deepseek_v3():
    """DeepSeek-V3 (MLA, group-limited routing; the engine's generation runs transformers' forward):
    the same values as an independent forward, its routing margin (grouped_margin_ratio) shown first."""
    cfg = load_hf_config("tiny-deepseek-v3", None)
    engine = ReferenceModel(cfg, seed=0)
    seqs, starts = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 20, 21, 22]], [2, 0]
    keys = cfg["max_position_embeddings"]
    biases = [layer.mlp.gate.e_score_correction_bias for layer in engine.model.model.layers
              if hasattr(layer.mlp, "gate")]
    for seq, start, values in zip(seqs, starts, input_token_logprobs(engine, seqs, starts)):
        with torch.inference_mode():
            out = engine.model(input_ids=torch.tensor([seq]), output_router_logits=True)
        ratio = grouped_margin_ratio([r.reshape(-1, r.shape[-1]) for r in out.router_logits], biases, cfg,
                                     longest_reduction(cfg, keys), cfg.get("first_k_dense_replace", 0))
        assert ratio > 1.5, f"{seq}: routing margin {ratio:.2f}; pick other tokens"
        logits = out.logits[0].float()
        bound = logprob_bound(logit_bound(cfg, logits.abs().max().item(), keys), cfg["vocab_size"])
        assert values[0] is None and len(values) == len(seq) - start
        _close(values[1:], _expected(torch.log_softmax(logits, -1), seq, start), bound)


@pytest.mark.parametrize("seqs, starts, match", [
    ([[1, 2]], [3], r"starts\[0\]=3 must be an integer in \[0, 2\]"),
    ([[1, 2]], [-1], r"starts\[0\]=-1"),
    ([[1, 2]], [True], r"starts\[0\]=True"),
    ([[1, V]], [0], rf"sequences\[0\] holds {V}; token ids must be integers in \[0, {V}\)"),
    ([[]], [0], r"sequences\[0\] must be a non-empty list"),
    ([[1, 2]], [0, 1], "1 sequences but 2 starts"),
])
def test_engine_score_refuses_bad_input(twin, seqs, starts, match):
    with pytest.raises(ValueError, match=match):
        input_token_logprobs(twin, seqs, starts)


def test_scoring_answers_in_sglangs_shape(client, twin):
    """The scoring body (max_new_tokens 0, logprob_start_len = prompt length - 1): no output, and
    input_token_logprobs = [None, prompt[-1], None] then one triple per response token."""
    pairs = [(PROMPTS[0], [9, 24, 22, 59]), (PROMPTS[1], [63, 40]), (PROMPTS[2], [])]
    answers = client.request("POST", "/generate", scoring_body(pairs))
    assert isinstance(answers, list) and len(answers) == 3
    for (prompt, response), answer in zip(pairs, answers):
        meta = answer["meta_info"]
        assert answer["output_ids"] == [] and meta["finish_reason"] == {"type": "length", "length": 0}
        assert meta["output_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 0
        entries = meta["input_token_logprobs"]
        # SGLang reports the id vocab_size - 1 (63 here) as 0
        assert [t for _, t, _ in entries] == [t if t < V - 1 else 0 for t in [prompt[-1], *response]]
        assert entries[0][0] is None and all(text is None for _, _, text in entries)
        seq = prompt + response
        logp, bound = _reference(twin, seq)
        _close([lp for lp, _, _ in entries[1:]], _expected(logp, seq, len(prompt) - 1), bound)
    assert client.score(pairs, vocab_size=V) == [
        [lp for lp, _, _ in a["meta_info"]["input_token_logprobs"][1:]] for a in answers]


@pytest.mark.parametrize("params", [SAMPLED, {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}])
def test_scores_equal_the_generations_output_logprobs(client, twin, params):
    """What a generation returned as output_token_logprobs (temperature 1: unscaled), scored back."""
    sp = [{**params, "sampling_seed": 7 + i} for i in range(3)]
    generated = client.generate(PROMPTS, sp, return_logprob=True)
    pairs = [(p, a["output_ids"]) for p, a in zip(PROMPTS, generated)]
    for (prompt, response), answer, scores in zip(pairs, generated, client.score(pairs, vocab_size=V)):
        _, bound = _reference(twin, prompt + response)
        _close(scores, [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]], bound)


def test_input_logprobs_ignore_the_requests_temperature(client, twin):
    """SGLang scales output log-probs by the temperature, input log-probs never: a request at T = 0.5
    with logprob_start_len 0 gets its prompt's log-probs at T = 1 and its output's at T = 0.5."""
    prompt = PROMPTS[2]
    answer = client.generate(prompt, {"temperature": 0.5, "max_new_tokens": 4, "sampling_seed": 3,
                                      "ignore_eos": True}, return_logprob=True, logprob_start_len=0)
    meta = answer["meta_info"]
    seq = prompt + answer["output_ids"]
    logp, bound = _reference(twin, seq)
    entries = meta["input_token_logprobs"]
    assert [t for _, t, _ in entries] == prompt and entries[0][0] is None
    _close([lp for lp, _, _ in entries[1:]], _expected(logp, prompt, 0), bound)
    with torch.inference_mode():
        logits = twin.model(input_ids=torch.tensor([seq])).logits[0].float()
    at_half = torch.log_softmax(logits / 0.5, -1)
    outputs = [lp for lp, _, _ in meta["output_token_logprobs"]]
    # logprob_bound at T = 0.5 (2 * apart / T + rounding) is at most twice the T = 1 bound
    _close(outputs, [at_half[p - 1, seq[p]].item() for p in range(len(prompt), len(seq))], 2 * bound)
    assert max(abs(a - b) for a, b in zip(outputs, _expected(logp, seq, len(prompt) - 1)[:len(outputs)])) \
        > 10 * bound  # the two temperatures are told apart


def test_scoring_leaves_generation_untouched(client):
    """One batched request mixing generation items and scoring items: each generation item answers
    bit for bit what it answers without the scoring items, and each scoring item what it answers
    alone (the scoring rows are their own forward; max_new_tokens 0 rows are not generated)."""
    gen_sp = [{**SAMPLED, "sampling_seed": 11}, {**SAMPLED, "sampling_seed": 12}]
    alone = client.generate([PROMPTS[0], PROMPTS[1]], gen_sp, return_logprob=True)
    pairs = [(PROMPTS[2], [5, 6, 7, 8]), (PROMPTS[0], alone[0]["output_ids"])]
    scored_alone = client.score(pairs)
    body = scoring_body(pairs)
    mixed = client.request("POST", "/generate", {
        "input_ids": [PROMPTS[0], body["input_ids"][0], PROMPTS[1], body["input_ids"][1]],
        "sampling_params": [gen_sp[0], {"max_new_tokens": 0}, gen_sp[1], {"max_new_tokens": 0}],
        "return_logprob": True, "logprob_start_len": [-1, len(PROMPTS[2]) - 1, -1, len(PROMPTS[0]) - 1]})
    for got, want in zip([mixed[0], mixed[2]], alone):
        assert got["output_ids"] == want["output_ids"]
        assert got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
        assert got["meta_info"]["input_token_logprobs"] == []
    assert parse_scores([mixed[1], mixed[3]], pairs) == scored_alone


def test_start_at_the_prompts_end_and_default(client):
    """L = P: no input entries, the output as usual; L = -1 (the default): no input entries;
    without return_logprob no log-prob key at all, whatever L (SGLang resets it to -1)."""
    prompt = PROMPTS[1]
    greedy = {"temperature": 0, "max_new_tokens": 3, "ignore_eos": True}
    for start in (len(prompt), -1):
        meta = client.generate(prompt, greedy, return_logprob=True, logprob_start_len=start)["meta_info"]
        assert meta["input_token_logprobs"] == [] and meta["output_token_logprobs_length"] == 3
    answer = client.generate(prompt, greedy, return_logprob=True, logprob_start_len=len(prompt) - 1)
    assert answer["meta_info"]["input_token_logprobs"] == [[None, prompt[-1], None]]
    meta = client.generate(prompt, greedy, logprob_start_len=len(prompt) + 5)["meta_info"]
    assert "input_token_logprobs" not in meta and "output_token_logprobs" not in meta


@pytest.mark.parametrize("fields, match", [
    ({"logprob_start_len": 4}, r"req.logprob_start_len=4 is higher than the number of input tokens "
                               r"len\(req.origin_input_ids\)=3. Please use a smaller logprob_start_len."),
    ({"logprob_start_len": -2}, r"'logprob_start_len'=-2 \(item 0\) must be -1 .* in \[0, 3\]"),
    ({"logprob_start_len": "1"}, r"'logprob_start_len'='1' \(item 0\) must be an integer"),
    ({"logprob_start_len": True}, r"'logprob_start_len'=True \(item 0\) must be an integer"),
    ({"logprob_start_len": [1]}, r"is a list but the request has one prompt"),
    ({"top_logprobs_num": 2}, r"top log-probs \(top_logprobs_num, token_ids_logprob\) are not implemented"),
    ({"token_ids_logprob": [1, 2]}, r"top log-probs"),
])
def test_bad_logprob_requests_get_400(client, fields, match):
    with pytest.raises(EngineError, match=match) as info:
        client.generate(PROMPTS[1], {"max_new_tokens": 0}, return_logprob=True, **fields)
    assert info.value.status == 400


def test_a_batch_with_a_wrong_number_of_starts_gets_400(client):
    conn = http.client.HTTPConnection(client.host, client.port, timeout=30)
    body = {"input_ids": PROMPTS, "return_logprob": True, "logprob_start_len": [0, 1]}
    conn.request("POST", "/generate", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    payload = json.loads(resp.read())
    conn.close()
    assert resp.status == 400 and "logprob_start_len is a list of 2 but the request has 3" in \
        payload["error"]["message"]


def _answer(entries: list) -> dict:
    return {"text": "", "output_ids": [], "meta_info": {"input_token_logprobs": entries}}


@pytest.mark.parametrize("answers, match", [
    ({"meta_info": {}}, r"must be a list of one answer per pair \(1\); got dict"),
    ([], r"got a list of 0"),
    ([{"meta_info": {}}], r"answer 0 has no meta_info\['input_token_logprobs'\] list"),
    ([_answer([[None, 8, None], [-1.0, 9, None]])], r"2 input_token_logprobs entries, expected 3"),
    ([_answer([[-0.5, 8, None], [-1.0, 9, None], [-2.0, 24, None]])], r"\[0\] has logprob -0.5; SGLang"),
    ([_answer([[None, 9, None], [-1.0, 24, None], [-2.0, 5, None]])], r"\[0\] is for token 9 but the body "
                                                                      r"sent 8"),
    ([_answer([[None, 8, None], [None, 9, None], [-2.0, 24, None]])], r"\[1\] has logprob None, not a "
                                                                      r"finite"),
    ([_answer([[None, 8, None], [-1.0, 9], [-2.0, 24, None]])], r"\[1\]=\[-1.0, 9\] is not a \[logprob"),
    ([_answer([[None, 8, None], [-1.0, 0, None], [-2.0, 24, None]])], r"\[1\] is for token 0 but the body "
                                                                      r"sent 9"),
])
def test_parse_scores_names_what_is_wrong(answers, match):
    """A malformed answer to the scoring of (PROMPTS[0], [9, 24]) is refused, naming the entry.
    With vocab_size, id 0 stands only for vocab_size - 1 (SGLang's report of it)."""
    with pytest.raises(ValueError, match=match):
        parse_scores(answers, [(PROMPTS[0], [9, 24])], vocab_size=V)


def test_parse_scores_reads_sglangs_report_of_the_last_id():
    answer = _answer([[None, 8, None], [-1.0, 0, None], [-2.0, 24, "x"]])
    assert parse_scores([answer], [(PROMPTS[0], [V - 1, 24])], vocab_size=V) == [[-1.0, -2.0]]
    assert parse_scores([answer], [(PROMPTS[0], [9, 24])]) == [[-1.0, -2.0]]  # no vocab_size: any id


def test_scoring_body_refuses_what_it_cannot_score():
    with pytest.raises(ValueError, match="at least one"):
        scoring_body([])
    with pytest.raises(ValueError, match=r"pairs\[1\] has an empty prompt"):
        scoring_body([([1], [2]), ([], [3])])
    body = scoring_body([(torch.tensor([1, 2]).tolist(), (3,)), ([4], [])])
    assert body == {"input_ids": [[1, 2, 3], [4]], "sampling_params": {"max_new_tokens": 0},
                    "return_logprob": True, "logprob_start_len": [1, 0]}
