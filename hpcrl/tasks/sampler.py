"""A stateless, resumable prompt sampler over a synthetic task or a data file.

The prompts of step s are a pure function of (seed, s): synthetic tasks seed a Generator with
[seed, s]; files are walked in a per-epoch order, `default_rng([seed, epoch]).permutation(n)`, so
resuming at step s needs only s. Draw k of a file is position k % n of epoch k // n. Under
`overlong_prompts: drop`, a drawn row over the prompt limit is replaced by the next row of the same
epoch's order (still a pure function of seed and k); `dropped(step)` counts the skips of a step.
Under `error`, the row's ValueError (naming file, row and fix) stops the run.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from hpcrl.tasks.examples import Example, ExampleFile, OverlongPrompt, PromptFormat, read_examples
from hpcrl.tasks.files import DataError
from hpcrl.tasks.synthetic import TASKS, Task
from hpcrl.tasks.tokenizer import Tokenizer, default_tokenizer

if TYPE_CHECKING:
    from hpcrl.config.schema import JobConfig

__all__ = ["PromptSampler", "build_sampler", "make_sampler", "open_examples", "prompt_format",
           "read_examples"]


class PromptSampler:
    """`batch(step)` -> the `num_per_step` encoded examples of that step, a function of (seed, step)."""

    def __init__(self, num_per_step: int, seed: int, task: Task | None = None,
                 examples: ExampleFile | None = None, drop_overlong: bool = False,
                 tokenizer: Tokenizer | None = None) -> None:
        assert (task is None) != (examples is None), "exactly one of task / examples"
        self.num_per_step = num_per_step
        self.seed = seed
        self.task = task
        self.examples = examples
        self.drop_overlong = drop_overlong
        self.tokenizer = tokenizer or (examples.fmt.tokenizer if examples else default_tokenizer())
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its permutation): one epoch cached
        self._dropped: dict[int, list[int]] = {}  # step -> rows skipped as overlong (recent steps only)

    def batch(self, step: int) -> list[Example]:
        if self.task is not None:
            rng = np.random.default_rng([self.seed, step])
            out = []
            for _ in range(self.num_per_step):
                prompt, answer = self.task.make(rng)
                out.append(Example(prompt, answer, prompt_ids=tuple(self.tokenizer.encode_prompt(prompt))))
            return out
        skipped: list[int] = []
        first = step * self.num_per_step
        out = [self._draw(k, skipped) for k in range(first, first + self.num_per_step)]
        self._dropped[step] = skipped
        for old in [s for s in self._dropped if s < step - 8]:
            del self._dropped[old]
        return out

    def dropped(self, step: int) -> list[int]:
        """0-based rows skipped as overlong while drawing `step` (after `batch(step)`; [] otherwise)."""
        return self._dropped.get(step, [])

    def _permutation(self, epoch: int) -> np.ndarray:
        assert self.examples is not None
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(len(self.examples)))
        return self._order[1]

    def _draw(self, k: int, skipped: list[int]) -> Example:
        assert self.examples is not None
        n = len(self.examples)
        epoch, pos = divmod(k, n)
        order = self._permutation(epoch)
        for shift in range(n):
            row = int(order[(pos + shift) % n])
            try:
                return self.examples[row]
            except OverlongPrompt:
                if not self.drop_overlong:
                    raise
                skipped.append(row)
        raise DataError(f"{self.examples.key}={str(self.examples.path)!r}: every row is over "
                        f"{self.examples.fmt.limit_reason}; nothing is left to train on under "
                        "data.overlong_prompts: drop; raise data.max_prompt_tokens")


def make_sampler(task: str | None, path: str | None, prompt_key: str, answer_key: str,
                 num_per_step: int, seed: int, fmt: PromptFormat | None = None,
                 drop_overlong: bool = False) -> PromptSampler:
    """A sampler over `path` (read lazily through `fmt`, default: the character tokenizer and no
    limit) or over the synthetic `task`."""
    if path:
        fmt = fmt or PromptFormat(prompt_key=prompt_key, answer_key=answer_key)
        return PromptSampler(num_per_step, seed, examples=ExampleFile(Path(path), fmt),
                             drop_overlong=drop_overlong)
    assert task in TASKS, task
    return PromptSampler(num_per_step, seed, task=TASKS[task], tokenizer=fmt.tokenizer if fmt else None)


def prompt_format(job: JobConfig, tokenizer: Tokenizer, max_prompt_tokens: int = 0,
                  limit_reason: str = "") -> PromptFormat:
    """The job's PromptFormat; `max_prompt_tokens` (0: none) is the effective limit, which the caller
    derives from data.max_prompt_tokens and the model's context (hpcrl.config.validate.prompt_limit)."""
    d = job.data
    return PromptFormat(tokenizer, d.prompt_key, d.answer_key, d.apply_chat_template,
                        dict(d.chat_template_kwargs), max_prompt_tokens,
                        limit_reason or f"data.max_prompt_tokens={max_prompt_tokens}")


def open_examples(job: JobConfig, fmt: PromptFormat, key: str = "data.path") -> ExampleFile:
    """The examples of `data.path` or `data.val_path` (`key`), in file order: `len()` and `[i]`."""
    path = job.data.val_path if key == "data.val_path" else job.data.path
    assert path, f"{key} is not set"
    return ExampleFile(Path(job.base_dir, path), fmt, key)


def build_sampler(job: JobConfig, fmt: PromptFormat) -> PromptSampler:
    """The training prompt sampler of `job`: over data.path when set, else data.task."""
    d = job.data
    if d.path:
        return PromptSampler(d.num_prompts_per_step, d.seed, examples=open_examples(job, fmt),
                             drop_overlong=d.overlong_prompts == "drop")
    return make_sampler(d.task, None, d.prompt_key, d.answer_key, d.num_prompts_per_step, d.seed, fmt)
