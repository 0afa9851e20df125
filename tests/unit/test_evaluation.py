"""Evaluation logic without engines: pass@k, when evaluation runs, its seed namespace, its requests
and its metrics (the e2e run is tests/e2e/test_eval_run.py)."""

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from hpcrl.config.schema import JobConfig
from hpcrl.controller.evaluation import (BEFORE_TRAINING, Evaluator, data_source, eval_sampling_seed,
                                         is_eval_step, pass_at_k, read_val_examples, val_metrics)
from hpcrl.controller.groups import Rollout
from hpcrl.controller.session import sampling_seed
from hpcrl.rewards.pool import Scores
from hpcrl.tasks import Example, ExampleFile, OverlongPrompt, PromptFormat


def test_pass_at_k_unbiased_estimator_by_hand():
    assert pass_at_k(1, 0, 1) == 0.0 and pass_at_k(1, 1, 1) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0   # n = k: any correct sample passes
    assert pass_at_k(5, 2, 1) == pytest.approx(2 / 5)                 # pass@1 = c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 1 - 3/10
    assert pass_at_k(3, 2, 2) == 1.0                                  # n - c < k


def test_val_metrics_group_adjacent_samples_per_prompt():
    # 3 prompts x 2 samples: prompt 0 one correct, prompt 1 none (0.9 is not correct), prompt 2 both
    rewards = np.array([1.0, 0.0, 0.9, 0.5, 1.0, 1.0], dtype=np.float32)
    m = val_metrics(rewards, [4, 4, 2, 2, 3, 3], num_samples=2, num_errors=1)
    assert m == {"val/reward_mean": pytest.approx(4.4 / 6), "val/pass@2": pytest.approx(2 / 3),
                 "val/reward_errors": 1, "val/response_len": pytest.approx(3.0)}


def test_val_metrics_per_data_source_when_the_rows_name_several():
    # 4 prompts x 2 samples; sources gsm8k, math, gsm8k, unknown (a row without data_source)
    rewards = np.array([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5], dtype=np.float32)
    m = val_metrics(rewards, [1] * 8, num_samples=2, num_errors=0, sources=["gsm8k", "math", "gsm8k", "unknown"])
    assert m["val/gsm8k/reward_mean"] == pytest.approx(3 / 4) and m["val/gsm8k/pass@2"] == 1.0
    assert m["val/math/reward_mean"] == 0.0 and m["val/math/pass@2"] == 0.0
    assert m["val/unknown/reward_mean"] == 0.5 and m["val/unknown/pass@2"] == 0.0  # 0.5 is not correct
    assert m["val/reward_mean"] == pytest.approx(4 / 8) and m["val/pass@2"] == pytest.approx(2 / 4)
    # one source: only the pooled metrics (each source's would repeat them)
    assert val_metrics(rewards, [1] * 8, 2, 0, ["gsm8k"] * 4) == val_metrics(rewards, [1] * 8, 2, 0)


def test_data_source_of_a_row():
    assert data_source(Example("p", "a", {"data_source": "openai/gsm8k"})) == "openai/gsm8k"
    assert data_source(Example("p", "a", {"data_source": 3})) == "3"
    assert data_source(Example("p", "a", {"split": "val"})) == "unknown"


def test_eval_steps_every_interval_and_after_the_last():
    assert [s for s in range(6) if is_eval_step(s, 2, 6)] == [1, 3, 5]
    assert [s for s in range(8) if is_eval_step(s, 3, 8)] == [2, 5, 7]
    assert not any(is_eval_step(s, 0, 8) for s in range(8))
    # before training (step -1) only with eval.before_train, whatever the interval
    assert not is_eval_step(BEFORE_TRAINING, 3, 8) and not is_eval_step(BEFORE_TRAINING, 1, 8)
    assert is_eval_step(BEFORE_TRAINING, 0, 8, before_train=True)
    assert [s for s in range(-1, 8) if is_eval_step(s, 3, 8, before_train=True)] == [-1, 2, 5, 7]


def test_eval_seeds_are_their_own_namespace_and_fixed_across_evaluations():
    train = {sampling_seed(1234, step, i) for step in range(50) for i in range(128)}
    evals = [eval_sampling_seed(1234, i) for i in range(128)]
    assert len(set(evals)) == 128 and not train & set(evals)
    assert evals == [eval_sampling_seed(1234, i) for i in range(128)]
    assert eval_sampling_seed(1235, 0) != evals[0]


