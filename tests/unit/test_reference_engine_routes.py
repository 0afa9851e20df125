"""The reference engine's routed experts (SGLang's --enable-return-routed-experts, issue 33).

The engine's rows are checked against an independent evaluation: one transformers forward of the
engine's model over prompt + response[:-1], unpadded and without a cache, with forward hooks on the
routers recording the ids each chose (`_full_forward_routes`). Row i must be, layer by layer and as a
set, what that forward chose for position i. The two evaluations are the same arithmetic in other
summation orders (KV cache, left padding, batch shape, DirectForward's ops); they pick the same
experts wherever no near-tie lies within the fp32 rounding bound, which the test checks first
(numerics.routing_margin_ratio for Qwen3-MoE's softmax top-k, numerics.grouped_margin_ratio for
DeepSeek-V3's biased group-limited top-k: n = the preset's longest reduction with KEYS keys, the
per-layer depths stated there; above 1.5, see numerics). test_the_comparison_sees_misplaced_routes
shows that two swapped rows, and routes written one position late, fail the comparison.
DeepSeek-V2 (test_deepseek_v2_rows_are_the_softmax_top_k_in_descending_order) is checked against the
top-k of softmax(router logits) computed here, column order included.
"""

from __future__ import annotations

import argparse
import base64
import json
import re

import numpy as np
import pytest
import torch
from deepseek_dirs import deepseek_v2_config
from numerics import (grouped_margin_ratio, layer_depth, longest_reduction, reordered, router_depth,
                      routing_margin_ratio)

import hpcrl.rollout.engine as engine_module
from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.client import decode_routed_experts, routed_experts_fields
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.reference_server import ReferenceServer, _Fail, main

pytestmark = [pytest.mark.timeout(180), pytest.mark.usefixtures("one_torch_thread")]

KEYS = 64  # no sequence here is longer (checked in _full_forward_routes)
PRESETS = ("tiny-qwen3-moe", "tiny-deepseek-v3")


def _prompts(n: int, seed: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lengths]


def _engine(preset: str, path: str = "direct") -> ReferenceModel:
    """The preset's engine; DeepSeek-V3's routers get a random score-correction bias (transformers
    starts it at zero), so that its routes depend on it. path "hf": Qwen3-MoE through transformers'
    forward instead of DirectForward."""
    engine = ReferenceModel(load_hf_config(preset, None), seed=3)
    if preset == "tiny-deepseek-v3":
        g = torch.Generator().manual_seed(1)
        for _, gate in engine.routers:
            gate.e_score_correction_bias.copy_(torch.randn(gate.num_experts, generator=g) * 0.05)
    if path == "hf":
        engine._forward = engine._hf_forward
    return engine


@pytest.fixture(scope="module")
def engines() -> dict[str, ReferenceModel]:
    return {preset: _engine(preset) for preset in PRESETS}


@torch.inference_mode()
def _full_forward_routes(engine: ReferenceModel, seq: list[int]) -> torch.Tensor:
    """[len(seq), num_hidden_layers, top_k]: each MoE router's chosen ids in one transformers forward
    over `seq` (no padding, no cache), dense layers' rows zero; first checks that no router near-tie
    lies within the rounding bound."""
    model, cfg = engine.model, engine.config.to_dict()
    assert len(seq) <= KEYS
    routers = [(i, layer.mlp.gate) for i, layer in enumerate(model.model.layers)
               if hasattr(layer.mlp, "experts")]
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    hooks = [gate.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, (out[0], out[2])))
             for i, gate in routers]
    try:
        model(input_ids=torch.tensor([seq]))
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(seen) == [i for i, _ in routers]
    logits = [seen[i][0].float() for i, _ in routers]
    n = longest_reduction(cfg, KEYS)
    if cfg["model_type"] == "deepseek_v3":
        ratio = grouped_margin_ratio(logits, [g.e_score_correction_bias for _, g in routers], cfg, n,
                                     cfg["first_k_dense_replace"])
    else:
        ratio = routing_margin_ratio(logits, cfg["num_experts_per_tok"], n)
    assert ratio > 1.5, f"a router near-tie within the rounding bound ({ratio:.2f}): use other inputs"
    out = torch.zeros(len(seq), cfg["num_hidden_layers"], cfg["num_experts_per_tok"], dtype=torch.int32)
    for i, _ in routers:
        out[:, i] = seen[i][1]
    return out


