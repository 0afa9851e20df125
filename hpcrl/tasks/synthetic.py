"""Built-in synthetic tasks with verifiable answers (character-level, see tokenizer.py).

Each task draws (prompt, answer) pairs from a seeded numpy Generator. Every task makes the policy
read the prompt: the answer is a function of the prompt and prompts are uniform over at least 8
cases, so a prompt-independent completion scores at most 1/8 = 0.125 under `token_match`.

| name    | prompt  | answer | what it needs                                        |
|---------|---------|--------|------------------------------------------------------|
| copy    | `c`     | `cccc` | read the prompt letter (one of 8), repeat it         |
| reverse | `abc>`  | `cba`  | attend to three positions in reverse order           |
| add     | `3+4=`  | `7`    | single-digit addition modulo 10 (hard from scratch)  |
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

LETTERS = "abcdefgh"


@dataclass(frozen=True)
class Task:
    name: str
    make: Callable[[np.random.Generator], tuple[str, str]]
    """Draws one (prompt, answer) pair."""
    answer_len: int
    """Length of every answer in characters (the natural `rollout.max_new_tokens`)."""


def _copy(rng: np.random.Generator) -> tuple[str, str]:
    c = LETTERS[rng.integers(len(LETTERS))]
    return c, c * 4


def _reverse(rng: np.random.Generator) -> tuple[str, str]:
    s = "".join(LETTERS[i] for i in rng.integers(len(LETTERS), size=3))
    return f"{s}>", s[::-1]


def _add(rng: np.random.Generator) -> tuple[str, str]:
    a, b = (int(x) for x in rng.integers(10, size=2))
    return f"{a}+{b}=", str((a + b) % 10)


TASKS: dict[str, Task] = {
    "copy": Task("copy", _copy, 4),
    "reverse": Task("reverse", _reverse, 3),
    "add": Task("add", _add, 1),
}
