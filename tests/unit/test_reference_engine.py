"""hpcrl.rollout.engine.ReferenceModel: KV-cache decoding, SGLang sampling rules, determinism, weights.

Two evaluations of the same logits in other summation orders (a batch of other shape, left padding,
the KV cache against a full forward) are compared within numerics.logit_bound / logprob_bound (fp32
rounding: n = 128, the preset's longest reduction, 15 reductions deep, magnitude max|logit|), after
checking that no router near-tie lies within that bound (numerics.routing_margin_ratio). Where a token
choice decides what comes next, both runs are fed the same tokens (`Steer`), and the sampler is
checked to pick the same token from the same logits, so a near-tie between two tokens cannot send
them down different sequences. test_bounds_catch_real_errors: padding left unmasked, positions counted
from the padded start and decode positions one ahead each exceed 10x the bound.
"""

from __future__ import annotations

import pytest
import torch
from numerics import logit_bound, logprob_bound, longest_reduction, routing_margin_ratio
from reference_engine import DECODE_MUTATIONS, decode_positions_one_ahead

import hpcrl.rollout.engine as engine_module
from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.engine import ReferenceModel, SamplingParams

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

HF_CONFIG = load_hf_config("tiny-qwen3-moe", None)
VOCAB = HF_CONFIG["vocab_size"]
KEYS = HF_CONFIG["max_position_embeddings"]  # no sequence here attends to more keys
SAMPLE = engine_module._sample
N = longest_reduction(HF_CONFIG, KEYS)  # 128: the (unused) dense ffn; hidden, heads * head_dim, keys 64


@pytest.fixture(scope="module")
def engine() -> ReferenceModel:
    return ReferenceModel(HF_CONFIG, seed=3)


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(3, 64, (k,), generator=g).tolist() for k in lengths]


@torch.inference_mode()
def _full_forward(engine: ReferenceModel, prompt, output_ids) -> torch.Tensor:
    """The logits that predict output_ids, [T, V], from one HF forward over the whole unpadded
    sequence, no cache; first checks that no router near-tie lies within the rounding bound."""
    seq = torch.tensor([prompt + output_ids])
    out = engine.model(input_ids=seq, output_router_logits=True)
    ratio = routing_margin_ratio(list(out.router_logits), HF_CONFIG["num_experts_per_tok"], N)
    assert ratio > 1, f"a router near-tie within the rounding bound ({ratio:.2f}): use other inputs"
    return out.logits[0, len(prompt) - 1:-1].float()


def _logprobs(logits_TV: torch.Tensor, output_ids, temperature: float) -> torch.Tensor:
    t = 1.0 if temperature == 0 else temperature
    return torch.log_softmax(logits_TV / t, -1).gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def _logit_tol(*logits: torch.Tensor) -> float:
    return logit_bound(HF_CONFIG, max(x.abs().max().item() for x in logits), KEYS)


class Steer:
    """Stands in for the engine's sampler (engine._sample) for one `generate` call and records the
    logits it is given, one [B, V] tensor per step. A row in `forced` ({row: (tokens, logits [T, V])}
    of another run) takes those tokens instead of its own draw, with log-probs of this run's logits:
    both runs then see the same inputs. `picked` holds, per step, what the real sampler chooses in
    this batch when the forced rows' logits are the other run's: the same tokens, if the sampler's
    choice for a row does not depend on the other rows."""

    def __init__(self, forced: dict[int, tuple[list[int], torch.Tensor]] | None = None) -> None:
        self.forced = forced or {}
        self.logits: list[torch.Tensor] = []
        self.picked: list[torch.Tensor] = []

    def __call__(self, logits_BV, u_B, all_greedy, greedy_B, temp_B, top_p_B, top_k_B):
        t = len(self.logits)
        self.logits.append(logits_BV.clone())
        rows = [r for r, (tokens, _) in self.forced.items() if t < len(tokens)]
        given = logits_BV.clone()
        for r in rows:
            given[r] = self.forced[r][1][t]
        tok_B, lp_B = SAMPLE(given, u_B, all_greedy, greedy_B, temp_B, top_p_B, top_k_B)
        self.picked.append(tok_B.clone())
        for r in rows:
            tok_B[r] = self.forced[r][0][t]
            temperature = 1.0 if temp_B is None else temp_B[r]
            lp_B[r] = torch.log_softmax(logits_BV[r] / temperature, -1)[tok_B[r]]
        return tok_B, lp_B

    def run(self, engine: ReferenceModel, prompts, params, monkeypatch) -> list[dict]:
        with monkeypatch.context() as m:
            m.setattr(engine_module, "_sample", self)
            return engine.generate(prompts, params)

    def row(self, r: int, steps: int) -> torch.Tensor:
        """Row r's logits over the first `steps` steps, [steps, V]."""
        return torch.stack([x[r] for x in self.logits[:steps]])


