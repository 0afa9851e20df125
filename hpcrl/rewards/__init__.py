"""Rewards: built-ins and user functions loaded by import path (`reward.fn` in the job file)."""

from hpcrl.rewards.builtin import BUILTIN_REWARDS
from hpcrl.rewards.loader import SIGNATURE, load_reward_fn
from hpcrl.rewards.protocol import RewardFn

__all__ = ["BUILTIN_REWARDS", "SIGNATURE", "RewardFn", "load_reward_fn"]
