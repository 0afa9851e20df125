"""Routed experts (issue 33) against SGLang 0.5.23's own code: the reference engine, started with
hpcrl's ROUTED_EXPERTS_FLAG as a real HTTP server, answers hpcrl's /generate body with a
meta_info["routed_experts"] that SGLang's decoder (`extract_routed_experts_from_meta_info`,
srt/state_capturer/routed_experts.py) reads as the routes hpcrl means, encoded byte for byte as SGLang's
detokenizer (`_b64_encode_per_request`) encodes the same int32 tensor; the request fields hpcrl sends
are GenerateReqInput's (io_struct.py) and pass SGLang's /generate contract (api_types.py); the flag is
one SGLang's server-argument parser knows; a start outside the prompt is refused with the message
SGLang's scheduler writes (its check run from its source).

SGLang's two functions are compiled from their source (as test_load_weights_names does): importing
their modules pulls in the whole runtime. They use `pybase64`, which is not installed here; the
standard library's `base64` stands in for it (pybase64 is a drop-in, faster implementation of the same
functions, and its output is the same bytes).
"""

from __future__ import annotations

import ast
import base64
import re
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from reference_engine import reference_server
from sglang_wheel import parse_with_sglang
from test_request_bodies import _struct_fields

from hpcrl.models.presets import CONFIG_DIR, load_hf_config
from hpcrl.rollout.client import (ROUTED_EXPERTS_FLAG, EngineError, decode_routed_experts,
                                  routed_experts_fields)
from hpcrl.rollout.engine import ReferenceModel

pytestmark = pytest.mark.timeout(300)

CONFIG = "tiny-qwen3-moe"
HF_CONFIG = load_hf_config(CONFIG, None)
LAYERS, TOP_K = HF_CONFIG["num_hidden_layers"], HF_CONFIG["num_experts_per_tok"]
PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35]]
GREEDY = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}


