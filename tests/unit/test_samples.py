"""logging.rollout_samples (hpcrl/controller/samples.py): the first N completions of each scoring in
RUN_DIR/rollouts/, one JSON object per line; a step's later generation rounds append, a step run
again (after a resume) starts its file over, evaluations get files of their own."""

from __future__ import annotations

import json

import numpy as np

from hpcrl.controller.groups import Rollout
from hpcrl.controller.samples import SampleLog
from hpcrl.rewards.pool import Scores
from hpcrl.tasks import Example


def _rollout(letters: str) -> Rollout:
    examples = [Example(c, c * 4, {"data_source": "copy"} if c != "z" else {}) for c in letters]
    responses = [[ord(c)] * (i + 1) for i, c in enumerate(letters)]
    return Rollout(examples, [[ord(c)] for c in letters], responses, [[0.0] * len(r) for r in responses],
                   ["stop"] * (len(letters) - 1) + ["length"])


def _scores(n: int, errors: dict[int, str] | None = None) -> Scores:
    return Scores(np.arange(n, dtype=np.float32) / 4, errors or {})


def _lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_sample_files(tmp_path):
    log = SampleLog(tmp_path, 2, lambda ids: "".join(chr(i) for i in ids))
    log.write(3, _rollout("abz"), _scores(3, {1: "ValueError: no answer"}))
    [first, second] = _lines(tmp_path / "rollouts" / "step_000003.jsonl")
    assert first == {"step": 3, "round": 0, "index": 0, "prompt": "a", "response": "a", "answer": "aaaa", "reward": 0.0,
                     "reward_error": None, "finish_reason": "stop", "response_tokens": 1, "data_source": "copy"}
    assert second["response"] == "bb" and second["reward"] == 0.25 and second["reward_error"] == "ValueError: no answer"

    log.write(3, _rollout("xy"), _scores(2))  # a second generation round of step 3 (dapo) appends
    assert [(r["round"], r["index"], r["prompt"]) for r in _lines(tmp_path / "rollouts" / "step_000003.jsonl")] == \
        [(0, 0, "a"), (0, 1, "b"), (1, 0, "x"), (1, 1, "y")]
    log.write(-1, _rollout("q"), _scores(1), evaluation=True)
    log.write(3, _rollout("z"), _scores(1), evaluation=True)
    assert _lines(tmp_path / "rollouts" / "val_before_train.jsonl")[0]["prompt"] == "q"
    [val] = _lines(tmp_path / "rollouts" / "val_step_000003.jsonl")
    assert val["data_source"] == "unknown" and val["finish_reason"] == "length"  # as the val metrics name it

    again = SampleLog(tmp_path, -1, lambda ids: "")  # a resumed run redoes step 3: its file starts over
    again.write(3, _rollout("abz"), _scores(3))
    assert [r["prompt"] for r in _lines(tmp_path / "rollouts" / "step_000003.jsonl")] == ["a", "b", "z"]

    SampleLog(tmp_path / "none", 0, str).write(0, _rollout("a"), _scores(1))
    assert not (tmp_path / "none").exists()
