"""Completions written out for reading (`logging.rollout_samples`, as verl's trainer.rollout_data_dir
and validation_data_dir): the first N completions each step scored, and each evaluation's, one JSON
object per line in RUN_DIR/rollouts/:

    step_000007.jsonl           step 7's (every generation round of a step that generates more than
                                once, dapo's, one after the other)
    val_step_000007.jsonl       the evaluation after step 7's update
    val_before_train.jsonl      eval.before_train's

Each line: step, round (0, 1, ... for a step's generation rounds: dapo's), index (the completion's
place in its round's rollout), prompt, response (decoded text), answer, reward, reward_error (the
reward's error, or null), finish_reason, response_tokens and data_source (verl's column; "unknown"
without one, as the val metrics name it). sft scores no completions: its evaluations only. A step
run again after a resume writes its file again.
Writing reads nothing back and draws no random number: training is the same with it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from hpcrl.controller.evaluation import data_source
from hpcrl.controller.groups import Rollout
from hpcrl.rewards.pool import Scores

DIR_NAME = "rollouts"


def sample_file_name(step: int, evaluation: bool) -> str:
    if not evaluation:
        return f"step_{step:06d}.jsonl"
    return "val_before_train.jsonl" if step < 0 else f"val_step_{step:06d}.jsonl"


class SampleLog:
    """Writes the first `count` completions of each scoring (-1: all of them; 0: none)."""

    def __init__(self, run_dir: Path, count: int, decode: Any) -> None:
        self.dir, self.count, self.decode = Path(run_dir) / DIR_NAME, count, decode
        self._open_step: int | None = None  # the training step whose file this run has begun
        self._round = 0  # of that step

    def write(self, step: int, rollout: Rollout, scores: Scores, evaluation: bool = False) -> None:
        if self.count == 0:
            return
        again = not evaluation and self._open_step == step  # a later generation round of the step
        if not evaluation:
            self._open_step, self._round = step, self._round + 1 if again else 0
        rows = range(len(rollout.response_ids) if self.count < 0 else min(self.count, len(rollout.response_ids)))
        self.dir.mkdir(exist_ok=True)
        with (self.dir / sample_file_name(step, evaluation)).open("a" if again else "w") as out:
            for i in rows:
                example = rollout.examples[i]
                out.write(json.dumps({
                    "step": step, "round": 0 if evaluation else self._round, "index": i, "prompt": example.prompt,
                    "response": self.decode(rollout.response_ids[i]), "answer": example.answer,
                    "reward": float(scores.rewards[i]), "reward_error": scores.errors.get(i),
                    "finish_reason": rollout.finish_reasons[i], "response_tokens": len(rollout.response_ids[i]),
                    "data_source": data_source(example)}) + "\n")
