"""Resolve `reward.fn` (a built-in name or `package.module:function`) to a checked callable."""

from __future__ import annotations

import importlib
import inspect

from hpcrl.rewards.builtin import BUILTIN_REWARDS
from hpcrl.rewards.protocol import RewardFn

SIGNATURE = "def reward(prompt: str, completion: str, answer: str) -> float"


def load_reward_fn(spec: str) -> RewardFn:
    """Return the reward callable named by `spec`; ValueError with the fix when it cannot be used."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    builtins = ", ".join(sorted(BUILTIN_REWARDS))
    if ":" not in spec:
        raise ValueError(f"reward.fn={spec!r} is neither a built-in reward ({builtins}) nor an import path "
                         f"'package.module:function' of a function `{SIGNATURE}`")
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"reward.fn={spec!r}: cannot import module {module_name!r} ({exc}); "
                         f"put it on PYTHONPATH or use a built-in reward ({builtins})") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.fn={spec!r}: module {module_name!r} has no function {attr!r}")
    try:
        inspect.signature(fn).bind("prompt", "completion", "answer")
    except TypeError:
        raise ValueError(f"reward.fn={spec!r}: {attr}{inspect.signature(fn)} cannot be called as "
                         f"`{SIGNATURE}`") from None
    return fn
