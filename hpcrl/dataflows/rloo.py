"""RLOO ("Back to Basics", arXiv 2402.14740): each completion's baseline is the mean reward of the
other G - 1 completions of its prompt; the same clipped loss as GRPO (with its KL term when
algorithm.kl_coef > 0)."""

from __future__ import annotations

import torch

from hpcrl.algorithms.advantages import rloo_advantages
from hpcrl.controller.api import RL

DEFAULTS = {"clip_eps": 0.2, "kl_estimator": "k3", "loss_agg": "token-mean"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py): GRPO's, as verl's."""


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = rl.score(rollout)
    advantages = rloo_advantages(torch.from_numpy(rewards), rl.algo.group_size)
    ref = rl.ref_logprobs(rollout) if rl.algo.kl_coef > 0 else None
    rl.update_policy(rollout, advantages.numpy(), loss="grpo", ref_logprobs=ref)
    rl.sync_weights()
