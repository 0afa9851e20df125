"""PPO's critic on one rank, in process (tests/megatron/test_policy_layouts.py checks it against HF
and across layouts from the policy's weights): `critic.path` starts its body from a HF directory."""

from __future__ import annotations

import pytest
import torch
from numerics import forward_depth, longest_reduction, reordered
from test_policy_single_rank import hf_forward, make_policy, qwen_config, random_batch, world1  # noqa: F401

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def hf_values(model: torch.nn.Module, batch, weight: torch.Tensor, bias: float | torch.Tensor
              ) -> tuple[torch.Tensor, float]:
    """The values HF's final hidden states give under the head (weight, bias), 0 on padding, and how
    far the critic's may lie from them: Megatron and HF sum in other orders, L layers of 7 reductions
    and the head's H-long sum (n = the config's longest reduction), magnitude max|value|; every token
    routed alike (hf_forward checks that no router near-tie lies within the bound)."""
    hf_forward(model, batch)
    with torch.no_grad():
        hidden = model(batch.tokens_BL, output_hidden_states=True).hidden_states[-1]
    pos, mask = batch.logit_positions_BT(), batch.response_mask_BT()
    at_pos = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    values = torch.where(mask, at_pos @ weight + bias, 0.0)
    cfg = model.config.to_dict()
    n = longest_reduction(cfg, batch.seq_len)
    return values, reordered(n, forward_depth(cfg["num_hidden_layers"]), values.abs().max().item())


def test_critic_from_its_own_directory(world1, tmp_path) -> None:  # noqa: F811
    """critic.path: the body reads a HF directory of the policy's architecture (not the policy's
    weights): its values are HF's final hidden states of that directory's model times the head."""
    from hf_fixtures import model_dir
    from transformers import AutoModelForCausalLM

    from hpcrl.config.schema import AlgorithmConfig, CriticConfig
    from hpcrl.trainer.critic import MegatronCritic

    cfg = qwen_config()
    critic_dir = model_dir(tmp_path / "critic", config=cfg, seed=11, tokenizer=False)
    policy = make_policy(cfg)
    policy.init_from_seed(0)
    critic = MegatronCritic(policy, CriticConfig(path=str(critic_dir)), AlgorithmConfig())
    batch = random_batch(64, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(critic_dir), dtype=torch.float32).eval()
    head = critic.head()
    expected, bound = hf_values(hf, batch, head.weight.detach(), head.bias.detach())
    got = critic.values(batch)
    assert (got - expected).abs().max().item() <= bound
    from_policy = MegatronCritic(policy, CriticConfig(), AlgorithmConfig()).values(batch)
    # the directory, not the policy, started the body: another model, far outside the bound
    assert (from_policy - got).abs().max().item() > 100 * bound


def test_critic_from_a_reward_model_starts_its_head_from_the_score(world1, tmp_path) -> None:  # noqa: F811
    """critic.path of a one-label reward model (score.weight instead of lm_head): the body is the
    reward model's, the value head its score head (bias 0: Qwen3's has none)."""
    from hf_fixtures import model_dir, reward_model_dir
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hpcrl.config.schema import AlgorithmConfig, CriticConfig
    from hpcrl.trainer.critic import MegatronCritic

    cfg = qwen_config()
    body_dir = model_dir(tmp_path / "body", config=cfg, seed=11, tokenizer=False)
    rm_dir = reward_model_dir(body_dir, tmp_path / "rm", seed=4)
    score = load_file(str(rm_dir / "model.safetensors"))["score.weight"][0]
    policy = make_policy(cfg)
    policy.init_from_seed(0)
    critic = MegatronCritic(policy, CriticConfig(path=str(rm_dir)), AlgorithmConfig())
    head = critic.head()
    assert torch.equal(head.weight.detach(), score) and head.bias.item() == 0.0
    batch = random_batch(64, seed=3)
    hf = AutoModelForCausalLM.from_pretrained(str(body_dir), dtype=torch.float32).eval()
    expected, bound = hf_values(hf, batch, score, 0.0)
    assert (critic.values(batch) - expected).abs().max().item() <= bound
