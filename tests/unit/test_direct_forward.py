"""hpcrl.rollout.direct_forward: the reference engine's Qwen3-MoE decoding forward gives transformers'
logits (padded or not, fp32 or bf16, dense and MoE layers, GQA or not, weights spread wide enough that
routing and attention are far from uniform), and the engine uses it exactly where it describes the
model."""

from __future__ import annotations

import pytest
import torch
from numerics import U_BF16, reordered

from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.direct_forward import DirectForward
from hpcrl.rollout.engine import ReferenceModel

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

TINY = load_hf_config("tiny-qwen3-moe", None)
VARIANTS = {
    "tiny": {},
    "dense layer 0, no GQA": {"mlp_only_layers": [0], "num_key_value_heads": 4},
    "every other layer MoE, unnormalised top-k": {"decoder_sparse_step": 2, "norm_topk_prob": False,
                                                  "num_hidden_layers": 3},
}


def _decode_logits(engine: ReferenceModel, forward, padded: bool, steps: int = 4) -> list[torch.Tensor]:
    """The logits of a prefill and `steps - 1` decode steps of 16 prompts through `forward`. The tokens
    fed are drawn up front, not argmax'd from `forward`'s own logits: both forwards see the same
    inputs, so a near-tie between two tokens cannot send one of them down another sequence."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (16,), generator=g) if padded else torch.full((16,), 3)
    width = int(lengths.max())
    ids = torch.randint(3, 64, (16, width), generator=g)
    fed = torch.randint(3, 64, (steps, 16, 1), generator=g)
    mask = torch.ones(16, width + steps, dtype=torch.long)
    mask[:, :width] = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=engine.config)
    out = []
    with torch.inference_mode():
        for t in range(steps):
            out.append(forward(ids, mask[:, :width + t] if padded else None, pos, cache)[:, -1])
            ids, pos = fed[t], pos[:, -1:] + 1
    return out


def _spread(engine: ReferenceModel) -> None:
    """Weights ~N(0, 0.3) (norm weights ~N(1, 0.3)) instead of the init's std 0.02: logits of several
    units, routing and attention far from uniform."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(noise + 1.0 if "norm" in name else noise)


def logit_tolerance(config: dict, dtype: torch.dtype, max_logit: float) -> float:
    """How far two evaluations of the same Qwen3-MoE logits may differ when only the order of their
    sums differs (DirectForward and HF call other kernels: SDPA vs eager attention, grouped GEMMs vs
    per-expert matmuls).

    A sum of n terms computed in two orders differs by at most 2 * n * u * sum|terms| (the textbook
    gamma_n bound, u the unit roundoff; tests/numerics.py). A logit ends a chain of 1 + 7 * L
    reductions (per layer: q/k/v, q.k, attention.v, o_proj, router, expert up, expert down; then
    lm_head), none longer than
    n = max(hidden, heads * head_dim, ffn sizes, keys) terms, each passing its error on through
    normalised layers. With sum|terms| taken as max|logit| (the weights' scale is in it), the
    first-order bound is 2 * n * u * (1 + 7 * L) * max|logit|: for the tiny model (n = 128, its dense
    ffn) 2 * 128 * 2^-24 * 15 ~ 2.3e-4 of max|logit| in fp32 (measured: <= 9e-7 of it with
    ATEN_CPU_CAPABILITY avx2 and avx512, 1 and 2 threads). In bf16 each residual add and norm rounds
    its output to bf16 (u = 2^-8), and the two sides may round at other points: 2 * (1 + 2 * L) * 2^-8
    of max|logit| (measured: equal on both kinds). Real errors -- a swapped expert, a missing norm,
    gate and up taken from each other's rows, a wrong RoPE half -- move logits by O(max|logit|)
    (test_bound_catches_real_errors)."""
    layers = config["num_hidden_layers"]
    n = max(config["hidden_size"], config["num_attention_heads"] * config["head_dim"],
            config["moe_intermediate_size"], config["intermediate_size"], 16)  # 16: longest key row here
    if dtype == torch.float32:
        return reordered(n, 1 + 7 * layers, max_logit)
    return 2 * (1 + 2 * layers) * U_BF16 * max_logit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(variant, dtype):
    config = {**TINY, **VARIANTS[variant]}
    engine = ReferenceModel(config, dtype=dtype, seed=5)
    _spread(engine)
    assert isinstance(engine._forward, DirectForward)
    for padded in (False, True):
        direct = torch.stack(_decode_logits(engine, engine._forward, padded)).float()
        hf = torch.stack(_decode_logits(engine, engine._hf_forward, padded)).float()
        assert hf.abs().max() > 2.0, "weights too small for a test that can tell"
        tol = logit_tolerance(config, dtype, hf.abs().max().item())
        torch.testing.assert_close(direct, hf, atol=tol, rtol=0, msg=f"{variant} {padded}")
        assert direct.shape == (4, 16, 64)


def _mutated_weights(engine: ReferenceModel, mutate) -> DirectForward:
    """A DirectForward over a copy of the model whose weights `mutate` changed (HF keeps the original)."""
    import copy

    model = copy.deepcopy(engine.model)
    with torch.no_grad():
        mutate(model.model.layers)
    return DirectForward(model)


def _swap_experts(layers) -> None:
    for w in (layers[0].mlp.experts.gate_up_proj, layers[0].mlp.experts.down_proj):
        w[[0, 1]] = w[[1, 0]].clone()


def _swap_gate_up(layers) -> None:
    w = layers[1].mlp.experts.gate_up_proj
    w.copy_(torch.cat(w.chunk(2, 1)[::-1], 1))


