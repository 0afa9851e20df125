"""DAPO (arXiv 2503.14476): GRPO's group advantages with four changes. Dynamic sampling: groups whose
task rewards are all equal (all right or all wrong: no signal) are dropped and the next prompts
generated until the batch holds data.num_prompts_per_step groups with signal (at most
algorithm.max_generation_rounds rounds; the prompt cursor moves on, so the next step starts after
the last prompts used). Overlong reward shaping: a soft penalty over the last
algorithm.overlong_buffer_len tokens, added to the reward after the filter (which tests
correctness), before the advantages. Clip-higher: the `ppo` loss clips to [1 - clip_eps,
1 + clip_eps_high], 0.2 and 0.28 unless set. Token-level loss: every token of the batch weighs the
same (algorithm.loss_agg: token-mean). No KL term."""

from __future__ import annotations

import torch

from hpcrl.algorithms.dapo import dynamic_sampling_batch
from hpcrl.controller.api import RL
from hpcrl.controller.groups import Rollout

DEFAULTS = {"clip_eps": 0.2, "clip_eps_high": 0.28, "loss_agg": "token-mean"}
"""The values of the algorithm.* keys left unset (hpcrl/dataflows/_declared.py): the paper's
eps_low / eps_high (section 3.1) and its token-level loss (section 3.3)."""


def step(rl: RL, step: int) -> None:
    a = rl.algo
    rounds: list[Rollout] = []

    def generate_round(_: int) -> tuple[torch.Tensor, torch.Tensor]:
        rollout = rl.generate()
        rounds.append(rollout)
        lengths = torch.tensor([len(r) for r in rollout.response_ids])
        return torch.from_numpy(rl.score(rollout)), lengths

    batch = dynamic_sampling_batch(generate_round, a.group_size, rl.job.data.num_prompts_per_step,
                                   a.max_generation_rounds, rl.job.rollout.max_new_tokens,
                                   a.overlong_buffer_len, a.overlong_penalty_factor, a.norm_adv_by_std)
    shaping = {"reward/overlong_penalty_mean": float((batch.shaped - batch.rewards).mean())} \
        if a.overlong_buffer_len else {}
    # the kept groups' rewards (rl.score logged every round's: reward/errors stays theirs)
    rl.log(**{"reward/mean": float(batch.rewards.mean()), "reward/std": float(batch.rewards.std(correction=0)),
              **shaping,
              **{f"dynamic_sampling/{k}": v for k, v in batch.fill.metrics().items()}})
    rl.update_policy(Rollout.concat(rounds).select(batch.rows), batch.advantages.float().numpy(), loss="ppo")
    rl.sync_weights()
