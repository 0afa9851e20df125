"""REINFORCE++ (arXiv 2501.03262): the KL to the reference is a per-token penalty in the reward
(k1 of the behaviour policy's log-probs against the reference's, times algorithm.kl_coef), the score
sits on the last token, returns-to-go are whitened over every token of the batch, and the clipped
surrogate (`ppo` loss, no KL term) takes them as token-level advantages."""

from __future__ import annotations

import torch

from hpcrl.algorithms.reinforce_pp import reinforce_pp_advantages
from hpcrl.controller.api import RL


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = torch.from_numpy(rl.score(rollout))
    mask_BT = torch.from_numpy(rollout.response_mask_BT())
    kl_BT = None
    if rl.algo.kl_coef > 0:
        ref_BT = torch.from_numpy(rl.ref_logprobs(rollout))
        kl_BT = (torch.from_numpy(rollout.engine_logprobs_BT()) - ref_BT) * mask_BT  # k1, per token
    advantages_BT, _ = reinforce_pp_advantages(rewards, mask_BT, kl_BT, rl.algo.kl_coef)
    rl.update_policy(rollout, advantages_BT.float().numpy(), loss="ppo")
    rl.sync_weights()
