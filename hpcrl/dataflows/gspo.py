"""GSPO (arXiv 2507.18071): group-normalised advantages as GRPO, but the importance ratio is the
sequence's length-normalised likelihood ratio, clipped per sequence (`gspo` loss; the paper clips to
[1 - 3e-4, 1 + 4e-4]: algorithm.clip_eps and clip_eps_high)."""

from __future__ import annotations

import torch

from hpcrl.algorithms.advantages import group_advantages
from hpcrl.controller.api import RL


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = rl.score(rollout)
    advantages = group_advantages(torch.from_numpy(rewards), rl.algo.group_size, rl.algo.norm_adv_by_std)
    rl.update_policy(rollout, advantages.numpy(), loss="gspo")
    rl.sync_weights()
