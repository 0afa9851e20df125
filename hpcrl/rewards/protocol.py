"""The reward hook's contract."""

from __future__ import annotations

from typing import Protocol


class RewardFn(Protocol):
    """A verifiable reward: score one completion of one prompt against its reference answer.

    Called on the controller rank once per completion; must be deterministic, return a float
    (conventionally in [0, 1]) and not raise for malformed completions (score them 0 instead).
    """

    def __call__(self, prompt: str, completion: str, answer: str) -> float: ...
