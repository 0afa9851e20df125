"""Built-in verifiable rewards. Every reward has the signature of `hpcrl.rewards.RewardFn`:

    def reward(prompt: str, completion: str, answer: str, extra: dict | None = None) -> float  # in [0, 1]
"""

from __future__ import annotations

from typing import Any

from hpcrl.rewards.math_answer import math_answer


def exact_match(prompt: str, completion: str, answer: str, extra: dict[str, Any] | None = None) -> float:
    """1.0 when the completion (surrounding whitespace ignored) equals the answer, else 0.0."""
    return float(completion.strip() == answer.strip())


def token_match(prompt: str, completion: str, answer: str, extra: dict[str, Any] | None = None) -> float:
    """Fraction of answer characters reproduced at the right position.

    Divided by max(len(answer), len(completion)), so extra characters cost as much as missing ones.
    """
    if not answer and not completion:
        return 1.0
    hits = sum(1 for a, c in zip(answer, completion) if a == c)
    return hits / max(len(answer), len(completion))


BUILTIN_REWARDS = {"exact_match": exact_match, "math": math_answer, "token_match": token_match}