def _compile(root: Path, relpath: str, cls: str | None, name: str, scope: dict):
    """One function of SGLang's source (a method of `cls` if given), decorators and annotations
    dropped, compiled in `scope`."""
    tree = ast.parse((root / "src/sglang" / relpath).read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body
    fn = next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    assert fn is not None, f"{relpath}: {cls}.{name} not found; SGLang's source changed shape"
    fn.decorator_list, fn.returns = [], None
    for arg in fn.args.args:
        arg.annotation = None
    exec(compile(ast.Module(body=[fn], type_ignores=[]), relpath, "exec"), scope)
    return scope[name]


@pytest.fixture(scope="module")
def sglang(sglang_root):
    """SGLang's decoder and its detokenizer's encoder, from the wheel's source."""
    scope = {"np": np, "pybase64": base64}
    return types.SimpleNamespace(
        extract=_compile(sglang_root, "srt/state_capturer/routed_experts.py", None,
                         "extract_routed_experts_from_meta_info", scope),
        encode=_compile(sglang_root, "srt/managers/detokenizer_manager.py", "DetokenizerManager",
                        "_b64_encode_per_request", scope))


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    log = tmp_path_factory.mktemp("engine") / "engine.log"
    with reference_server(log, CONFIG_DIR / f"{CONFIG}.json", extra_args=[ROUTED_EXPERTS_FLAG]) as (_, c):
        yield c


@pytest.fixture(scope="module")
def twin() -> ReferenceModel:
    """The server's model (random weights from seed 0, as the server draws them)."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)  # as the server's --threads 1: the same kernels
    try:
        yield ReferenceModel(HF_CONFIG, seed=0)
    finally:
        torch.set_num_threads(prev)


@pytest.mark.parametrize("start", [0, 2])
def test_sglang_decodes_the_reference_engines_routes(client, twin, sglang, api_types, start):
    answers = client.generate(PROMPTS, GREEDY, return_routed_experts=True, routed_experts_start_len=start)
    with torch.inference_mode():
        torch.set_num_threads(1)
        want = twin.generate(PROMPTS, [GREEDY] * len(PROMPTS), return_routes=True)
    for prompt, answer, mine in zip(PROMPTS, answers, want):
        api_types.GenerateResponse.from_json_value(answer)  # still SGLang's response schema
        assert answer["output_ids"] == mine["output_ids"]
        flat = sglang.extract(answer)
        assert flat.dtype == np.int32
        rows = len(prompt) + len(answer["output_ids"]) - 1 - start
        assert flat.size == rows * LAYERS * TOP_K
        routes = flat.reshape(-1, LAYERS, TOP_K)  # as SGLang's consumers (slime, verl, miles) shape it
        assert (routes == decode_routed_experts(answer["meta_info"], LAYERS, TOP_K)).all()
        assert (routes == mine["routed_experts"][start:].numpy()).all()
        assert routes.min() >= 0 and routes.max() < HF_CONFIG["num_experts"]
        # SGLang's own encoder on the same tensor writes the same string
        assert sglang.encode([mine["routed_experts"][start:]]) == [answer["meta_info"]["routed_experts"]]


def test_the_check_sees_a_wrong_encoding(sglang):
    """SGLang's decoder reads the engine's little-endian int32; big-endian or int64 bytes differ."""
    routes = torch.tensor([[[1, 3], [0, 2]]], dtype=torch.int32)
    (good,) = sglang.encode([routes])
    assert (sglang.extract({"meta_info": {"routed_experts": good}}) == [1, 3, 0, 2]).all()
    for wrong in (routes.numpy().astype(">i4"), routes.numpy().astype("<i8")):
        text = base64.b64encode(wrong.tobytes()).decode()
        assert text != good and not np.array_equal(sglang.extract({"meta_info": {"routed_experts": text}}),
                                                   [1, 3, 0, 2])


def test_without_the_field_the_key_is_absent(client):
    answer = client.generate(PROMPTS[0], GREEDY)
    assert "routed_experts" not in answer["meta_info"]
    assert decode_routed_experts(answer["meta_info"], LAYERS, TOP_K) is None


def test_hpcrls_fields_are_generate_req_inputs_and_pass_the_contract(sglang_root, api_types):
    fields = _struct_fields(sglang_root)["GenerateReqInput"]
    body = routed_experts_fields(3)
    assert set(body) <= set(fields), sorted(set(body) - set(fields))
    tree = ast.parse((sglang_root / "src/sglang/srt/managers/io_struct.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateReqInput")
    types_ = {n.target.id: ast.unparse(n.annotation) for n in cls.body if isinstance(n, ast.AnnAssign)}
    assert (types_["return_routed_experts"], types_["routed_experts_start_len"]) == ("bool", "int")
    assert {k: type(v).__name__ for k, v in body.items()} == {"return_routed_experts": "bool",
                                                             "routed_experts_start_len": "int"}
    request = {"input_ids": PROMPTS, "sampling_params": GREEDY, "return_logprob": True, **body}
    assert api_types.GenerateRequest.from_json_value(request).routed_experts_start_len == 3
    with pytest.raises(Exception, match="expected i64"):  # the contract does check the field's type
        api_types.GenerateRequest.from_json_value({**request, "routed_experts_start_len": "3"})


def test_the_flag_is_sglangs(sglang_root, tmp_path):
    report = parse_with_sglang(sglang_root, [["--model-path", "/m", ROUTED_EXPERTS_FLAG], ["--model-path", "/m"]],
                               tmp_path, timeout_s=240)
    assert report["options"][ROUTED_EXPERTS_FLAG] == "enable_return_routed_experts"
    on, off = report["results"]
    assert on["enable_return_routed_experts"] is True and off["enable_return_routed_experts"] is False


def _sglang_start_len_check(root: Path):
    """The `if recv_req.return_routed_experts:` block of SGLang's Scheduler._handle_generate_request,
    as a function (recv_req, req) -> the abort message it sets, or None."""
    tree = ast.parse((root / "src/sglang/srt/managers/scheduler.py").read_text())
    blocks = [n for n in ast.walk(tree)
              if isinstance(n, ast.If) and ast.unparse(n.test) == "recv_req.return_routed_experts"]
    assert len(blocks) == 1, "SGLang's start_len check changed shape; update this test"
    fn = ast.parse("def check(self, recv_req, req):\n    pass").body[0]
    fn.body = [blocks[0], ast.parse("return None").body[0]]
    scope: dict = {}
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), "scheduler.py", "exec"),
         scope)

    def message(start: int, prompt: list[int]) -> str | None:
        req = types.SimpleNamespace(origin_input_ids=prompt, aborted=None)
        req.set_finish_with_abort = lambda msg: setattr(req, "aborted", msg)
        recv = types.SimpleNamespace(return_routed_experts=True, routed_experts_start_len=start)
        scope["check"](types.SimpleNamespace(_add_request_to_queue=lambda r: None), recv, req)
        return req.aborted

    return message


@pytest.mark.parametrize("start", [-1, len(PROMPTS[1]) + 1, len(PROMPTS[1])])
def test_a_start_outside_the_prompt_is_refused_with_sglangs_message(client, sglang_root, start):
    """SGLang answers such a non-streamed request HTTP 400 {"error": {"message"}} with the abort message
    (tokenizer_manager._handle_abort_finish_reason raises ValueError, http_server answers 400)."""
    sglang_message = _sglang_start_len_check(sglang_root)(start, PROMPTS[1])
    if sglang_message is None:  # start == P is allowed: the answer has the output tokens' rows
        answer = client.generate(PROMPTS[1], GREEDY, return_routed_experts=True,
                                 routed_experts_start_len=start)
        routes = decode_routed_experts(answer["meta_info"], LAYERS, TOP_K)
        assert routes.shape == (len(answer["output_ids"]) - 1, LAYERS, TOP_K)
        return
    with pytest.raises(EngineError) as info:
        client.generate(PROMPTS[1], GREEDY, return_routed_experts=True, routed_experts_start_len=start)
    assert info.value.status == 400
    assert info.value.message == sglang_message, (info.value.message, sglang_message)
    assert re.search(r"routed_experts_start_len=-?\d+ is (lower|higher)", sglang_message)
