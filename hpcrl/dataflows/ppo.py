"""PPO with a critic (Schulman et al. 2017, arXiv 1707.06347; for language models Ouyang et al. 2022,
arXiv 2203.02155): the score sits on the last token and the KL to the reference is a per-token
penalty in the reward (algorithm.kl_estimator, k1 by default, coefficient algorithm.kl_coef: fixed,
or adapted towards algorithm.kl_target as in Ziegler et al. 2019); the critic's values give GAE
advantages (gamma, lam), whitened over the batch, for the clipped surrogate, and returns for the
critic's clipped value loss.
The first critic.warmup_steps steps train only the critic."""

from __future__ import annotations

import torch

from hpcrl.algorithms.aggregation import masked_mean, whiten
from hpcrl.algorithms.gae import gae_advantages
from hpcrl.algorithms.kl import adaptive_kl_coef, kl_estimate
from hpcrl.algorithms.reinforce_pp import token_rewards
from hpcrl.algorithms.value import explained_variance
from hpcrl.controller.api import RL

DEFAULTS = {"clip_eps": 0.2, "kl_estimator": "k1", "loss_agg": "token-mean"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py): k1 in the reward, as
Ziegler et al. and verl's kl_penalty default."""


def step(rl: RL, step: int) -> None:
    a = rl.algo
    rollout = rl.generate()
    scores_B = torch.from_numpy(rl.score(rollout))
    mask_BT = torch.from_numpy(rollout.response_mask_BT())
    kl_BT, beta = None, rl.state.get("kl_coef", a.kl_coef)
    if a.kl_coef > 0:
        ref_BT = torch.from_numpy(rl.ref_logprobs(rollout))
        behaviour_BT = torch.from_numpy(rollout.engine_logprobs_BT())
        kl_BT = kl_estimate(behaviour_BT, ref_BT, a.kl_estimator, mask_BT) * mask_BT  # per token
    values_BT = torch.from_numpy(rl.values(rollout))
    rewards_BT = token_rewards(scores_B, mask_BT, kl_BT, beta)
    advantages_BT, returns_BT = gae_advantages(rewards_BT, values_BT, mask_BT, a.gamma, a.lam)
    rl.log(**{"critic/explained_variance": float(explained_variance(values_BT, returns_BT, mask_BT)),
              "critic/returns_mean": float(masked_mean(returns_BT, mask_BT))})
    rl.update_critic(rollout, returns_BT.numpy(), values_BT.numpy())
    if step >= rl.job.critic.warmup_steps:
        rl.update_policy(rollout, whiten(advantages_BT, mask_BT).float().numpy(), loss="ppo")
        rl.sync_weights()
    if kl_BT is not None:
        kl = float(kl_BT.sum(dim=1).mean())  # per sequence, the controller's unit
        if a.kl_target > 0:
            rl.state["kl_coef"] = adaptive_kl_coef(beta, kl, a.kl_target, a.kl_horizon, len(scores_B))
        rl.log(**{"train/kl_coef": beta, "train/kl_per_seq": kl})