def _check_same_as_alone(out: dict, alone: dict, steer: Steer, row: int, alone_logits: torch.Tensor,
                         temperature: float) -> None:
    """Row `row` of a steered batch against the run of its prompt alone: the sampler picked the alone
    run's tokens from the alone run's logits, and its own logits and log-probs are within the bound."""
    n = len(alone["output_ids"])
    assert out["output_ids"] == alone["output_ids"] and out["finish_reason"] == alone["finish_reason"]
    assert [int(p[row]) for p in steer.picked[:n]] == alone["output_ids"], "the batch changed the sampler"
    mine = steer.row(row, n)
    tol = _logit_tol(mine, alone_logits)
    torch.testing.assert_close(mine, alone_logits, atol=tol, rtol=0)
    t = 1.0 if temperature == 0 else temperature
    torch.testing.assert_close(torch.tensor(out["output_logprobs"]), torch.tensor(alone["output_logprobs"]),
                               atol=logprob_bound(tol, VOCAB, t), rtol=0)


def _alone(engine, prompt, sp, monkeypatch) -> tuple[dict, torch.Tensor]:
    """The prompt's own run, its logits per step, and a check that it routes without near-ties."""
    steer = Steer()
    (out,) = steer.run(engine, [prompt], [sp], monkeypatch)
    _full_forward(engine, prompt, out["output_ids"])
    return out, steer.row(0, len(out["output_ids"]))


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.3])
def test_kv_cache_logprobs_equal_a_full_forward(engine, temperature):
    prompts = _prompts(6)
    params = [{"temperature": temperature, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True,
               "sampling_seed": i} for i in range(6)]
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        assert len(out["output_ids"]) == 12
        assert out["finish_reason"] == {"type": "length", "length": 12}
        # the engine's own tokens, fed to a full forward: no choice is made from the forward here
        logits = _full_forward(engine, prompt, out["output_ids"])
        bound = logprob_bound(_logit_tol(logits), VOCAB, 1.0 if temperature == 0 else temperature)
        torch.testing.assert_close(torch.tensor(out["output_logprobs"]),
                                   _logprobs(logits, out["output_ids"], temperature), atol=bound, rtol=0)


