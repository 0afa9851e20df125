"""REINFORCE++ (arXiv 2501.03262): the KL to the reference is a per-token penalty in the reward
(algorithm.kl_estimator of the behaviour policy's log-probs against the reference's, k1 as in the
paper, times algorithm.kl_coef), the score sits on the last token, returns-to-go are whitened over
every token of the batch, and the clipped surrogate (`ppo` loss, no KL term) takes them as
token-level advantages."""

from __future__ import annotations

import torch

from hpcrl.algorithms.kl import kl_estimate
from hpcrl.algorithms.reinforce_pp import reinforce_pp_advantages
from hpcrl.controller.api import RL

DEFAULTS = {"clip_eps": 0.2, "kl_estimator": "k1", "loss_agg": "token-mean"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py): the paper's k1 KL in
the reward (OpenRLHF and verl let k2 / k3 replace it there too)."""


def step(rl: RL, step: int) -> None:
    rollout = rl.generate()
    rewards = torch.from_numpy(rl.score(rollout))
    mask_BT = torch.from_numpy(rollout.response_mask_BT())
    kl_BT = None
    if rl.algo.kl_coef > 0:
        ref_BT = torch.from_numpy(rl.ref_logprobs(rollout))
        behaviour_BT = torch.from_numpy(rollout.engine_logprobs_BT())
        kl_BT = kl_estimate(behaviour_BT, ref_BT, rl.algo.kl_estimator, mask_BT) * mask_BT  # per token
    advantages_BT, _ = reinforce_pp_advantages(rewards, mask_BT, kl_BT, rl.algo.kl_coef)
    rl.update_policy(rollout, advantages_BT.float().numpy(), loss="ppo")
    rl.sync_weights()
