"""Dr. GRPO ("Understanding R1-Zero-Like Training", arXiv 2503.20783): GRPO without its two biases:
advantages are group-centred rewards (no division by the std), and the loss sums each completion's
tokens and divides by a constant (`seq-mean-token-sum-norm` with algorithm.loss_agg_norm, default
rollout.max_new_tokens) instead of by the completion's length."""

from __future__ import annotations

import torch

from hpcrl.algorithms.advantages import dr_grpo_advantages
from hpcrl.controller.api import RL

DEFAULTS = {"clip_eps": 0.2, "kl_estimator": "k3", "loss_agg": "seq-mean-token-sum-norm"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py)."""
FIXED = ("loss_agg",)
"""The aggregation is what makes it Dr. GRPO (the `dr_grpo` loss always uses it)."""


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = rl.score(rollout)
    advantages = dr_grpo_advantages(torch.from_numpy(rewards), rl.algo.group_size)
    ref = rl.ref_logprobs(rollout) if rl.algo.kl_coef > 0 else None
    rl.update_policy(rollout, advantages.numpy(), loss="dr_grpo", ref_logprobs=ref)
    rl.sync_weights()
