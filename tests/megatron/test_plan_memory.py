"""`hpcrl plan`'s trainer memory is what a real MegatronPolicy holds: for the tiny presets
(tiny-qwen3-moe; tiny-deepseek-v3 with MLA, a dense first layer, shared experts, the frozen expert
bias and an MTP layer in its config) on one CPU rank, the plan's per-rank param, grad, optimizer and
reference bytes equal the bytes of the policy's weights (its parameters plus DeepSeek-V3's fp32
expert-bias buffers, hpcrl.trainer.model.weight_tensors), its DDP grad buffers, its Adam state after
one step and its frozen reference model, with and without algorithm.kl_coef; the same for PPO's
critic. One policy (with a reference model) serves both plans; the one-rank world is
test_policy_single_rank's fixture. (Four ranks in other layouts, bf16 with the distributed
optimizer included: tests/megatron/test_load_memory.py.)"""

from __future__ import annotations

from collections.abc import Iterable

import pytest
import torch
from test_policy_single_rank import make_policy, random_batch, world1  # noqa: F401 (fixture)

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]
PRESETS = ["tiny-qwen3-moe", "tiny-deepseek-v3"]


def nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes(module: torch.nn.Module) -> int:
    """The module's parameters plus its routers' frozen fp32 expert-bias buffers (DeepSeek-V3)."""
    from hpcrl.trainer.model import weight_tensors

    return nbytes(weight_tensors(module).values())


def preset_config(preset: str) -> dict:
    from hpcrl.models.presets import load_hf_config

    return load_hf_config(preset, None)


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_trainer_memory_equals_what_the_policy_holds(world1, preset: str) -> None:  # noqa: F811
    from hpcrl.config import job_from_dict
    from hpcrl.plan_cmd import plan_job

    policy = make_policy(preset_config(preset), kl_coef=0.1)
    policy.init_from_seed(0)
    batch = random_batch(64, seed=5)
    policy.train_step(batch, torch.linspace(-1, 1, 8), policy.compute_logprobs(batch),
                      policy.compute_logprobs(batch, "ref"))
    buffers = [*policy.ddp.buffers, *policy.ddp.expert_parallel_buffers]
    assert all(b.param_data is None for b in buffers)  # fp32 params stay where they are (no DDP param buffer)
    optimizers = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    # Adam's per-tensor `step` scalars (4 bytes each) are left out of the plan's model, and here.
    states = [v for o in optimizers for st in o.optimizer.state.values() for k, v in st.items()
              if k != "step"]
    assert {str(v.dtype) for v in states} == {"torch.float32"}
    assert len(states) == 2 * len(list(policy.gpt.parameters()))  # exp_avg and exp_avg_sq of every param
    held = {"params": weight_bytes(policy.gpt), "grads": nbytes(b.grad_data for b in buffers),
            "optimizer": nbytes(states), "reference": weight_bytes(policy.ref)}
    assert min(held.values()) > 0
    for kl_coef in (0.0, 0.1):
        job = job_from_dict({"model": {"preset": preset}, "algorithm": {"kl_coef": kl_coef}})
        t = plan_job(job)["trainer"]
        assert t["build"]["param_dtype"] == "float32" and t["build"]["built_by_run_today"]
        planned = {"params": t["params_bytes_per_gpu"], "grads": t["grads_bytes_per_gpu"],
                   "optimizer": t["optimizer_bytes_per_gpu"], "reference": t["reference_bytes_per_gpu"]}
        assert planned == {**held, "reference": held["reference"] if kl_coef > 0 else 0}, kl_coef
        assert t["total_bytes_per_gpu"] == sum(planned.values()) + t["activations_bytes_per_gpu"]  # the step's


@pytest.mark.parametrize("preset", PRESETS)
def test_plan_counts_the_critic_it_builds(world1, preset: str) -> None:  # noqa: F811
    """A ppo job's plan adds the critic's params, grads and Adam state: what a real MegatronCritic on
    the tiny preset holds after one step (the body without lm_head, plus the value head)."""
    from hpcrl.config import job_from_dict
    from hpcrl.config.schema import AlgorithmConfig, CriticConfig
    from hpcrl.plan_cmd import plan_job
    from hpcrl.trainer.critic import MegatronCritic

    policy = make_policy(preset_config(preset))
    policy.init_from_seed(0)
    critic = MegatronCritic(policy, CriticConfig(lr=1e-3), AlgorithmConfig())
    batch = random_batch(64, seed=5)
    values = critic.values(batch)
    critic.train_step(batch, values + 1.0, values)
    buffers = [*critic.ddp.buffers, *critic.ddp.expert_parallel_buffers]
    optimizers = getattr(critic.optimizer, "chained_optimizers", [critic.optimizer])
    states = [v for o in optimizers for st in o.optimizer.state.values() for k, v in st.items()
              if k != "step"]
    assert len(states) == 2 * len(list(critic.gpt.parameters()))
    held = weight_bytes(critic.gpt) + nbytes(b.grad_data for b in buffers) + nbytes(states)
    ppo = plan_job(job_from_dict({"model": {"preset": preset}, "algorithm": {"name": "ppo"}}))["trainer"]
    grpo = plan_job(job_from_dict({"model": {"preset": preset}}))["trainer"]
    assert ppo["critic_bytes_per_gpu"] == held and grpo["critic_bytes_per_gpu"] == 0
    assert ppo["total_bytes_per_gpu"] == grpo["total_bytes_per_gpu"] + held
    assert "critic" in ppo["build"]["description"]
