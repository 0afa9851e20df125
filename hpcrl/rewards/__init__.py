"""Rewards: built-ins and user functions loaded by import path (`reward.fn` in the job file), scored
in a pool of worker processes with a per-completion deadline."""

from hpcrl.rewards.builtin import BUILTIN_REWARDS
from hpcrl.rewards.loader import SIGNATURE, load_reward_fn
from hpcrl.rewards.pool import RewardPool, RewardPoolError, Scores
from hpcrl.rewards.protocol import RewardFn

__all__ = ["BUILTIN_REWARDS", "SIGNATURE", "RewardFn", "RewardPool", "RewardPoolError", "Scores",
           "load_reward_fn"]
