"""GSPO (arXiv 2507.18071): group-normalised advantages as GRPO, but the importance ratio is the
sequence's length-normalised likelihood ratio, clipped per sequence (`gspo` loss) to the paper's
[1 - 3e-4, 1 + 4e-4] unless algorithm.clip_eps / clip_eps_high say otherwise. No KL term."""

from __future__ import annotations

import torch

from hpcrl.algorithms.advantages import group_advantages
from hpcrl.controller.api import RL

DEFAULTS = {"clip_eps": 3e-4, "clip_eps_high": 4e-4, "loss_agg": "seq-mean-token-mean"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py): the paper's clip
range (section 5.1; s_i averages log-ratios, so it sits far closer to 1 than a token ratio) and its
sequence-level objective."""
FIXED = ("loss_agg",)
"""GSPO's objective weighs each sequence equally (the `gspo` loss always aggregates so, as verl's)."""


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = rl.score(rollout)
    advantages = group_advantages(torch.from_numpy(rewards), rl.algo.group_size, rl.algo.norm_adv_by_std)
    rl.update_policy(rollout, advantages.numpy(), loss="gspo")
    rl.sync_weights()