def _mismatches(got, want) -> list[tuple[int, int]]:
    """(row, layer) pairs whose expert sets differ (column order within a row is the kernel's)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    return [(r, l) for r in range(got.shape[0]) for l in range(got.shape[1])
            if set(got[r, l].tolist()) != set(want[r, l].tolist())]


def _check_against_full_forward(engine: ReferenceModel, prompt: list[int], out: dict) -> torch.Tensor:
    ids = out["output_ids"]
    routes = out["routed_experts"]
    cfg = engine.config
    assert routes.dtype == torch.int32
    assert tuple(routes.shape) == (len(prompt) + len(ids) - 1, cfg.num_hidden_layers, cfg.num_experts_per_tok)
    want = _full_forward_routes(engine, prompt + ids[:-1])
    assert _mismatches(routes, want) == []
    return want


@pytest.mark.parametrize("preset, path", [("tiny-qwen3-moe", "direct"), ("tiny-qwen3-moe", "hf"),
                                          ("tiny-deepseek-v3", "hf")])
def test_rows_are_the_routes_a_full_forward_takes(preset, path):
    """A left-padded ragged batch, sampled (a seed per request) and greedy, every row of every answer
    against its own unpadded full forward: prompt tokens, each fed-back output token, no padding."""
    engine = _engine(preset, path)
    cfg = engine.config
    prompts = _prompts(5, seed=11, vocab=cfg.vocab_size)
    assert len({len(p) for p in prompts}) > 1, "the batch must be ragged (left padding)"
    params = [{"temperature": 0.0 if i == 0 else 1.0, "max_new_tokens": 6 + i, "sampling_seed": 7 + i,
               "ignore_eos": True} for i in range(len(prompts))]
    outs = engine.generate(prompts, params, return_routes=True)
    for prompt, out in zip(prompts, outs):
        want = _check_against_full_forward(engine, prompt, out)
        routes = out["routed_experts"]
        assert int(routes.min()) >= 0 and int(routes.max()) < engine.routers[0][1].num_experts
        for layer in range(cfg.num_hidden_layers):
            for row in routes[:, layer].tolist():
                assert len(set(row)) == (cfg.num_experts_per_tok if hasattr(
                    engine.model.model.layers[layer].mlp, "experts") else 1)
        if preset == "tiny-deepseek-v3":  # layer 0 is dense: zeros, as SGLang's zeroed buffer
            assert cfg.first_k_dense_replace == 1
            assert not routes[:, 0].any() and routes[:, 1:].any()
            assert not want[:, 0].any()
    # The same requests one at a time: the batch (other rows, their padding) changes no route.
    for prompt, sp, out in zip(prompts[:2], params[:2], outs[:2]):
        (alone,) = engine.generate([prompt], [sp], return_routes=True)
        assert alone["output_ids"] == out["output_ids"]
        assert _mismatches(alone["routed_experts"], out["routed_experts"]) == []


@torch.inference_mode()
def _softmax_top_k(engine: ReferenceModel, seq: list[int]) -> torch.Tensor:
    """[len(seq), num_hidden_layers, top_k]: per MoE layer the top_k experts of softmax(router logits)
    in one transformers forward over `seq` (no padding, no cache), in descending order of probability;
    dense layers' rows zero. First checks that each token's top_k + 1 logits are pairwise apart by
    more than 3x the rounding bound B (numerics.reordered with n = longest_reduction, router j in layer
    first_k_dense_replace + j at MLA's layer_depth): another summation order then picks the same
    experts in the same order (softmax keeps the logits' order)."""
    model, cfg = engine.model, engine.config.to_dict()
    k, first = cfg["num_experts_per_tok"], cfg["first_k_dense_replace"]
    seen: dict[int, torch.Tensor] = {}
    hooks = [gate.register_forward_hook(lambda mod, args, out, i=i: seen.__setitem__(i, out[0].float()))
             for i, gate in engine.routers]
    try:
        model(input_ids=torch.tensor([seq]))
    finally:
        for hook in hooks:
            hook.remove()
    assert sorted(seen) == [i for i, _ in engine.routers] and min(seen) == first
    n = longest_reduction(cfg, KEYS)
    out = torch.zeros(len(seq), cfg["num_hidden_layers"], k, dtype=torch.int32)
    for i, logits in seen.items():
        B = reordered(n, router_depth(i, layer_depth(cfg)), logits.abs().max().item())
        top = logits.topk(k + 1, -1).values
        ratio = ((top[:, :-1] - top[:, 1:]).min() / (2 * B)).item()
        assert ratio > 1.5, f"a router near-tie within the rounding bound ({ratio:.2f}): use other inputs"
        out[:, i] = logits.softmax(-1).topk(k, -1).indices
    return out


def test_deepseek_v2_rows_are_the_softmax_top_k_in_descending_order(monkeypatch):
    """DeepSeek-V2-Lite's router (deepseek_dirs.deepseek_v2_config: greedy top-4 of 8 softmax scores,
    not renormalised, no bias, no groups) through transformers' forward: every row of every answer of
    a left-padded ragged batch is exactly, column order included, the top-k of softmax(router logits)
    of its sequence's full forward. The router's own torch.topk(sorted=False) order is another: without
    the engine's sort by weight (a multiple of the probability) the rows differ. Engine seed 1 and
    prompt seed 5 keep every token's top-5 logits clear of near-ties (_softmax_top_k checks it; most
    seeds put some pair among these 63 positions' 2 x 5 top logits within the bound)."""
    engine = ReferenceModel(deepseek_v2_config(), seed=1)
    cfg = engine.config
    assert type(engine.model).__name__ == "DeepseekV2ForCausalLM" and cfg.topk_method == "greedy"
    assert not any(hasattr(gate, "e_score_correction_bias") for _, gate in engine.routers)
    prompts = _prompts(4, seed=5, vocab=cfg.vocab_size)
    assert len({len(p) for p in prompts}) > 1, "the batch must be ragged (left padding)"
    params = [{"temperature": 0.0 if i == 0 else 1.0, "max_new_tokens": 5 + i, "sampling_seed": 7 + i,
               "ignore_eos": True} for i in range(len(prompts))]
    outs = engine.generate(prompts, params, return_routes=True)
    wants = [_softmax_top_k(engine, prompt + out["output_ids"][:-1]) for prompt, out in zip(prompts, outs)]
    for out, want in zip(outs, wants):
        routes = out["routed_experts"]
        assert routes.dtype == torch.int32 and routes.shape == want.shape
        assert torch.equal(routes, want)
        assert not routes[:, 0].any() and routes[:, 1:].any()  # layer 0 is dense
    monkeypatch.setattr(engine_module, "_by_weight", lambda weights_NK, chosen_NK: chosen_NK)
    unsorted = engine.generate(prompts, params, return_routes=True)
    assert all(_mismatches(a["routed_experts"], w) == [] for a, w in zip(unsorted, wants))
    assert not any(torch.equal(a["routed_experts"], w) for a, w in zip(unsorted, wants))


def test_routes_do_not_change_generation_and_are_only_given_when_asked(engines):
    engine = engines["tiny-qwen3-moe"]
    prompts = _prompts(3, seed=5, vocab=engine.vocab_size)
    params = [{"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": s} for s in range(3)]
    plain = engine.generate(prompts, params)
    mixed = engine.generate(prompts, params, return_routes=[True, False, True])
    for a, b in zip(plain, mixed):
        assert (a["output_ids"], a["output_logprobs"], a["finish_reason"]) == \
            (b["output_ids"], b["output_logprobs"], b["finish_reason"])
        assert "routed_experts" not in a
    assert ["routed_experts" in b for b in mixed] == [True, False, True]


def test_a_stop_token_is_the_last_token_and_has_no_row(engines):
    """Eos ends a request inside the batch while others go on: its rows stop before the eos."""
    engine = engines["tiny-deepseek-v3"]
    prompt = _prompts(1, seed=2, vocab=engine.vocab_size)[0]
    (free,) = engine.generate([prompt], [{"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}])
    stop_at = free["output_ids"][2]
    outs = engine.generate([prompt, prompt[:3]], [
        {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop_at]},
        {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}], return_routes=True)
    first = outs[0]
    assert first["finish_reason"]["type"] == "stop" and first["output_ids"][-1] == stop_at
    _check_against_full_forward(engine, prompt, first)
    _check_against_full_forward(engine, prompt[:3], outs[1])


def test_max_new_tokens_0_still_routes_the_prompt(engines):
    """SGLang prefills a request with max_new_tokens 0 and returns its P - 1 rows."""
    engine = engines["tiny-deepseek-v3"]
    prompts = _prompts(2, seed=4, vocab=engine.vocab_size)
    outs = engine.generate(prompts, [{"max_new_tokens": 0}] * 2, return_routes=True)
    for prompt, out in zip(prompts, outs):
        assert out["output_ids"] == []
        want = _full_forward_routes(engine, prompt)[:-1]
        assert tuple(out["routed_experts"].shape)[0] == len(prompt) - 1
        assert _mismatches(out["routed_experts"], want) == []


def test_the_comparison_sees_misplaced_routes(engines, monkeypatch):
    """Two rows of an answer swapped, and every route written one position late, both fail."""
    engine = engines["tiny-qwen3-moe"]
    prompt = _prompts(1, seed=3, vocab=engine.vocab_size)[0]
    sp = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    (out,) = engine.generate([prompt], [sp], return_routes=True)
    want = _check_against_full_forward(engine, prompt, out)
    routes = out["routed_experts"].clone()
    i, j = next((i, j) for i in range(len(routes)) for j in range(i + 1, len(routes))
                if _mismatches(routes[i:i + 1], routes[j:j + 1]))
    routes[[i, j]] = routes[[j, i]]
    assert _mismatches(routes, want), "a swap of two tokens' routes went unseen"

    record = engine_module._RouteRecorder.__call__

    def one_late(self, layer, chosen_NK):  # the last input's routes have no column left: dropped
        B, columns = self.routes_BCLK.shape[:2]
        if self.column + 1 + chosen_NK.shape[0] // B <= columns:
            self.column += 1
            record(self, layer, chosen_NK)
            self.column -= 1

    monkeypatch.setattr(engine_module._RouteRecorder, "__call__", one_late)
    (late,) = engine.generate([prompt], [sp], return_routes=True)
    assert late["output_ids"] == out["output_ids"]
    assert _mismatches(late["routed_experts"], want), "routes one position late went unseen"


def test_a_model_without_moe_layers_has_no_routes(tmp_path):
    cfg = dict(load_hf_config("tiny-qwen3-moe", None), mlp_only_layers=[0, 1])
    engine = ReferenceModel(cfg, seed=0)
    assert engine.routers == [] and "no MoE layer" in engine.routes_refusal()
    with pytest.raises(ValueError, match="no MoE layer"):
        engine.generate([[3, 4]], [{"max_new_tokens": 1}], return_routes=True)
    path = tmp_path / "dense.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(SystemExit, match="--enable-return-routed-experts: .*no MoE layer.*drop the flag"):
        main(["--model-config", str(path), "--port", "0", "--enable-return-routed-experts"])


# -- the server's /generate handler, in process --------------------------------------------------

def _server(engine: ReferenceModel, flag: bool) -> ReferenceServer:
    return ReferenceServer(engine, None, "tiny.json", argparse.Namespace(enable_return_routed_experts=flag))


def _decode(answer: dict, engine: ReferenceModel) -> np.ndarray | None:
    return decode_routed_experts(answer["meta_info"], engine.num_layers, engine.top_k)


@pytest.mark.parametrize("preset", PRESETS)
def test_server_answers_carry_routes_from_start_len(engines, preset):
    engine = engines[preset]
    server = _server(engine, True)
    prompts = _prompts(3, seed=8, vocab=engine.vocab_size)
    sp = {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True}
    start = min(len(p) for p in prompts)  # one value for the batch, up to the shortest prompt
    whole = server.generate({"input_ids": prompts, "sampling_params": sp, **routed_experts_fields()})
    tail = server.generate({"input_ids": prompts, "sampling_params": sp, **routed_experts_fields(start)})
    for prompt, a, b in zip(prompts, whole, tail):
        assert a["output_ids"] == b["output_ids"]
        rows = len(prompt) + len(a["output_ids"]) - 1
        full, cut = _decode(a, engine), _decode(b, engine)
        assert full.shape == (rows, engine.num_layers, engine.top_k) and full.dtype == np.int32
        assert cut.shape == (rows - start, engine.num_layers, engine.top_k)
        assert (cut == full[start:]).all()
        want = _full_forward_routes(engine, prompt + a["output_ids"][:-1])
        assert _mismatches(full, want) == []
        # the wire format itself: base64 of little-endian int32 in C order
        raw = base64.b64decode(a["meta_info"]["routed_experts"])
        assert raw == full.astype("<i4").tobytes(order="C") and len(raw) == 4 * full.size
    (single,) = [server.generate({"input_ids": prompts[0], "sampling_params": sp,
                                  **routed_experts_fields(len(prompts[0]))})]
    assert isinstance(single, dict)  # start_len == P: only the output tokens but the last
    assert _decode(single, engine).shape == (len(single["output_ids"]) - 1, engine.num_layers, engine.top_k)


def test_server_key_is_absent_without_the_flag_or_the_field(engines):
    engine = engines["tiny-qwen3-moe"]
    body = {"input_ids": [[5, 6, 7]], "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    on, off = _server(engine, True), _server(engine, False)
    asked = {**body, **routed_experts_fields()}
    assert "routed_experts" in on.generate(asked)[0]["meta_info"]
    for server, req in ((on, body), (off, asked), (on, {**body, "return_routed_experts": False})):
        answer = server.generate(req)[0]
        assert "routed_experts" not in answer["meta_info"]
        assert _decode(answer, engine) is None


@pytest.mark.parametrize("flag", [True, False])
@pytest.mark.parametrize("start, match", [
    (-1, r"^recv_req\.routed_experts_start_len=-1 is lower than 0\. Please use a non-negative "
         r"routed_experts_start_len\.$"),
    (4, r"^recv_req\.routed_experts_start_len=4 is higher than the number of input tokens "
        r"len\(req\.origin_input_ids\)=3\. Please use a smaller routed_experts_start_len\.$")])
def test_server_refuses_a_start_len_outside_the_prompt_as_sglang(engines, flag, start, match):
    """SGLang's scheduler aborts such a request (HTTP 400 with its message), with the flag or without;
    a batch fails on its first bad item. Without return_routed_experts the start is not checked."""
    server = _server(engines["tiny-qwen3-moe"], flag)
    body = {"input_ids": [[5, 6, 7, 8, 9], [5, 6, 7]], "sampling_params": {"max_new_tokens": 2}}
    with pytest.raises(_Fail, match=match) as info:
        server.generate({**body, **routed_experts_fields(start)})
    assert info.value.status == 400
    assert len(server.generate({**body, "routed_experts_start_len": start})) == 2


@pytest.mark.parametrize("field, value", [
    ("return_routed_experts", "yes"), ("return_routed_experts", [True]),
    ("routed_experts_start_len", "1"), ("routed_experts_start_len", [0]), ("routed_experts_start_len", True)])
def test_server_names_a_malformed_field(engines, field, value):
    """Both fields are one scalar for the whole request (SGLang's GenerateReqInput): a per-item list or
    another type is refused naming the field and its value."""
    server = _server(engines["tiny-qwen3-moe"], True)
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 2}, "return_routed_experts": True,
            field: value}
    with pytest.raises(_Fail, match=re.escape(f"'{field}'={value!r} must be")):
        server.generate(body)


def test_decode_routed_experts_names_a_wrong_shape():
    meta = {"routed_experts": base64.b64encode(np.arange(12, dtype="<i4").tobytes()).decode()}
    assert decode_routed_experts(meta, 2, 3).shape == (2, 2, 3)
    with pytest.raises(ValueError, match="48 bytes, not whole rows of num_layers=5 x top_k=2"):
        decode_routed_experts(meta, 5, 2)
    assert decode_routed_experts({}, 5, 2) is None