def _val_file(tmp_path, rows):
    path = tmp_path / "val.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_read_val_examples_in_order_with_max_prompts_and_overlong_rows(tmp_path):
    path = _val_file(tmp_path, [{"prompt": p, "answer": p * 4, "source": "copy"} for p in "abcdefgh"])
    file = ExampleFile(path, PromptFormat(), "data.val_path")
    examples, skipped = read_val_examples(file, 3, drop_overlong=False)
    assert [e.prompt for e in examples] == ["a", "b", "c"] and skipped == 0
    assert examples[0].extra == {"source": "copy"} and examples[0].prompt_ids
    long_path = _val_file(tmp_path, [{"prompt": "a", "answer": "x"}, {"prompt": "abcdef", "answer": "x"},
                                     {"prompt": "b", "answer": "x"}])
    limited = ExampleFile(long_path, PromptFormat(max_prompt_tokens=3), "data.val_path")
    examples, skipped = read_val_examples(limited, 0, drop_overlong=True)
    assert [e.prompt for e in examples] == ["a", "b"] and skipped == 1
    with pytest.raises(OverlongPrompt):
        read_val_examples(limited, 0, drop_overlong=False)


class FakeRollouts:
    """Stands in for RolloutGroup: records the request, answers each prompt with its letter x4."""

    def __init__(self):
        self.requests = []

    def prepare(self, examples, prompt_ids, params, routes=True):
        self.requests.append((examples, prompt_ids, params, routes))
        return examples, prompt_ids

    def start(self, step, request):
        return SimpleNamespace(request=request, latency_s=0.5)

    def collect(self, started, poll=None):
        examples, prompt_ids = started.request
        response = [[7, 7, 7, 7] if i % 2 == 0 else [7] for i in range(len(examples))]
        return Rollout(examples, prompt_ids, response, [[0.0] * len(r) for r in response],
                       ["stop"] * len(examples))


def test_evaluator_requests_and_metrics(tmp_path):
    job = JobConfig()
    job.algorithm.num_steps = 4
    job.eval.interval_steps, job.eval.num_samples, job.eval.temperature = 3, 2, 0.7
    path = _val_file(tmp_path, [{"prompt": p, "answer": p * 4} for p in "abc"])
    examples, _ = read_val_examples(ExampleFile(path, PromptFormat(), "data.val_path"), 0, False)
    rollouts = FakeRollouts()
    score = lambda rollout: Scores(np.array([1.0 if len(r) == 4 else 0.25 for r in rollout.response_ids],
                                            dtype=np.float32))
    ev = Evaluator(job, examples, rollouts, [3], score)
    assert [s for s in range(4) if ev.due(s)] == [2, 3]
    assert ev.maybe_evaluate(0) == {} and not rollouts.requests
    m = ev.maybe_evaluate(2)
    sent_examples, prompt_ids, params, routes = rollouts.requests[0]
    assert routes is False  # routing replay's routes: evaluation trains on nothing
    assert [e.prompt for e in sent_examples] == ["a", "a", "b", "b", "c", "c"]
    assert prompt_ids[0] == list(examples[0].prompt_ids)
    assert [p["sampling_seed"] for p in params] == [eval_sampling_seed(job.trainer.seed, i) for i in range(6)]
    assert all(p["temperature"] == 0.7 and p["top_p"] == 1.0 and p["stop_token_ids"] == [3] for p in params)
    assert m["val/pass@2"] == 1.0 and m["val/reward_mean"] == pytest.approx(0.625)
    assert m["val/reward_errors"] == 0
    start, end = ev.generation_span  # the engines' busy time: the slowest engine's latency
    assert end - start == 0.5
    assert not Evaluator(job, [], rollouts, [3], score).due(3)
    assert not ev.due(BEFORE_TRAINING)
    job.eval.before_train = True
    assert ev.due(BEFORE_TRAINING) and not Evaluator(job, [], rollouts, [3], score).due(BEFORE_TRAINING)


def test_evaluation_names_its_reward_errors(tmp_path, capsys):
    """Held-out rewards that raised were only counted in val/reward_errors (training prints the first)."""
    job = JobConfig()
    job.algorithm.num_steps, job.eval.interval_steps = 2, 1
    path = _val_file(tmp_path, [{"prompt": p, "answer": p * 4} for p in "ab"])
    examples, _ = read_val_examples(ExampleFile(path, PromptFormat(), "data.val_path"), 0, False)
    def score(rollout):
        return Scores(np.zeros(len(rollout.response_ids), dtype=np.float32),
                      {0: "ValueError: no answer", 1: "ValueError: no answer"})

    m = Evaluator(job, examples, FakeRollouts(), [3], score).maybe_evaluate(1)
    assert m["val/reward_errors"] == 2
    assert (f"hpcrl: step 1: evaluation: reward.fn={job.reward.fn!r} failed on 2 of 2 held-out completions "
            "(scored 0); first, completion 0: ValueError: no answer") in capsys.readouterr().out
