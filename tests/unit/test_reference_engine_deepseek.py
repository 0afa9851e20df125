"""hpcrl.rollout.engine.ReferenceModel on the tiny-deepseek-v3 preset (MLA with q_lora_rank, YaRN rope,
1 dense + 2 MoE layers, 8 routed + 1 shared expert, sigmoid router with e_score_correction_bias and
group-limited top-k): it decodes through transformers' forward (the direct forward is Qwen3-MoE's
only) with DeepSeek's MLA cache (the compressed latents), and loads weights under checkpoint names.

Bounds (tests/numerics.py's method, DeepSeek's depths): the engine's KV-cache logits and a full
transformers forward over the unpadded sequence are two summation orders of the same arithmetic, apart
by at most numerics.reordered(N, DEPTH, max|logit|). N = 96, the longest reduction (the dense FFN;
hidden and heads * v_head_dim 64, q_lora_rank 48, kv_lora_rank 32, and at most KEYS = 64 keys).
DEPTH = 2 + 12 L: per layer the input norm, q_a_proj, q_a_layernorm, q_b_proj, q.k, attention.v,
o_proj, the post-attention norm, the router, the top-k weights' normalising sum, the (expert, shared or
dense) up and down projections; then the final norm and lm_head. Routing is compared only where no
near-tie lies within that bound (`numerics.grouped_margin_ratio`: DeepSeek's choice is made on sigmoid scores
plus the bias, first between groups, then between experts), and tokens only where the full forward's
top-1 leads its top-2 by more than twice the bound. test_bounds_catch_real_errors shows that padding
left unmasked, positions counted from the padded start and decode positions one ahead each move a logit
by more than 10x the bound.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from deepseek_dirs import MTP_FILE, add_shard, mtp_tensors
from numerics import grouped_margin_ratio, logprob_bound, reordered
from reference_engine import DECODE_MUTATIONS, reference_server

import hpcrl.rollout.engine as engine_module
from hpcrl.models.presets import CONFIG_DIR, load_hf_config
from hpcrl.rollout.direct_forward import DirectForward
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.hf_names import checkpoint_state_dict

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

HF_CONFIG = load_hf_config("tiny-deepseek-v3", None)
VOCAB, LAYERS = HF_CONFIG["vocab_size"], HF_CONFIG["num_hidden_layers"]
KEYS = 64  # no sequence here is longer (checked in _full_forward)
N = max(HF_CONFIG["hidden_size"], HF_CONFIG["q_lora_rank"], HF_CONFIG["kv_lora_rank"],
        HF_CONFIG["num_attention_heads"] * HF_CONFIG["v_head_dim"],
        HF_CONFIG["qk_nope_head_dim"] + HF_CONFIG["qk_rope_head_dim"], HF_CONFIG["intermediate_size"],
        HF_CONFIG["moe_intermediate_size"] * HF_CONFIG["n_shared_experts"], KEYS)
PER_LAYER = 12
DEPTH = 2 + PER_LAYER * LAYERS
BIAS = "model.layers.{}.mlp.gate.e_score_correction_bias"
MOE_LAYERS = range(HF_CONFIG["first_k_dense_replace"], LAYERS)
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


def _random_biases(seed: int, scale: float = 0.05) -> list[tuple[str, torch.Tensor]]:
    """A router bias per MoE layer (transformers starts them at zero), so that routing depends on it."""
    g = torch.Generator().manual_seed(seed)
    experts = HF_CONFIG["n_routed_experts"]
    return [(BIAS.format(i), torch.randn(experts, generator=g) * scale) for i in MOE_LAYERS]


def _trained_scale(model, seed: int) -> dict[str, torch.Tensor]:
    """Weights at a trained model's scale, under checkpoint names: each matrix N(0, 1/fan_in), the
    embedding N(0, 1), norms kept at 1, router biases N(0, 0.05^2). At transformers' init (std 0.02)
    attention is nearly uniform, so a position error moves logits by only ~10x the bound; here by
    ~1000x."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in checkpoint_state_dict(model).items():
        if "norm" in name:
            continue
        scale = 0.05 if t.dim() == 1 else 1.0 if "embed_tokens" in name else t.shape[-1] ** -0.5
        out[name] = torch.randn(t.shape, generator=g) * scale
    return out


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return _trained_scale(ReferenceModel(HF_CONFIG, seed=0).model, seed=0)


