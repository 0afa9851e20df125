"""Prompt sources and a stateless, resumable prompt sampler.

The prompts of step s are a pure function of (seed, s): synthetic tasks seed a Generator with
[seed, s]; files are walked in a per-epoch shuffled order. So resuming at step s needs only s.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hpcrl.tasks.synthetic import TASKS, Task


@dataclass(frozen=True)
class Example:
    prompt: str
    answer: str


def read_examples(path: Path, prompt_key: str, answer_key: str) -> list[Example]:
    """All (prompt, answer) rows of a .jsonl or .parquet file; ValueError naming the row on bad data."""
    if path.suffix == ".jsonl":
        rows = []
        for n, line in enumerate(path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"data.path={str(path)!r}: line {n} is not JSON ({exc.msg})") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"data.path={str(path)!r}: reading parquet needs pyarrow "
                             "(pip install pyarrow), or convert the file to .jsonl") from None
        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"data.path={str(path)!r}: unsupported file type {path.suffix!r}; use .jsonl or .parquet")
    examples = []
    for i, row in enumerate(rows, start=1):
        if not isinstance(row, dict) or prompt_key not in row or answer_key not in row:
            raise ValueError(f"data.path={str(path)!r}: row {i} lacks {prompt_key!r} or {answer_key!r} "
                             f"(set data.prompt_key / data.answer_key to the file's column names)")
        examples.append(Example(str(row[prompt_key]), str(row[answer_key])))
    if not examples:
        raise ValueError(f"data.path={str(path)!r}: the file has no rows")
    return examples


class PromptSampler:
    """`batch(step)` -> the `num_per_step` examples of that step, deterministic in (seed, step)."""

    def __init__(self, num_per_step: int, seed: int, task: Task | None = None,
                 examples: list[Example] | None = None) -> None:
        assert (task is None) != (examples is None), "exactly one of task / examples"
        self.num_per_step = num_per_step
        self.seed = seed
        self.task = task
        self.examples = examples

    def batch(self, step: int) -> list[Example]:
        if self.task is not None:
            rng = np.random.default_rng([self.seed, step])
            return [Example(*self.task.make(rng)) for _ in range(self.num_per_step)]
        assert self.examples is not None
        n = len(self.examples)
        out = []
        for k in range(step * self.num_per_step, (step + 1) * self.num_per_step):
            epoch, pos = divmod(k, n)
            order = np.random.default_rng([self.seed, epoch]).permutation(n)
            out.append(self.examples[int(order[pos])])
        return out


def make_sampler(task: str | None, path: str | None, prompt_key: str, answer_key: str,
                 num_per_step: int, seed: int) -> PromptSampler:
    if path:
        return PromptSampler(num_per_step, seed, examples=read_examples(Path(path), prompt_key, answer_key))
    assert task in TASKS, task
    return PromptSampler(num_per_step, seed, task=TASKS[task])
