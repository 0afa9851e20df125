"""Input-token log-probs (issue 32's scoring requests) against SGLang 0.5.23's own code: the body
hpcrl's client sends (scoring_body) holds GenerateReqInput fields and passes SGLang's /generate
contract (api_types.py); the reference engine's answer decodes as SGLang's GenerateResponse, and its
meta_info["input_token_logprobs"] is what SGLang's pipeline makes of the same tokens, run from its
source: the scheduler's logprob_start_len resolution and refusal (scheduler.py), the extend start
(schedule_batch.compute_extend_logprob_start_len), the token each logit row scores (schedule_batch's
prepare-for-extend block), the row count and the None-first shift with the id clip
(logprob_result_processor.py), the triples (tokenizer_manager.detokenize_logprob_tokens). That
pipeline is fed the rows of an independent full forward's log_softmax (SGLang's logit rows; the
logits processor keeps rows start .. n - 1, logits_processor.py `_get_pruned_states`): positions,
None and ids must agree exactly, values within numerics.logprob_bound (the bound of
tests/unit/test_input_logprobs.py, routing margins shown there for these prompts' kind).

The functions are compiled from SGLang's source (test_routed_experts._compile), as importing their
modules pulls in the whole runtime.
"""

from __future__ import annotations

import array
import ast
import types
from pathlib import Path

import pytest
import torch
from numerics import logit_bound, logprob_bound
from reference_engine import HF_CONFIG, reference_server, server_twin
from test_request_bodies import _struct_fields
from test_routed_experts import _compile

from hpcrl.rollout.client import EngineError, parse_scores, scoring_body

pytestmark = pytest.mark.timeout(300)

KEYS = HF_CONFIG["max_position_embeddings"]
V = HF_CONFIG["vocab_size"]
SEQ = [1, 30, 31, 32, 33, 34, 63, 35, 9, 24]  # 63 = vocab_size - 1: SGLang reports its id as 0


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    with reference_server(tmp_path_factory.mktemp("engine") / "engine.log") as (_, c):
        yield c


@pytest.fixture(scope="module")
def twin():
    """The server's model, one thread (reference_engine.server_twin)."""
    with server_twin() as model:
        yield model


def _block(root: Path, relpath: str, first_test: str, count: int, args: str):
    """`count` consecutive statements of SGLang's source, from the `if` whose test unparses to
    `first_test`, compiled as `def block(args)` (their `return`s return None)."""
    tree = ast.parse((root / "src/sglang" / relpath).read_text())
    found = [(node.body, i) for node in ast.walk(tree) if isinstance(getattr(node, "body", None), list)
             for i, stmt in enumerate(node.body)
             if isinstance(stmt, ast.If) and ast.unparse(stmt.test) == first_test]
    assert len(found) == 1, f"{relpath}: `if {first_test}:` found {len(found)} times; SGLang changed shape"
    body, i = found[0]
    fn = ast.parse(f"def block({args}):\n    pass").body[0]
    fn.body = body[i:i + count]
    scope: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), relpath, "exec"), scope)
    return scope["block"]


def _token_ids_block(root: Path):
    """schedule_batch's `if self.return_logprob:` block inside prepare-for-extend's loop over requests
    that appends, per request, the input token each logit row scores."""
    tree = ast.parse((root / "src/sglang/srt/managers/schedule_batch.py").read_text())
    blocks = [n for n in ast.walk(tree)
              if isinstance(n, ast.If) and ast.unparse(n.test) == "self.return_logprob"
              and any(isinstance(t, ast.Name) and t.id == "logprob_token_ids" for t in ast.walk(n))]
    assert len(blocks) == 1, "schedule_batch's input-logprob token block changed shape; update this test"
    fn = ast.parse("def block(self, req, i, extend_logprob_start_lens, extend_input_logprob_token_ids):\n"
                   "    pass").body[0]
    fn.body = [blocks[0]]
    scope: dict = {}
    module = ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[]))
    exec(compile(module, "schedule_batch.py", "exec"), scope)
    return scope["block"]


@pytest.fixture(scope="module")
def sglang(sglang_root):
    """SGLang's steps from a request's logprob_start_len to meta_info["input_token_logprobs"]."""
    scope = {"MIS_DELIMITER_TOKEN_ID": 9999, "List": list}
    lrp = "srt/managers/scheduler_components/logprob_result_processor.py"
    cls = "SchedulerLogprobResultProcessor"
    return types.SimpleNamespace(
        resolve=_block(sglang_root, "srt/managers/scheduler.py",
                       "not recv_req.return_logprob and recv_req.logprob_start_len != -1", 3,
                       "self, recv_req, req"),
        extend_start=_compile(sglang_root, "srt/managers/schedule_batch.py", None,
                              "compute_extend_logprob_start_len", scope),
        token_ids=_token_ids_block(sglang_root),
        count=_compile(sglang_root, lrp, cls, "calculate_num_input_logprobs", scope),
        process=_compile(sglang_root, lrp, cls, "_process_input_token_logprobs", scope),
        empty=_compile(sglang_root, lrp, cls, "_initialize_empty_logprob_containers", scope),
        triples=_compile(sglang_root, "srt/managers/tokenizer_manager.py", "TokenizerManager",
                         "detokenize_logprob_tokens", scope))


