"""hpcrl.rollout.direct_forward: the reference engine's Qwen3-MoE decoding forward gives transformers'
logits bit for bit (padded or not, fp32 or bf16, dense and MoE layers, GQA or not, at the init's small
weights and at weights spread wide enough that routing and attention are far from uniform), and the
engine uses it exactly where it describes the model."""

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
def test_logits_equal_transformers_bit_for_bit(variant, dtype):
    engine = ReferenceModel({**TINY, **VARIANTS[variant]}, dtype=dtype, seed=5)
    assert isinstance(engine._forward, DirectForward)
    for spread in (False, True):
        if spread:
            _spread(engine)
        for padded in (False, True):
            direct = _decode_logits(engine, engine._forward, padded)
            hf = _decode_logits(engine, engine._hf_forward, padded)
            assert all(torch.equal(a, b) for a, b in zip(direct, hf)), (variant, dtype, spread, padded)
            assert not spread or max(float(x.abs().max()) for x in hf) > 2.0, "weights too small to tell"
        assert direct[0].dtype == dtype and direct[0].shape == (16, 64)


def test_generate_is_unchanged_and_sees_loaded_weights():
    engine = ReferenceModel(TINY, seed=2)
    prompts = [[5, 6], [7], [8, 9, 10], [11, 12]]
    params = [{"temperature": 1.0, "max_new_tokens": 6, "sampling_seed": i} for i in range(4)]
    direct = engine.generate(prompts, params)
    engine._forward = engine._hf_forward
    assert engine.generate(prompts, params) == direct
    engine._forward = DirectForward(engine.model)
    engine.load_weights([("model.norm.weight", torch.full((64,), 3.0))])  # a push changes the answers
    moved = engine.generate(prompts, params)
    assert [o["output_logprobs"] for o in moved] != [o["output_logprobs"] for o in direct]
    engine._forward = engine._hf_forward
    assert engine.generate(prompts, params) == moved


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
