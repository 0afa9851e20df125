"""rollout.fp32_lm_head (SGLang's --enable-fp32-lm-head, issue 33): the reference engine's logits are a
float32 matmul of the same bf16 hidden states its bf16 head reads (DirectForward for Qwen3-MoE,
transformers' forward for DeepSeek-V3 and Mixtral), and the flag reaches both engines' command lines
(the reference server's answers are the flagged engine's; SGLang's parser: tests/conformance/
test_fp32_lm_head_flag.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from numerics import U_BF16, reordered
from reference_engine import reference_server

from hpcrl.config import JobConfig
from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.direct_forward import DirectForward
from hpcrl.rollout.engine import ReferenceModel
from hpcrl.rollout.worker import FP32_LM_HEAD_FLAG, engine_server_args, sglang_command

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("one_torch_thread")]

MIXTRAL = {"model_type": "mixtral", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
           "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 64}
CONFIGS = {"qwen3_moe": load_hf_config("tiny-qwen3-moe", None),
           "deepseek_v3": load_hf_config("tiny-deepseek-v3", None), "mixtral": MIXTRAL}


def _engine(family: str, fp32_lm_head: bool) -> ReferenceModel:
    """A bf16 engine of `family` with weights ~N(0, 0.3) (norms ~N(1, 0.3)): logits of several units,
    so that their bf16 rounding (a few 1e-2) is far above fp32 arithmetic's."""
    engine = ReferenceModel(CONFIGS[family], dtype=torch.bfloat16, seed=5, fp32_lm_head=fp32_lm_head)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in engine.model.named_parameters():
            noise = (torch.randn(p.shape, generator=g) * 0.3).to(p.dtype)
            p.copy_(noise + 1.0 if "norm" in name else noise)
    return engine


def _steps(engine: ReferenceModel, capture: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Logits [B, V] and the LM head's input [B, H] of a padded prefill and two decode steps of 6
    prompts through the engine's own forward. The head's input is DirectForward.hidden (on a cache
    of its own) or, for transformers' forward, the final norm's output seen by a forward hook."""
    from transformers import DynamicCache

    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([1, 3, 5, 2, 5, 4])
    width = int(lengths.max())
    ids = torch.randint(3, 64, (6, width), generator=g)
    fed = torch.randint(3, 64, (3, 6, 1), generator=g)
    mask = torch.ones(6, width + 3, dtype=torch.long)
    mask[:, :width] = (torch.arange(width)[None] >= (width - lengths)[:, None]).long()
    pos = (mask[:, :width].cumsum(-1) - 1).clamp(min=0)
    seen: list[torch.Tensor] = []
    direct = isinstance(engine._forward, DirectForward)
    hook = None if direct else engine.model.model.norm.register_forward_hook(
        lambda mod, args, out: seen.append(out[:, -1]))
    caches = [DynamicCache(config=engine.config) for _ in range(2)]
    logits, hidden = [], []
    try:
        with torch.inference_mode():
            for t in range(3):
                logits.append(engine._forward(ids, mask[:, :width + t], pos, caches[0])[:, -1])
                if capture and direct:
                    hidden.append(engine._forward.hidden(ids, mask[:, :width + t], pos, caches[1])[:, -1])
                ids, pos = fed[t], pos[:, -1:] + 1
    finally:
        if hook is not None:
            hook.remove()
    return logits, hidden if direct else seen


@pytest.mark.parametrize("family", list(CONFIGS))
def test_logits_are_an_fp32_matmul_of_the_bf16_hidden_states(family: str) -> None:
    """With the flag the logits are float32 and equal hidden.to(fp32) @ weight.to(fp32).T (SGLang's
    _compute_lm_head) of the bf16 hidden states the unflagged engine's head reads, within the
    reordering bound of one H-long fp32 sum; without it they are the bf16 matmul of the same states.
    The two differ by about bf16's rounding of the logits: the flag changed what the engine computes."""
    flagged, plain = _engine(family, True), _engine(family, False)
    assert isinstance(flagged._forward, DirectForward) == (family == "qwen3_moe")
    logits, hidden = _steps(flagged, capture=True)
    logits_bf, hidden_bf = _steps(plain, capture=True)
    weight = flagged.model.lm_head.weight
    assert weight.dtype == torch.bfloat16 and torch.equal(weight, plain.model.lm_head.weight)
    H = weight.shape[1]
    for t, (z, h, z_bf, h_bf) in enumerate(zip(logits, hidden, logits_bf, hidden_bf, strict=True)):
        assert torch.equal(h, h_bf), f"step {t}: the flag changed the model's body"
        assert h.dtype == torch.bfloat16 and z.dtype == torch.float32 and z_bf.dtype == torch.bfloat16
        want = torch.matmul(h.to(torch.float32), weight.to(torch.float32).T)
        magnitude = (h.float().abs() @ weight.float().abs().T).max().item()  # sum|terms| of a logit
        assert (z - want).abs().max().item() <= reordered(H, 1, magnitude), f"step {t}"
        assert torch.equal(z_bf, torch.nn.functional.linear(h, weight)), f"step {t}"
        apart = (z - z_bf.float()).abs()
        assert apart.max() > 0 and apart.max() <= (U_BF16 * z.abs() + reordered(H, 1, magnitude)).max()
    assert max(z.abs().max().item() for z in logits) > 2.0, "weights too small for the rounding to show"


def test_the_flag_reaches_both_engines(tmp_path: Path) -> None:
    """rollout.fp32_lm_head adds --enable-fp32-lm-head once to the engines' arguments (SGLang's command
    line and the reference server's), also when server_args hold it already; nothing without it. The
    reference server started with those arguments answers as the flagged engine does, token for token
    and log-prob for log-prob, and not as the unflagged one."""
    job = JobConfig()
    job.model.dtype = "bfloat16"
    assert FP32_LM_HEAD_FLAG not in engine_server_args(job)
    job.rollout.fp32_lm_head = True
    assert engine_server_args(job) == [FP32_LM_HEAD_FLAG]
    job.rollout.server_args = [FP32_LM_HEAD_FLAG]
    assert engine_server_args(job) == [FP32_LM_HEAD_FLAG]
    job.rollout.server_args = []
    job.rollout.backend, job.resources.device = "sglang", "cuda"
    (tmp_path / "model_config.json").write_text("{}")
    assert sglang_command(job, tmp_path, "h", 1).count(FP32_LM_HEAD_FLAG) == 1

    cfg = CONFIGS["qwen3_moe"]
    prompts = [[5, 6, 7], [8], [9, 10]]
    params = [{"max_new_tokens": 6, "temperature": 1.0, "sampling_seed": i, "ignore_eos": True}
              for i in range(3)]
    want = ReferenceModel(cfg, dtype=torch.bfloat16, seed=0, fp32_lm_head=True).generate(prompts, params)
    other = ReferenceModel(cfg, dtype=torch.bfloat16, seed=0).generate(prompts, params)
    assert [w["output_logprobs"] for w in want] != [o["output_logprobs"] for o in other]
    args = engine_server_args(job)
    with reference_server(tmp_path / "engine.log", dtype="bfloat16", extra_args=args) as (_, c):
        got = c.generate(input_ids=prompts, sampling_params=params, return_logprob=True)
        assert c.server_info()["enable_fp32_lm_head"] is True  # SGLang's server_args field
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]
    assert [[lp[0] for lp in g["meta_info"]["output_token_logprobs"]] for g in got] == \
        [w["output_logprobs"] for w in want]
