"""Evaluation on held-out prompts, as verl users run it (`data.val_path`, `eval.*` in the job file).

Every `eval.interval_steps` steps, and after the last step, the engines (holding the policy just
synced after that step's update) generate `eval.num_samples` completions of each held-out prompt at
`eval.temperature` (0: greedy), the run's reward scores them (same pool, same deadline), and the
step's metrics record gets:

    val/reward_mean     mean reward over every held-out completion
    val/pass@k          k = eval.num_samples; mean over prompts of the unbiased estimator
                        1 - C(n-c, k) / C(n, k) (Chen et al. 2021) with n = k samples and c of them
                        correct (reward >= 1.0): with n = k it is 1 when any sample is correct
    val/reward_errors   held-out completions whose reward raised or timed out (scored 0)
    val/response_len    mean completion length in tokens
    val/<data_source>/reward_mean, val/<data_source>/pass@k
                        the same over one data source's prompts, when the held-out rows name more
                        than one (verl's `data_source` column; a row without it is "unknown")
    timing/eval_s       wall time of the evaluation (the session's: with the wait for an
                        asynchronous run's weight push it collects first)

`eval.before_train` also evaluates the initial policy (after the initial weight push), logged as a
record of its own at step -1 (verl's val_before_train, at its global step 0).

Evaluation does not change training: its sampling seeds are a separate namespace
(`eval_sampling_seed`: the same seeds at every evaluation, so successive evaluations differ only by
the policy), the engines draw each request's random numbers from its own seed, nothing else is
sampled, and the trainer is not involved. A resumed run evaluates at the same steps and gets the
same numbers. The session keeps the last evaluation (step and metrics) in the checkpoint metadata.
"""

from __future__ import annotations

import math
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np

from hpcrl.config.schema import JobConfig
from hpcrl.controller.groups import Rollout, RolloutGroup
from hpcrl.rewards.pool import Scores
from hpcrl.tasks import Example, ExampleFile, OverlongPrompt

CORRECT_AT = 1.0
"""A completion is correct for pass@k when its reward is at least this."""


def eval_sampling_seed(seed: int, index: int) -> int:
    """Sampling seed of held-out completion `index`: namespace "eval", apart from training's
    `sampling_seed(seed, step, index)`, and the same at every evaluation."""
    return zlib.crc32(f"eval:{seed}:{index}".encode()) & 0x7FFFFFFF


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one prompt with c correct completions out of n (n >= k)."""
    assert 0 <= c <= n and 1 <= k <= n, (n, c, k)
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


BEFORE_TRAINING = -1
"""The step of the initial policy's evaluation (eval.before_train) and of its metrics record."""


def is_eval_step(step: int, interval_steps: int, num_steps: int, before_train: bool = False) -> bool:
    """Evaluate after `step`: every `interval_steps` steps (step + 1 a multiple) and after the last;
    at BEFORE_TRAINING when `before_train`."""
    if step == BEFORE_TRAINING:
        return before_train
    return interval_steps > 0 and ((step + 1) % interval_steps == 0 or step == num_steps - 1)


def data_source(example: Example) -> str:
    """The row's verl `data_source` (as text), "unknown" without one (as verl's validation names it)."""
    source = example.extra.get("data_source")
    return "unknown" if source is None else str(source)


def val_metrics(rewards: np.ndarray, response_lens: list[int], num_samples: int, num_errors: int,
                sources: list[str] | None = None) -> dict:
    """The val/ metrics of one evaluation; `rewards` holds each prompt's `num_samples` rewards
    adjacently; `sources` (one per prompt) adds each source's reward_mean and pass@k when it names
    more than one."""
    per_prompt = rewards.reshape(-1, num_samples)
    correct = (per_prompt >= CORRECT_AT).sum(axis=1)
    passed = np.array([pass_at_k(num_samples, int(c), num_samples) for c in correct])
    metrics = {"val/reward_mean": float(rewards.mean()), f"val/pass@{num_samples}": float(passed.mean()),
               "val/reward_errors": num_errors, "val/response_len": float(np.mean(response_lens))}
    if sources is not None and len(set(sources)) > 1:
        assert len(sources) == len(per_prompt), (len(sources), len(per_prompt))
        for source in sorted(set(sources)):
            mine = np.array([s == source for s in sources])
            metrics[f"val/{source}/reward_mean"] = float(per_prompt[mine].mean())
            metrics[f"val/{source}/pass@{num_samples}"] = float(passed[mine].mean())
    return metrics


def read_val_examples(file: ExampleFile, max_prompts: int, drop_overlong: bool) -> tuple[list[Example], int]:
    """The first `max_prompts` usable rows of `file` (0: all) and how many overlong rows were skipped
    (under `drop_overlong`; otherwise the row's error stops the run, as in training)."""
    examples, skipped = [], 0
    for i in range(len(file)):
        if max_prompts and len(examples) == max_prompts:
            break
        try:
            examples.append(file[i])
        except OverlongPrompt:
            if not drop_overlong:
                raise
            skipped += 1
    return examples, skipped


class Evaluator:
    """Runs the evaluations of a job; `maybe_evaluate(step)` returns the step's val/ metrics or {}."""

    def __init__(self, job: JobConfig, examples: list[Example], rollouts: RolloutGroup,
                 stop_token_ids: list[int], score: Callable[[Rollout], Scores]) -> None:
        self.job, self.examples, self.rollouts, self.score = job, examples, rollouts, score
        self.generation_span: tuple[float, float] | None = None
        """(start, end) perf_counter of the last evaluation's generation on the engines."""
        self.last: tuple[Rollout, Scores] | None = None
        """The last evaluation's completions and their scores (logging.rollout_samples)."""
        self.stop_token_ids = list(stop_token_ids)
        self.poll: Callable[[], None] | None = None
        """The checkpointer's preemption poll, run while an evaluation waits for the engines."""

    def due(self, step: int) -> bool:
        ev = self.job.eval
        return bool(self.examples) and is_eval_step(step, ev.interval_steps, self.job.algorithm.num_steps,
                                                    ev.before_train)

    def maybe_evaluate(self, step: int) -> dict[str, Any]:
        """After `step`'s weight sync (BEFORE_TRAINING: the initial push): evaluate if it is an
        evaluation step; its metrics, else {}."""
        if not self.due(step):
            return {}
        ev, r = self.job.eval, self.job.rollout
        examples = [ex for ex in self.examples for _ in range(ev.num_samples)]
        params = [{"temperature": ev.temperature, "top_p": 1.0, "max_new_tokens": r.max_new_tokens,
                   "stop_token_ids": self.stop_token_ids, "ignore_eos": r.ignore_eos,
                   "sampling_seed": eval_sampling_seed(self.job.trainer.seed, i)}
                  for i in range(len(examples))]
        request = self.rollouts.prepare(examples, [list(ex.prompt_ids) for ex in examples], params, routes=False)
        t_generate = time.perf_counter()
        started = self.rollouts.start(step, request)
        rollout = self.rollouts.collect(started, self.poll)
        self.generation_span = (t_generate, t_generate + started.latency_s)  # the engines' busy time
        scores = self.score(rollout)
        self.last = rollout, scores
        when = "before training" if step == BEFORE_TRAINING else f"step {step}"
        scores.report(f"{when}: evaluation", self.job.reward.fn, "held-out completions")
        return val_metrics(scores.rewards, [len(ids) for ids in rollout.response_ids], ev.num_samples,
                           scores.num_errors, [data_source(ex) for ex in self.examples])