def _sglang_answer(sglang, seq: list[int], start: int, logp_NV: torch.Tensor) -> list | str:
    """SGLang 0.5.23's meta_info["input_token_logprobs"] for input `seq` (max_new_tokens 0,
    return_logprob, logprob_start_len `start`, no prefix cached) with logit rows whose log_softmax
    is `logp_NV`; or the abort message it answers instead."""
    n = len(seq)
    req = types.SimpleNamespace(origin_input_ids=array.array("q", seq), is_prefill_only=True,
                                logprob_start_len=0, aborted=None, prefix_len=0, extend_end=n, extend_len=n,
                                logprob=types.SimpleNamespace(**dict.fromkeys(
                                    [f"input_{kind}_{part}" for kind in ("token_logprobs", "top_logprobs",
                                                                         "token_ids_logprobs")
                                     for part in ("val", "idx")])))
    req.set_finish_with_abort = lambda msg: setattr(req, "aborted", msg)
    recv = types.SimpleNamespace(return_logprob=True, logprob_start_len=start, token_ids_logprob=None)
    sched = types.SimpleNamespace(_add_request_to_queue=lambda r: None)
    sglang.resolve(sched, recv, req)
    if req.aborted is not None:
        return req.aborted
    extend_start = sglang.extend_start(logprob_start_len=req.logprob_start_len, prefix_len=0, extend_len=n,
                                       full_untruncated_fill_len=n)
    ids: list[int] = []
    sglang.token_ids(types.SimpleNamespace(return_logprob=True), req, 0, [extend_start], ids)
    ids = [min(max(t, 0), V - 1) for t in ids]  # schedule_batch.py: extend_input_logprob_token_ids.clamp_
    processor = types.SimpleNamespace(model_config=types.SimpleNamespace(vocab_size=V),
                                      _scoring_positions=lambda r: None,
                                      _uses_scoring_positions=lambda r: False)
    num = sglang.count(processor, req, n, extend_start)
    # the logits processor's rows extend_start .. n - 1, each scored at its token id
    raw = [logp_NV[extend_start + k, t].item() for k, t in enumerate(ids[:num])]
    if num > 0:
        sglang.process(processor, req, raw)
    else:
        sglang.empty(processor, req)
    return [list(t) for t in sglang.triples(None, req.logprob.input_token_logprobs_val,
                                            req.logprob.input_token_logprobs_idx, False)]


def test_the_scoring_body_is_a_generate_req_input_and_passes_the_contract(sglang_root, api_types):
    body = scoring_body([([1, 5, 6], [7, 8]), ([1, 20], [])])
    fields = _struct_fields(sglang_root)["GenerateReqInput"]
    assert set(body) <= set(fields), sorted(set(body) - set(fields))
    request = api_types.GenerateRequest.from_json_value(body)
    assert request.logprob_start_len == [2, 1] and request.return_logprob is True
    with pytest.raises(Exception, match="expected"):  # the contract checks the field's type
        api_types.GenerateRequest.from_json_value({**body, "logprob_start_len": "2"})


@pytest.mark.parametrize("start", [0, 6, len(SEQ) - 1, len(SEQ), -1])
def test_input_logprobs_are_sglangs(client, twin, sglang, api_types, start):
    answer = client.generate(SEQ, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start)
    meta = api_types.GenerateResponse.from_json_value(answer).meta_info  # SGLang's response schema
    assert meta.input_token_logprobs is not None and meta.output_token_logprobs == []
    with torch.inference_mode():
        logits = twin.model(input_ids=torch.tensor([SEQ])).logits[0].float()
    bound = logprob_bound(logit_bound(HF_CONFIG, logits.abs().max().item(), KEYS), V)
    want = _sglang_answer(sglang, SEQ, start, torch.log_softmax(logits, -1))
    got = answer["meta_info"]["input_token_logprobs"]
    assert [(lp is None, t, text) for lp, t, text in got] == [(lp is None, t, text) for lp, t, text in want]
    for (lp, _, _), (w, _, _) in zip(got, want):
        assert lp is None or abs(lp - w) <= bound, (lp, w, bound)
    if start == 6:  # what the scoring client reads: the response's values, in order
        assert parse_scores([answer], [(SEQ[:start + 1], SEQ[start + 1:])], vocab_size=V) == \
            [[lp for lp, _, _ in got[1:]]]


@pytest.mark.parametrize("start", [len(SEQ) + 1, 40])
def test_a_start_past_the_input_is_refused_with_sglangs_message(client, sglang, start):
    """SGLang aborts it (scheduler.py) and answers HTTP 400 with the message (tokenizer_manager
    `_handle_abort_finish_reason` raises ValueError for a 400 abort)."""
    message = _sglang_answer(sglang, SEQ, start, torch.zeros(len(SEQ), V))
    assert isinstance(message, str) and "is higher than the number of input tokens" in message
    with pytest.raises(EngineError) as info:
        client.generate(SEQ, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=start)
    assert info.value.status == 400 and info.value.message == message