def _skip_q_norm(engine, monkeypatch):
    target, plain = engine.model.model.layers[0].self_attn.q_norm, DirectForward._norm
    monkeypatch.setattr(DirectForward, "_norm",
                        lambda self, x, norm: x if norm is target else plain(self, x, norm))
    return engine._forward


def _wrong_rope_half(engine, monkeypatch):
    import hpcrl.rollout.direct_forward as df

    monkeypatch.setattr(df, "_rope", lambda x, cos, sin: x * cos + torch.cat(x.chunk(2, -1)[::-1], -1) * sin)
    return engine._forward


MUTATIONS = {  # each changes only what DirectForward computes; HF runs the model as it is
    "swapped expert": lambda engine, _: _mutated_weights(engine, _swap_experts),
    "gate and up swapped": lambda engine, _: _mutated_weights(engine, _swap_gate_up),
    "missing q_norm": _skip_q_norm,
    "wrong RoPE half": _wrong_rope_half,
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_bound_catches_real_errors(mutation, dtype, monkeypatch):
    """The tolerance of test_logits_equal_transformers rejects a DirectForward with a real error."""
    engine = ReferenceModel(TINY, dtype=dtype, seed=5)
    _spread(engine)
    forward = MUTATIONS[mutation](engine, monkeypatch)
    direct = torch.stack(_decode_logits(engine, forward, padded=True)).float()
    monkeypatch.undo()
    hf = torch.stack(_decode_logits(engine, engine._hf_forward, padded=True)).float()
    assert (direct - hf).abs().max() > 10 * logit_tolerance(TINY, dtype, hf.abs().max().item())


def _same_answers(engine: ReferenceModel, prompts: list[list[int]], a: list[dict], b: list[dict]) -> bool:
    """The same tokens and finish reasons, log-probs within the bound of two forwards that differ in
    the order of their sums (numerics.logprob_bound of logit_tolerance at the answers' max|logit|).
    Sampling from logits that far apart picks the same token unless a draw falls within ~1e-6 of a
    boundary of the token CDF: ~1e-4 per run of these 24 draws, on any host."""
    from numerics import logprob_bound

    with torch.inference_mode():
        max_logit = max(engine.model(torch.tensor([p + x["output_ids"]])).logits.abs().max().item()
                        for p, x in zip(prompts, a, strict=True))
    bound = logprob_bound(logit_tolerance(TINY, torch.float32, max_logit), TINY["vocab_size"])
    def apart(x: dict, y: dict) -> float:
        return (torch.tensor(x["output_logprobs"]) - torch.tensor(y["output_logprobs"])).abs().max().item()

    return all(x["output_ids"] == y["output_ids"] and x["finish_reason"] == y["finish_reason"]
               and apart(x, y) <= bound for x, y in zip(a, b, strict=True))


def test_generate_matches_transformers_and_sees_pushed_weights():
    engine = ReferenceModel(TINY, seed=2)
    direct_forward = engine._forward
    prompts = [[5, 6], [7], [8, 9, 10], [11, 12]]
    params = [{"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": i} for i in range(4)]
    direct = engine.generate(prompts, params)
    engine._forward = engine._hf_forward
    assert _same_answers(engine, prompts, engine.generate(prompts, params), direct)
    engine._forward = direct_forward
    engine.load_weights([("model.norm.weight", torch.full((64,), 3.0))])  # a push changes the answers
    moved = engine.generate(prompts, params)
    assert not _same_answers(engine, prompts, moved, direct)
    engine._forward = engine._hf_forward
    assert _same_answers(engine, prompts, engine.generate(prompts, params), moved)


def test_other_models_keep_the_transformers_forward():
    mixtral = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
               "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
               "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
    engine = ReferenceModel(mixtral)
    assert engine._forward == engine._hf_forward
    assert DirectForward.refusal(engine.model) == "MixtralForCausalLM is not Qwen3MoeForCausalLM"
    with pytest.raises(ValueError, match="cannot run this model: MixtralForCausalLM"):
        DirectForward(engine.model)
    windowed = ReferenceModel({**TINY, "use_sliding_window": True, "sliding_window": 8})
    assert windowed.model.config.sliding_window == 8, "the config no longer takes a sliding window this way"
    assert DirectForward.refusal(windowed.model) == "a sliding-window mask"
    assert windowed._forward == windowed._hf_forward
    assert DirectForward.refusal(windowed.model.train()) == "a sliding-window mask"
    engine = ReferenceModel(TINY)
    assert DirectForward.refusal(engine.model.train()) == "the model is in training mode"


def test_per_expert_matmuls_give_grouped_mms_values():
    """The CUDA fallback outside bf16 (`per_expert_mm`) against F.grouped_mm, experts with and without
    rows: each element one dot product of K = 48 terms, so the two orders differ by at most
    reordered(48, 1, max sum|x||w|)."""
    from hpcrl.rollout.direct_forward import per_expert_mm

    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(10, 48, generator=gen), torch.randn(4, 48, 16, generator=gen)
    ends = torch.tensor([3, 3, 7, 10], dtype=torch.int32)  # expert 1 has no rows
    got, want = per_expert_mm(x, w, ends), torch.nn.functional.grouped_mm(x, w, offs=ends)
    assert got.shape == want.shape == (10, 16)
    magnitude = float((x.abs() @ w.abs().amax(0)).max())  # >= sum|x||w| of every element
    assert (got - want).abs().max() <= reordered(48, 1, magnitude)
    # a wrong expert for rows 3..6 is far outside that bound
    assert (x[3:7] @ w[3] - want[3:7]).abs().max() > 100 * reordered(48, 1, magnitude)