@pytest.fixture(scope="module")
def engine(weights) -> ReferenceModel:
    eng = ReferenceModel(HF_CONFIG, seed=3)
    assert eng.load_weights(weights.items()) == len(weights)
    return eng


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, 14, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (k,), generator=g).tolist() for k in lengths]


def _logit_tol(*logits: torch.Tensor) -> float:
    return reordered(N, DEPTH, max(x.abs().max().item() for x in logits))


@torch.inference_mode()
def _full_forward(engine: ReferenceModel, prompt, output_ids) -> torch.Tensor:
    """The logits that predict output_ids, [T, V], from one transformers forward over the whole
    unpadded sequence, no cache; first checks that no router near-tie lies within the bound."""
    seq = torch.tensor([prompt + output_ids])
    assert seq.shape[1] <= KEYS
    out = engine.model(input_ids=seq, output_router_logits=True)
    assert len(out.router_logits) == len(MOE_LAYERS)
    biases = [engine.model.model.layers[i].mlp.gate.e_score_correction_bias for i in MOE_LAYERS]
    ratio = grouped_margin_ratio(list(out.router_logits), biases, HF_CONFIG, N, MOE_LAYERS[0], PER_LAYER)
    assert ratio > 1.5, f"a router near-tie within the rounding bound ({ratio:.2f}): use other inputs"
    return out.logits[0, len(prompt) - 1:-1].float()


def _logprobs(logits_TV: torch.Tensor, output_ids, temperature: float) -> torch.Tensor:
    t = 1.0 if temperature == 0 else temperature
    return torch.log_softmax(logits_TV / t, -1).gather(1, torch.tensor(output_ids)[:, None])[:, 0]


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def test_direct_forward_refuses_and_the_engine_keeps_transformers_forward(engine):
    assert "DeepseekV3ForCausalLM is not Qwen3MoeForCausalLM" in DirectForward.refusal(engine.model)
    assert engine._forward == engine._hf_forward


