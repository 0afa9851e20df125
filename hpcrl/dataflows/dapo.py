"""DAPO (arXiv 2503.14476): GRPO's group advantages with four changes. Dynamic sampling: groups whose
rewards are all equal (no signal) are dropped and the next prompts generated until the batch holds
data.num_prompts_per_step groups with signal (at most algorithm.max_generation_rounds rounds; the
prompt cursor moves on, so the next step starts after the last prompts used). Overlong reward
shaping: a soft penalty over the last algorithm.overlong_buffer_len tokens. Clip-higher: the `ppo`
loss clips to [1 - clip_eps, 1 + clip_eps_high]. Token-level loss: every token of the batch weighs
the same (algorithm.loss_agg: token-mean). No KL term."""

from __future__ import annotations

from itertools import accumulate

import torch

from hpcrl.algorithms.advantages import group_advantages
from hpcrl.algorithms.dapo import fill_groups, overlong_penalty
from hpcrl.controller.api import RL
from hpcrl.controller.groups import Rollout


def step(rl: RL, step: int) -> None:
    a, G = rl.algo, rl.algo.group_size
    rounds: list[tuple[Rollout, torch.Tensor]] = []

    def generate_round(_: int) -> torch.Tensor:
        rollout = rl.generate()
        rewards = torch.from_numpy(rl.score(rollout)).double()
        if a.overlong_buffer_len:
            lengths = torch.tensor([len(r) for r in rollout.response_ids])
            rewards = rewards + overlong_penalty(lengths, rl.job.rollout.max_new_tokens, a.overlong_buffer_len,
                                                 a.overlong_penalty_factor).double()
        rounds.append((rollout, rewards))
        return rewards.reshape(-1, G)

    fill = fill_groups(generate_round, rl.job.data.num_prompts_per_step, a.max_generation_rounds, on_short="pad")
    starts = list(accumulate((len(w) for _, w in rounds), initial=0))  # each round's first row
    rows = [starts[r] + g * G + i for r, g in fill.kept for i in range(G)]
    batch = Rollout.concat([rollout for rollout, _ in rounds]).select(rows)
    rewards = torch.cat([w for _, w in rounds])[rows]
    advantages = group_advantages(rewards, G, a.norm_adv_by_std)
    rl.log(**{"reward/mean": float(rewards.mean()), **{f"dynamic_sampling/{k}": v for k, v in fill.metrics().items()}})
    rl.update_policy(batch, advantages.float().numpy(), loss="ppo")
    rl.sync_weights()