def test_left_padded_ragged_batch_equals_single_prompts(engine, monkeypatch):
    prompts = _prompts(5, seed=1)
    assert len({len(p) for p in prompts}) > 1
    params = [{"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}] * 5
    singles = [_alone(engine, prompt, params[0], monkeypatch) for prompt in prompts]
    steer = Steer({b: (out["output_ids"], logits) for b, (out, logits) in enumerate(singles)})
    batched = steer.run(engine, prompts, params, monkeypatch)
    for b, (single, logits) in enumerate(singles):
        _check_same_as_alone(batched[b], single, steer, b, logits, 0.0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_results_do_not_depend_on_batch_composition(engine, temperature, monkeypatch):
    target = [5, 9, 17, 33, 4]
    sp = {"temperature": temperature, "max_new_tokens": 16, "ignore_eos": True, "sampling_seed": 1234}
    alone, logits = _alone(engine, target, sp, monkeypatch)
    others = _prompts(7, seed=2)
    other_params = [{"temperature": 1.0, "max_new_tokens": 5, "sampling_seed": 50 + i} for i in range(7)]
    # Rows that are greedy, top-k filtered or at another temperature put those rules into the batch's
    # sampler, which a batch without them leaves out.
    other_params[1] |= {"temperature": 0.0}
    other_params[5] |= {"temperature": 0.7, "top_k": 5}
    steer = Steer({3: (alone["output_ids"], logits)})
    mixed = steer.run(engine, others[:3] + [target] + others[3:], other_params[:3] + [sp] + other_params[3:],
                      monkeypatch)
    _check_same_as_alone(mixed[3], alone, steer, 3, logits, temperature)


@pytest.mark.parametrize("mutation", DECODE_MUTATIONS)
def test_bounds_catch_real_errors(engine, mutation, monkeypatch):
    """The bounds above reject an engine whose batched decode has a real error: a left-padded batch
    against its prompts alone (padding, prefill positions), the KV cache against a full forward
    (decode positions); each moves some logit by more than 10x the bound."""
    prompts = _prompts(5, seed=1)
    params = [{"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}] * 5
    singles = [_alone(engine, prompt, params[0], monkeypatch) for prompt in prompts]
    steer = Steer({b: (out["output_ids"], logits) for b, (out, logits) in enumerate(singles)})
    monkeypatch.setattr(engine, "_forward", mutation(engine._forward))
    steer.run(engine, prompts, params, monkeypatch)
    want = [logits for _, logits in singles]
    if mutation is decode_positions_one_ahead:  # the prompts alone have it too: a full forward has not
        want = [_full_forward(engine, p, out["output_ids"]) for p, (out, _) in zip(prompts, singles)]
    gap = max((steer.row(b, 10) - logits).abs().max().item() for b, logits in enumerate(want))
    bound = max(_logit_tol(logits) for logits in want)
    assert gap > 10 * bound, (gap, bound)


def test_seeds_change_samples_and_top_k_1_is_greedy(engine):
    prompt = [1, 7, 8, 9]
    base = {"max_new_tokens": 16, "ignore_eos": True}
    samples = {tuple(engine.generate([prompt], [{**base, "temperature": 1.0, "sampling_seed": s}])[0]
                     ["output_ids"]) for s in range(4)}
    assert len(samples) > 1
    greedy = engine.generate([prompt], [{**base, "temperature": 0}])[0]
    for extra in ({"top_k": 1}, {"top_p": 1e-6}):
        # the same prompt alone, so the same logits: only the sampler's rules differ
        out = engine.generate([prompt], [{**base, "temperature": 0.8, "sampling_seed": 9, **extra}])[0]
        assert out["output_ids"] == greedy["output_ids"]
        # log-probs are of the temperature-scaled distribution, before filtering
        logits = _full_forward(engine, prompt, out["output_ids"])
        torch.testing.assert_close(torch.tensor(out["output_logprobs"]),
                                   _logprobs(logits, out["output_ids"], 0.8),
                                   atol=logprob_bound(_logit_tol(logits), VOCAB, 0.8), rtol=0)


@pytest.mark.parametrize("top_p", [1.0, 0.6])
def test_first_tokens_follow_the_filtered_distribution(engine, top_p):
    """Over many seeds, first-token frequencies match the temperature-scaled, top-p filtered and
    renormalised probabilities (the per-seed uniforms are uniform, the inverse CDF is right)."""
    prompt, temperature, n = [1, 7, 8, 9], 1.5, 6000
    params = [{"temperature": temperature, "top_p": top_p, "max_new_tokens": 1, "ignore_eos": True,
               "sampling_seed": s} for s in range(n)]
    firsts = torch.tensor([o["output_ids"][0] for o in engine.generate([prompt] * n, params)])
    with torch.inference_mode():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1].float()
    probs = torch.softmax(logits / temperature, -1)
    sorted_p, order = probs.sort(descending=True)
    kept = torch.where(sorted_p.cumsum(0) - sorted_p > top_p, 0.0, sorted_p)
    expected = torch.zeros_like(probs).scatter_(0, order, kept / kept.sum())
    freq = torch.bincount(firsts, minlength=probs.numel()).double() / n
    assert freq[expected == 0].sum() == 0  # nothing outside the nucleus
    # 4.5 standard errors per token: a wrong uniform or CDF shifts the heavy tokens far more
    tol = 4.5 * (expected * (1 - expected) / n).sqrt() + 1e-3
    assert ((freq - expected).abs() <= tol).all(), (freq - expected).abs().max()


def test_stop_on_eos_and_stop_token_ids():
    prompt = [1, 11, 12, 13]
    base = ReferenceModel(HF_CONFIG, seed=5)
    free = base.generate([prompt], [{"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}])
    free = free[0]["output_ids"]
    stop_id = free[3]
    cut = free.index(stop_id) + 1
    # same weights, but the model config says this token is EOS
    eos_engine = ReferenceModel({**HF_CONFIG, "eos_token_id": stop_id}, seed=5)
    out = eos_engine.generate([prompt], [{"temperature": 0, "max_new_tokens": 20}])[0]
    assert out["output_ids"] == free[:cut]
    assert out["finish_reason"] == {"type": "stop", "matched": stop_id}
    ignored = eos_engine.generate([prompt], [{"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}])[0]
    assert ignored["output_ids"] == free and ignored["finish_reason"] == {"type": "length", "length": 20}
    # stop_token_ids on the original model; the stop wins when the stop token is the last allowed one
    # (SGLang 0.5.23's Req.update_finish_state checks token stops before the length), not one earlier
    out = base.generate([prompt], [{"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [stop_id]}])[0]
    assert out["output_ids"] == free[:cut] and out["finish_reason"]["type"] == "stop"
    out = base.generate([prompt], [{"temperature": 0, "max_new_tokens": cut, "stop_token_ids": [stop_id]}])[0]
    assert out["output_ids"] == free[:cut] and out["finish_reason"] == {"type": "stop", "matched": stop_id}
    out = base.generate([prompt], [{"temperature": 0, "max_new_tokens": cut - 1, "stop_token_ids": [stop_id]}])[0]
    assert out["output_ids"] == free[:cut - 1] and out["finish_reason"] == {"type": "length", "length": cut - 1}


def test_length_limits(engine):
    outs = engine.generate([[1, 2, 3], [4, 5]],
                           [{"max_new_tokens": 0}, {"max_new_tokens": 3, "ignore_eos": True}])
    assert outs[0] == {"output_ids": [], "output_logprobs": [],
                       "finish_reason": {"type": "length", "length": 0}}
    assert len(outs[1]["output_ids"]) == 3
    # SGLang 0.5.23 (TokenizerManager._validate_one_request, Scheduler's max_req_input_len = ctx - 6):
    # without max_new_tokens (absent or null) a prompt is capped at ctx - 2 - P new tokens; with it,
    # P + max_new_tokens must fit in ctx; an input of ctx - 6 tokens or more is refused either way.
    ctx = engine.context_len
    long_prompt = [7] * (ctx - 10)
    out = engine.generate([long_prompt], [{"ignore_eos": True}])[0]  # SGLang's default 128 > ctx - 2 - P
    assert out["finish_reason"] == {"type": "length", "length": ctx - 2 - len(long_prompt)}
    out = engine.generate([[1, 2]], [{"max_new_tokens": None, "ignore_eos": True}])[0]
    assert out["finish_reason"] == {"type": "length", "length": ctx - 4}
    out = engine.generate([long_prompt], [{"max_new_tokens": 10, "ignore_eos": True}])[0]  # P + 10 = ctx: fits,
    assert out["finish_reason"] == {"type": "length", "length": 8}  # then capped at ctx - 2 - P = 8
    with pytest.raises(ValueError, match=rf"total of {ctx + 1} tokens: {ctx - 10} tokens from the input"):
        engine.generate([long_prompt], [{"max_new_tokens": 11}])
    engine.generate([[7] * (ctx - 7)], [{"max_new_tokens": 1}])
    with pytest.raises(ValueError, match=rf"Input length \({ctx - 6} tokens\) exceeds the maximum allowed "
                                         rf"length \({ctx - 6} tokens\)"):
        engine.generate([[7] * (ctx - 6)], [{"max_new_tokens": 0}])
    with pytest.raises(ValueError, match="longer than the model's context length"):
        engine.generate([[7] * ctx], [{}])


@pytest.mark.parametrize("params, match", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": 0}, "top_k"),
    ({"max_new_tokens": -2}, "max_new_tokens"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"frequency_penalty": 0.5}, "frequency_penalty=0.5 is not supported"),
    ({"bogus": 1}, "unknown sampling_params key 'bogus'"),
    ({"temperature": float("inf")}, "temperature=inf: must be a finite number"),
    ({"sampling_seed": 2**63}, r"sampling_seed=9223372036854775808: must be an integer in \[-2\*\*63"),
    ({"beam_width": 2}, "beam_width=2 is not supported"), ({"json_schema": "{}"}, "json_schema='{}' is not"),
])
def test_bad_sampling_params_name_the_field(params, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_dict(params)


def test_sampling_params_at_sglangs_defaults_are_accepted():
    """SGLang 0.5.23's SamplingParams reads null as the default of every key, an empty grammar string
    as unset, and an empty logit_bias biases nothing: requests spelling the defaults so are served."""
    nulls = {k: None for k in ("min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
                               "min_new_tokens", "n", "stop", "json_schema", "logit_bias", "beam_width",
                               "watermark", "custom_params", "temperature", "top_p", "top_k")}
    assert SamplingParams.from_dict(nulls) == SamplingParams()
    empties = {"json_schema": "", "regex": "", "ebnf": "", "structural_tag": "", "logit_bias": {}, "stop": []}
    assert SamplingParams.from_dict(empties) == SamplingParams()
    assert SamplingParams.from_dict({"sampling_seed": -2**63}).sampling_seed == -2**63


def test_bad_prompts_are_rejected(engine):
    with pytest.raises(ValueError, match=r"input_ids\[1\] is empty"):
        engine.generate([[1], []], [{}, {}])
    with pytest.raises(ValueError, match=r"input_ids\[0\] holds 64"):
        engine.generate([[1, 64]], [{}])


def test_load_weights_checks_every_name_and_shape_before_writing():
    eng = ReferenceModel(HF_CONFIG, seed=0)
    name = "model.layers.0.mlp.experts.1.up_proj.weight"
    before = eng.get_weight(name)
    new = torch.randn_like(before)
    with pytest.raises(ValueError, match="unknown weight name 'model.layers.0.mlp.experts.gate_up_proj'"):
        eng.load_weights([(name, new), ("model.layers.0.mlp.experts.gate_up_proj", new)])
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \[3\], the model expects \[64\]"):
        eng.load_weights([(name, new), ("model.norm.weight", torch.zeros(3))])
    assert torch.equal(eng.get_weight(name), before)  # nothing was written
    assert eng.load_weights([(name, new)]) == 1
    assert torch.equal(eng.get_weight(name), new)
    gate_up = eng.model.state_dict()["model.layers.0.mlp.experts.gate_up_proj"]
    assert torch.equal(gate_up[1, 32:], new)


def test_mixtral_builds_loads_checkpoint_names_and_generates():
    from hpcrl.rollout.hf_names import checkpoint_state_dict

    mixtral = dict(model_type="mixtral", vocab_size=64, hidden_size=32, intermediate_size=16,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                   num_local_experts=3,
                   num_experts_per_tok=2, max_position_embeddings=64, eos_token_id=2)
    src, dst = ReferenceModel(mixtral, seed=1), ReferenceModel(mixtral, seed=2)
    named = checkpoint_state_dict(src.model)
    assert "model.layers.0.block_sparse_moe.experts.2.w2.weight" in named
    assert dst.load_weights(named.items()) == len(named)
    params = [{"temperature": 0.9, "max_new_tokens": 6, "sampling_seed": 7, "ignore_eos": True}] * 2
    a, b = src.generate([[1, 4, 5], [1, 9]], params), dst.generate([[1, 4, 5], [1, 9]], params)
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]


def test_near_zero_temperature_is_greedy_and_unseeded_requests_take_seed_42(engine):
    """SGLang 0.5.23: a temperature below 1e-6 samples greedily with log-probs at temperature 1
    (SamplingParams' _SAMPLING_EPS); in deterministic inference, which hpcrl runs SGLang with, a request
    without sampling_seed samples with seed 42 (SamplingBatchInfo), so identical ones sample alike."""
    prompt = [1, 11, 12, 13]
    greedy, tiny, small = engine.generate([prompt] * 3, [{"temperature": t, "max_new_tokens": 6, "ignore_eos": True}
                                                         for t in (0, 5e-7, 1e-6)])
    assert tiny == greedy
    assert small["output_logprobs"] != greedy["output_logprobs"]  # 1e-6 is a temperature: logits / 1e-6
    sampled = {"temperature": 1.0, "max_new_tokens": 6, "ignore_eos": True}
    a, b, seeded = engine.generate([prompt] * 3, [sampled, sampled, {**sampled, "sampling_seed": 42}])
    assert a == b == seeded
    other = engine.generate([prompt], [{**sampled, "sampling_seed": 43}])[0]
    assert other["output_ids"] != a["output_ids"] or other["output_logprobs"] != a["output_logprobs"]
