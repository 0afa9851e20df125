"""hpcrl.rollout.direct_forward: the reference engine's Qwen3-MoE decoding forward gives transformers'
logits (padded or not, fp32 or bf16, dense and MoE layers, GQA or not, weights spread wide enough that
routing and attention are far from uniform), and the engine uses it exactly where it describes the
model."""

from __future__ import annotations

import pytest
import torch

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
    """The logits of `steps` greedy decode steps of 16 prompts, through `forward`."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (16,), generator=g) if padded else torch.full((16,), 3)
    width = int(lengths.max())
    ids = torch.randint(3, 64, (16, width), generator=g)
    mask = torch.ones(16, width + steps, dtype=torch.long)
    mask[:, :width] = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=engine.config)
    out = []
    with torch.inference_mode():
        for t in range(steps):
            logits = forward(ids, mask[:, :width + t] if padded else None, pos, cache)[:, -1]
            out.append(logits)
            ids, pos = logits.argmax(-1)[:, None], pos[:, -1:] + 1
    return out


def _spread(engine: ReferenceModel) -> None:
    """Weights ~N(0, 0.3) (norm weights ~N(1, 0.3)) instead of the init's std 0.02: logits of several
    units, routing and attention far from uniform."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * 0.3
            p.copy_(noise + 1.0 if "norm" in name else noise)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_equal_transformers(variant, dtype):
    engine = ReferenceModel({**TINY, **VARIANTS[variant]}, dtype=dtype, seed=5)
    _spread(engine)
    assert isinstance(engine._forward, DirectForward)
    for padded in (False, True):
        direct = torch.stack(_decode_logits(engine, engine._forward, padded)).float()
        hf = torch.stack(_decode_logits(engine, engine._hf_forward, padded)).float()
        assert hf.abs().max() > 2.0, "weights too small for a test that can tell"
        # fp32: the same math, sums in another order; bf16: a rounding flip is one bf16 ulp of a logit
        tol = 1e-6 if dtype == torch.float32 else 2 ** -6
        torch.testing.assert_close(direct, hf, atol=tol * hf.abs().max(), rtol=0, msg=f"{variant} {padded}")
        assert direct.shape == (4, 16, 64)


def _same_answers(a: list[dict], b: list[dict]) -> bool:
    """The same tokens and finish reasons, log-probs within 1e-5."""
    return all(x["output_ids"] == y["output_ids"] and x["finish_reason"] == y["finish_reason"]
               and torch.allclose(torch.tensor(x["output_logprobs"]), torch.tensor(y["output_logprobs"]),
                                  atol=1e-5, rtol=0) for x, y in zip(a, b, strict=True))


def test_generate_matches_transformers_and_sees_pushed_weights():
    engine = ReferenceModel(TINY, seed=2)
    direct_forward = engine._forward
    prompts = [[5, 6], [7], [8, 9, 10], [11, 12]]
    params = [{"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": i} for i in range(4)]
    direct = engine.generate(prompts, params)
    engine._forward = engine._hf_forward
    assert _same_answers(engine.generate(prompts, params), direct)
    engine._forward = direct_forward
    engine.load_weights([("model.norm.weight", torch.full((64,), 3.0))])  # a push changes the answers
    moved = engine.generate(prompts, params)
    assert not _same_answers(moved, direct)
    engine._forward = engine._hf_forward
    assert _same_answers(engine.generate(prompts, params), moved)


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