def test_greedy_is_transformers_argmax_token_by_token(engine):
    """A left-padded ragged batch decoded with the MLA cache: every greedy token is the argmax of a
    full forward over the unpadded sequence, and its log-prob that forward's within the bound."""
    prompts = _prompts(4)
    assert len({len(p) for p in prompts}) > 1
    for prompt, out in zip(prompts, engine.generate(prompts, [GREEDY] * len(prompts))):
        assert out["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
        logits = _full_forward(engine, prompt, out["output_ids"])
        tol = _logit_tol(logits)
        top2 = logits.topk(2, -1).values
        margin = (top2[:, 0] - top2[:, 1]).min().item()
        assert margin > 2 * tol, f"two tokens within the bound ({margin:.2e} vs {tol:.2e}): use other prompts"
        assert logits.argmax(-1).tolist() == out["output_ids"]
        want = _logprobs(logits, out["output_ids"], 0)
        torch.testing.assert_close(torch.tensor(out["output_logprobs"]), want, atol=logprob_bound(tol, VOCAB),
                                   rtol=0)


@pytest.mark.parametrize("temperature", [0.7, 1.3])
def test_sampled_logprobs_equal_a_full_forward_and_seeds_reproduce(engine, weights, temperature):
    prompts = _prompts(4, seed=7)
    params = [{"temperature": temperature, "top_p": 0.9, "max_new_tokens": 12, "ignore_eos": True,
               "sampling_seed": 100 + i} for i in range(4)]
    outs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        # the engine's own tokens fed to a full forward: no choice is made from that forward
        logits = _full_forward(engine, prompt, out["output_ids"])
        torch.testing.assert_close(torch.tensor(out["output_logprobs"]),
                                   _logprobs(logits, out["output_ids"], temperature),
                                   atol=logprob_bound(_logit_tol(logits), VOCAB, temperature), rtol=0)
    # the same request again, and on another engine holding the same weights: the same code on the
    # same inputs, so the same bits
    assert engine.generate(prompts, params) == outs
    twin = ReferenceModel(HF_CONFIG, seed=5)
    twin.load_weights(weights.items())
    assert twin.generate(prompts, params) == outs
    reseeded = engine.generate(prompts, [{**p, "sampling_seed": p["sampling_seed"] + 1} for p in params])
    assert [o["output_ids"] for o in reseeded] != [o["output_ids"] for o in outs]


class _Forced:
    """Stands in for the engine's sampler (engine._sample) for one `generate` call: row b takes
    tokens[b][t] at step t, whatever its logits, which it records ([B, V] per step)."""

    def __init__(self, tokens: list[list[int]]) -> None:
        self.tokens, self.logits = tokens, []

    def __call__(self, logits_BV, u_B, *rules):
        step = len(self.logits)
        self.logits.append(logits_BV.clone())
        tok_B = torch.tensor([row[step] for row in self.tokens])
        return tok_B, torch.log_softmax(logits_BV, -1).gather(1, tok_B[:, None])[:, 0]


@pytest.mark.parametrize("mutation", DECODE_MUTATIONS)
def test_bounds_catch_real_errors(engine, mutation, monkeypatch):
    """The bound above rejects a decode loop with a real error: fed the tokens of the correct run,
    the broken engine's logits are more than 10x the bound away from the full forward's."""
    prompts = _prompts(4)
    outs = [o["output_ids"] for o in engine.generate(prompts, [GREEDY] * len(prompts))]
    want = [_full_forward(engine, p, o) for p, o in zip(prompts, outs)]
    forced = _Forced(outs)
    monkeypatch.setattr(engine_module, "_sample", forced)
    monkeypatch.setattr(engine, "_forward", mutation(engine._forward))
    engine.generate(prompts, [GREEDY] * len(prompts))
    got = [torch.stack([step[b] for step in forced.logits]) for b in range(len(prompts))]
    gap = max((g - w).abs().max().item() for g, w in zip(got, want))
    bound = max(_logit_tol(w) for w in want)
    assert gap > 10 * bound, (gap, bound)


def test_load_weights_of_a_full_named_set_is_bit_exact():
    """Every checkpoint-named tensor of another model (router biases included) loads; get_weight
    returns its bytes; the engines then generate the same bits."""
    src, dst = ReferenceModel(HF_CONFIG, seed=1), ReferenceModel(HF_CONFIG, seed=2)
    src.load_weights(_random_biases(1))
    named = checkpoint_state_dict(src.model)
    assert set(named) == set(dst.slots)
    assert {BIAS.format(i) for i in MOE_LAYERS} <= set(named)
    assert all(_bytes(t) != _bytes(dst.get_weight(n)) for n, t in named.items() if "norm" not in n)
    assert dst.load_weights(named.items()) == len(named)
    for name, tensor in named.items():
        got = dst.get_weight(name)
        assert got.dtype == tensor.dtype and _bytes(got) == _bytes(tensor), name
    params = [{"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 5, "ignore_eos": True}] * 3
    prompts = _prompts(3, seed=4)
    assert dst.generate(prompts, params) == src.generate(prompts, params)


def test_partial_loads_change_only_what_they_name():
    eng = ReferenceModel(HF_CONFIG, seed=0)
    before = {name: _bytes(eng.get_weight(name)) for name in eng.slots}
    g = torch.Generator().manual_seed(9)
    names = [BIAS.format(1), "model.layers.2.mlp.experts.5.up_proj.weight",
             "model.layers.2.mlp.experts.5.down_proj.weight",
             "model.layers.1.mlp.shared_experts.gate_proj.weight", "model.layers.0.mlp.up_proj.weight",
             "model.layers.2.self_attn.kv_b_proj.weight", "model.layers.1.mlp.gate.weight"]
    new = {n: torch.randn(eng.get_weight(n).shape, generator=g) for n in names}
    assert eng.load_weights(reversed(list(new.items()))) == len(new)
    for name in eng.slots:
        want = _bytes(new[name]) if name in new else before[name]
        assert _bytes(eng.get_weight(name)) == want, name
    # the per-expert slots are views into transformers' fused tensors
    fused = eng.model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    inter = HF_CONFIG["moe_intermediate_size"]
    assert torch.equal(fused[5, inter:], new["model.layers.2.mlp.experts.5.up_proj.weight"])


def test_e_score_correction_bias_loads_into_the_router_it_steers():
    """A bias that favours the last top_k experts of layer 2 makes transformers' router pick them for
    every token: the loaded bias is the one the model routes with."""
    eng = ReferenceModel(HF_CONFIG, seed=0)
    experts, k = HF_CONFIG["n_routed_experts"], HF_CONFIG["num_experts_per_tok"]
    bias = torch.zeros(experts)
    bias[experts - k:] = 10.0  # sigmoid scores lie in (0, 1): +10 outweighs any score difference
    assert eng.load_weights([(BIAS.format(2), bias)]) == 1
    assert _bytes(eng.get_weight(BIAS.format(2))) == _bytes(bias)
    gate = eng.model.model.layers[2].mlp.gate
    with torch.inference_mode():
        hidden = torch.randn(16, HF_CONFIG["hidden_size"], generator=torch.Generator().manual_seed(0))
        _, _, chosen = gate(hidden)
    assert chosen.sort(-1).values.tolist() == [list(range(experts - k, experts))] * 16


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_shard_routes_tensors_load_bit_exactly(dtype):
    """The shard route delivers the tensors of moe.specs.spec_at_dtype(config, dtype): exactly the
    engine's checkpoint names, at the spec's dtypes. Each loads to the bit: get_weight gives back the
    bytes sent, except the router weight of a bf16 engine, which transformers (as SGLang's DeepSeek
    gate) keeps in float32 (_keep_in_fp32_modules_strict) and which holds the bf16 values exactly;
    the float32 router bias stays float32."""
    from moe.specs import spec_at_dtype

    spec = spec_at_dtype(HF_CONFIG, dtype)
    eng = ReferenceModel(HF_CONFIG, seed=0, dtype=getattr(torch, dtype))
    assert [t.name for t in spec.tensors if t.name not in eng.slots] == []
    assert set(eng.slots) == {t.name for t in spec.tensors}
    g = torch.Generator().manual_seed(4)
    sent = {t.name: (torch.randn(t.shape, generator=g) * 0.1 + 0.3).to(getattr(torch, t.dtype))
            for t in spec.tensors}
    assert {t.dtype for t in spec.tensors if "e_score_correction_bias" in t.name} == {"float32"}
    assert eng.load_weights(sent.items()) == len(sent)
    for name, tensor in sent.items():
        got = eng.get_weight(name)
        if name.endswith("mlp.gate.weight"):
            assert got.dtype == torch.float32 and torch.equal(got, tensor.float()), name
        else:
            assert got.dtype == tensor.dtype and _bytes(got) == _bytes(tensor), name
    out = eng.generate([[1, 5, 9]], [GREEDY])[0]
    assert len(out["output_ids"]) == GREEDY["max_new_tokens"]


# -- model directories (load_model_dir) ------------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """tiny-deepseek-v3 with every tensor drawn at random (norms and router biases too), saved by
    transformers' save_pretrained in several shards, plus its MTP layer in a shard of its own; and the
    main model's checkpoint-named tensors."""
    out = tmp_path_factory.mktemp("deepseek")
    src = ReferenceModel(HF_CONFIG, seed=0)
    g = torch.Generator().manual_seed(1)
    src.load_weights((n, torch.randn(t.shape, generator=g))
                     for n, t in checkpoint_state_dict(src.model).items())
    src.model.save_pretrained(str(out), max_shard_size="100KB")
    named = {n: t.clone() for n, t in checkpoint_state_dict(src.model).items()}
    add_shard(out, mtp_tensors(HF_CONFIG, seed=2), MTP_FILE)
    return out, named


def test_load_model_dir_loads_the_main_model_and_skips_the_mtp_layer(model_dir):
    path, named = model_dir
    assert len(list(path.glob("model-*-of-*.safetensors"))) >= 3
    eng = ReferenceModel(json.loads((path / "config.json").read_text()), seed=5)
    assert eng.load_model_dir(str(path)) == len(named) == len(eng.slots)
    for name, tensor in named.items():
        assert _bytes(eng.get_weight(name)) == _bytes(tensor), name
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = sorted(n for n, f in index.items() if f == MTP_FILE)
    assert sorted(eng.skipped_mtp) == mtp and len(mtp) > 6


@pytest.mark.parametrize("extra", [f"model.layers.{LAYERS + 1}.eh_proj.weight",
                                   "model.layers.1.mlp.experts.8.up_proj.weight",
                                   "model.layers.0.mlp.shared_experts.up_proj.weight"],
                         ids=["past-the-mtp-layers", "expert-past-n_routed_experts",
                              "shared-expert-of-a-dense-layer"])
def test_load_model_dir_refuses_tensors_the_model_does_not_have(model_dir, extra, tmp_path):
    path, _ = model_dir
    bad = Path(shutil.copytree(path, tmp_path / "bad"))
    add_shard(bad, {extra: torch.zeros(4, 4)}, "model-extra.safetensors")
    eng = ReferenceModel(json.loads((path / "config.json").read_text()), seed=5)
    before = {name: _bytes(eng.get_weight(name)) for name in eng.slots}
    with pytest.raises(ValueError, match=re.escape(extra)):
        eng.load_model_dir(str(bad))
    assert {name: _bytes(eng.get_weight(name)) for name in eng.slots} == before


@pytest.mark.parametrize("count", [0, None], ids=["zero", "absent"])
def test_mtp_layers_config_json_does_not_count_are_named_as_such(model_dir, tmp_path, count):
    """DeepSeek's MTP layers in the weights while config.json's num_nextn_predict_layers is 0 or
    absent: the error says which key to set (it said shared experts were not supported)."""
    from moe.hf_checkpoint import CheckpointFormatError, HFCheckpoint
    from moe.hf_megatron import HFModelDims

    path, _ = model_dir
    bad = Path(shutil.copytree(path, tmp_path / "bad"))
    config = json.loads((bad / "config.json").read_text())
    config.pop("num_nextn_predict_layers")
    if count is not None:
        config["num_nextn_predict_layers"] = count
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointFormatError) as err:
        HFCheckpoint(bad, HFModelDims.from_hf_config(config)).close()
    msg = str(err.value)
    assert f"layers [{LAYERS}] after config.json's num_hidden_layers={LAYERS}" in msg, msg
    assert "num_nextn_predict_layers (now 0) must count: set it to 1" in msg, msg
    assert "shared experts" not in msg, msg


def test_load_model_dir_refuses_a_directory_without_the_router_bias(model_dir, tmp_path):
    path, _ = model_dir
    bad = Path(shutil.copytree(path, tmp_path / "bad"))
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    del index["weight_map"][BIAS.format(2)]
    index_path.write_text(json.dumps(index))
    eng = ReferenceModel(json.loads((path / "config.json").read_text()), seed=5)
    with pytest.raises(ValueError, match=re.escape(BIAS.format(2))):
        eng.load_model_dir(str(bad))


# -- the reference server ---------------------------------------------------------------------------------


def test_server_answers_generate_in_sglang_shapes(tmp_path):
    """The server started from the preset's config.json (random weights from seed 0) against a twin
    engine in this process with the same weights: the same requests in the same batches give the same
    bits (the same code on the same inputs, one thread each)."""
    twin = ReferenceModel(HF_CONFIG, seed=0)
    prompts = _prompts(3, seed=2)
    sampled = [{"temperature": 1.0, "max_new_tokens": 8, "sampling_seed": 40 + i} for i in range(3)]
    with reference_server(tmp_path / "engine.log", CONFIG_DIR / "tiny-deepseek-v3.json",
                          startup_timeout_s=90) as (_, client):
        single = client.generate(prompts[0], GREEDY, return_logprob=True, rid="req-1")
        batch = client.generate(prompts, sampled, return_logprob=True)
        assert client.model_info()["model_type"] == "deepseek_v3"
    assert set(single) == {"text", "output_ids", "meta_info"}
    meta = single["meta_info"]
    assert meta["id"] == "req-1" and meta["prompt_tokens"] == len(prompts[0])
    assert meta["completion_tokens"] == GREEDY["max_new_tokens"]
    assert meta["finish_reason"] == {"type": "length", "length": GREEDY["max_new_tokens"]}
    (alone,) = twin.generate([prompts[0]], [GREEDY])
    assert meta["output_token_logprobs"] == [[lp, t, None] for lp, t in zip(alone["output_logprobs"],
                                                                            alone["output_ids"])]
    assert single["output_ids"] == alone["output_ids"]
    assert isinstance(batch, list) and len(batch) == 3
    for answer, want in zip(batch, twin.generate(prompts, sampled)):
        assert answer["output_ids"] == want["output_ids"]
        assert [lp for lp, _, _ in answer["meta_info"]["output_token_logprobs"]] == want["output_logprobs"]


def test_server_loads_a_model_dir_and_says_it_left_the_mtp_layer_out(model_dir, tmp_path):
    path, named = model_dir
    log = tmp_path / "engine.log"
    with reference_server(log, CONFIG_DIR / "tiny-deepseek-v3.json", startup_timeout_s=90,
                          model_path=str(path)) as (_, client):
        got = client.generate(_prompts(2, seed=3), [GREEDY] * 2)
    twin = ReferenceModel(HF_CONFIG, seed=0)
    twin.load_weights(named.items())
    assert [a["output_ids"] for a in got] == [o["output_ids"] for o in twin.generate(_prompts(2, seed=3),
                                                                                      [GREEDY] * 2)]
    mtp = len(mtp_tensors(HF_CONFIG, seed=2))
    assert f"loaded {len(named)} weights from {path}; {mtp} MTP tensors not loaded" in log.read_text()


def test_kimi_k2_is_built_as_deepseek_v3_and_answers_with_its_own_model_type(tmp_path):
    """model_type kimi_k2, which transformers does not know, builds transformers' DeepseekV3 (SGLang
    0.5.23 registers kimi_k2 as a DeepseekV3Config) with the same checkpoint names; the server reports
    config.json's model_type, as SGLang's /get_model_info reports its hf_config's, and generates what
    an in-process twin does."""
    from deepseek_dirs import kimi_k2_config

    cfg = kimi_k2_config()
    twin = ReferenceModel(cfg, seed=0)
    assert type(twin.model).__name__ == "DeepseekV3ForCausalLM" and twin.model_type == "kimi_k2"
    assert twin.config.n_group == 1 and sorted(twin.slots) == sorted(ReferenceModel(HF_CONFIG, seed=0).slots)
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    with reference_server(tmp_path / "engine.log", config, startup_timeout_s=90) as (_, client):
        assert client.model_info()["model_type"] == "kimi_k2"
        got = client.generate(_prompts(2, seed=4), [GREEDY] * 2)
    assert [a["output_ids"] for a in got] == [o["output_ids"] for o in twin.generate(_prompts(2, seed=4),
                                                                                      [GREEDY] * 2)]


def test_the_latent_norms_take_rms_norm_eps_as_sglang_builds_them():
    """transformers builds q_a_layernorm and kv_a_layernorm with eps 1e-6 whatever config.json says;
    SGLang 0.5.23 and the trainer (Megatron) with rms_norm_eps. The engine follows SGLang."""
    cfg = {**load_hf_config("tiny-deepseek-v3", None), "rms_norm_eps": 1e-5}
    model = ReferenceModel(cfg).model
    eps = {name.rsplit(".", 1)[-1]: m.variance_epsilon for name, m in model.named_modules()
           if name.endswith(("q_a_layernorm", "kv_a_layernorm", "input_layernorm"))}
    assert eps == {"q_a_layernorm": 1e-5, "kv_a_layernorm": 1e-5, "input_layernorm": 1e-5}
