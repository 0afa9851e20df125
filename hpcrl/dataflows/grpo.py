"""GRPO (DeepSeekMath, arXiv 2402.03300): for each prompt, G completions; advantages are the rewards
normalised within the group (without the std: algorithm.norm_adv_by_std false); one on-policy step
of the clipped surrogate with a KL penalty to the reference policy (algorithm.kl_coef)."""

from __future__ import annotations

import torch

from hpcrl.algorithms.advantages import group_advantages
from hpcrl.controller.api import RL

DEFAULTS = {"clip_eps": 0.2, "kl_estimator": "k3", "loss_agg": "token-mean"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py): PPO's clip range,
the low-variance KL estimator, and every token of the batch weighing the same (verl's and TRL's
default; the paper's 1/|y_i| is loss_agg: seq-mean-token-mean)."""


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = rl.score(rollout)
    advantages = group_advantages(torch.from_numpy(rewards), rl.algo.group_size, rl.algo.norm_adv_by_std)
    ref = rl.ref_logprobs(rollout) if rl.algo.kl_coef > 0 else None
    rl.update_policy(rollout, advantages.numpy(), loss="grpo", ref_logprobs=ref)
    rl.sync_weights()
