"""Synthetic tasks, the prompt sampler and rewards: the task must make the policy read its prompt."""

import itertools
import json

import numpy as np
import pytest

from hpcrl.rewards import BUILTIN_REWARDS, load_reward_fn
from hpcrl.tasks import TASKS, default_tokenizer, make_sampler
from hpcrl.tasks.sampler import read_examples


def _mean_reward(task: str, completion_of_prompt, n: int = 2000) -> float:
    sampler = make_sampler(task, None, "prompt", "answer", num_per_step=n, seed=7)
    reward = BUILTIN_REWARDS["token_match"]
    return float(np.mean([reward(ex.prompt, completion_of_prompt(ex.prompt), ex.answer)
                          for ex in sampler.batch(0)]))


@pytest.mark.parametrize("task", sorted(TASKS))
def test_prompt_independent_policies_score_at_most_0_2(task):
    """Every constant completion over the task's alphabet (the best prompt-ignoring policies,
    since an ignoring policy's expected reward is a mix of constant ones) scores <= 0.2."""
    alphabet = "abcdefgh0123456789"
    n = TASKS[task].answer_len
    best = 0.0
    candidates = {c * n for c in alphabet} | {"".join(p) for p in itertools.product("abcd", repeat=min(n, 3))}
    for completion in candidates:
        best = max(best, _mean_reward(task, lambda _p, c=completion: c, n=400))
    assert best <= 0.2, (task, best)


@pytest.mark.parametrize("task", sorted(TASKS))
def test_a_policy_that_reads_the_prompt_can_score_1(task):
    sampler = make_sampler(task, None, "prompt", "answer", num_per_step=50, seed=3)
    for ex in sampler.batch(5):
        assert BUILTIN_REWARDS["token_match"](ex.prompt, ex.answer, ex.answer) == 1.0
        assert BUILTIN_REWARDS["exact_match"](ex.prompt, ex.answer, ex.answer) == 1.0


def test_sampler_is_a_pure_function_of_seed_and_step(tmp_path):
    a = make_sampler("copy", None, "p", "a", 8, seed=1)
    b = make_sampler("copy", None, "p", "a", 8, seed=1)
    assert a.batch(3) == b.batch(3) and a.batch(3) != a.batch(4)
    rows = [{"q": f"{i}+0=", "a": str(i)} for i in range(5)]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    s = make_sampler(None, str(path), "q", "a", 2, seed=0)
    seen = [ex.answer for step in range(5) for ex in s.batch(step)]
    # two epochs of 5 rows: each epoch is a permutation of all rows
    assert sorted(seen[:5]) == sorted(seen[5:10]) == ["0", "1", "2", "3", "4"]


def test_bad_data_files_name_the_problem(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "x", "answer": "y"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        read_examples(bad, "prompt", "answer")
    missing = tmp_path / "m.jsonl"
    missing.write_text('{"question": "x"}\n')
    with pytest.raises(ValueError, match="row 1 lacks 'prompt'"):
        read_examples(missing, "prompt", "answer")
    with pytest.raises(ValueError, match="unsupported file type '.csv'"):
        read_examples(tmp_path / "x.csv", "prompt", "answer")


def test_tokenizer_round_trip_and_eos():
    tok = default_tokenizer()
    ids = tok.encode("ab=")
    assert ids[0] == tok.bos_id and tok.decode(ids[1:]) == "ab="
    assert tok.decode(tok.encode("cc", add_bos=False) + [tok.eos_id] + tok.encode("zz", add_bos=False)) == "cc"


def test_reward_loader_builtin_import_path_and_errors():
    assert load_reward_fn("token_match") is BUILTIN_REWARDS["token_match"]
    assert load_reward_fn("hpcrl.rewards.builtin:exact_match")("p", "x", "x") == 1.0
    with pytest.raises(ValueError, match="neither a built-in reward"):
        load_reward_fn("nope")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_reward_fn("no_such_mod:f")
    with pytest.raises(ValueError, match="has no function 'missing'"):
        load_reward_fn("hpcrl.rewards.builtin:missing")
    with pytest.raises(ValueError, match="cannot be called as"):
        load_reward_fn("math:sqrt")
    for name, kind in (("async_reward", "an async function"), ("generator_reward", "a generator function")):
        with pytest.raises(ValueError, match=f"'{name}' is {kind}, whose call returns no number"):
            load_reward_fn(f"{__name__}:{name}")


async def async_reward(prompt, completion, answer, extra):
    return 1.0


def generator_reward(prompt, completion, answer, extra):
    yield 1.0


@pytest.mark.parametrize(("body", "raised"), [
    ("x = 1\nraise RuntimeError('boom at import')\n", "RuntimeError: boom at import (FILE:2)"),
    ("def score(p, c, a:\n    return 0\n", "SyntaxError: '(' was never closed (FILE:1)"),
    ("import sys\nsys.exit(3)\n", "SystemExit: 3 (FILE:2)"),  # not the controller's requeue exit
], ids=["raises", "syntax-error", "sys-exit"])
def test_a_module_that_fails_at_import_is_named_not_a_traceback(tmp_path, monkeypatch, body, raised):
    """reward.fn, algorithm.name and losses name the module's own failure, file and line."""
    import sys

    from hpcrl.algorithms.losses import resolve_loss
    from hpcrl.controller.api import load_algorithm

    name = f"broken_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    want = f"importing module '{name}' raised {raised.replace('FILE', str(tmp_path / name) + '.py')}; fix the module"
    for load, prefix in ((lambda: load_reward_fn(f"{name}:score"), f"reward.fn='{name}:score': "),
                         (lambda: load_algorithm(name), "cannot load the algorithm: "),
                         (lambda: resolve_loss(f"{name}:loss"), f"loss '{name}:loss': ")):
        sys.modules.pop(name, None)
        with pytest.raises(ValueError) as err:
            load()
        assert str(err.value) == prefix + want


def test_parquet_prompt_file(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"question": ["1+1=", "2+2="], "solution": ["2", "4"]}), path)
    examples = read_examples(path, "question", "solution")
    assert [(e.prompt, e.answer) for e in examples] == [("1+1=", "2"), ("2+2=", "4")]


VERL_REWARDS = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    ok = data_source == "openai/gsm8k" and extra_info == {"index": 7, "split": "train"}
    return float(ok and solution_str.strip().endswith("#### " + ground_truth))


def with_kwargs(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return compute_score(data_source, solution_str, ground_truth, extra_info)


def as_dict(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": compute_score(data_source, solution_str, ground_truth, extra_info), "acc": True}


def gsm8k_like(solution_str, ground_truth, method="strict", format_score=0.0, score=1.0):
    return score if solution_str.strip().endswith("#### " + ground_truth) else format_score
'''


def test_a_verl_compute_score_is_called_as_verl_calls_it(tmp_path, monkeypatch):
    """verl's reward managers call compute_score(data_source=, solution_str=, ground_truth=,
    extra_info=) with the row's columns and take a dict's "score". Called by position, a verl function
    got the prompt as data_source and scored 0 without a word (an audit's run); a dict scored 0 as an
    error."""
    from hpcrl.rewards._worker import score_item

    (tmp_path / "verl_rewards.py").write_text(VERL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    # what ExampleFile gives a reward for a verl GSM8K row read with answer_key reward_model.ground_truth
    extra = {"data_source": "openai/gsm8k", "ability": "math", "reward_model": {"style": "rule", "ground_truth": "72"},
             "extra_info": {"index": 7, "split": "train"}}
    prompt, right, wrong = "<|im_start|>user\nNatalia ...", "48 + 24 = 72\n#### 72", "#### 71"
    for name in ("compute_score", "with_kwargs", "as_dict", "gsm8k_like"):
        fn = load_reward_fn(f"verl_rewards:{name}")
        assert score_item(fn, prompt, right, "72", extra) == (1.0, None), name
        assert score_item(fn, prompt, wrong, "72", extra) == (0.0, None), name
    # a row without verl's columns: the answer is the ground truth, no data source
    assert score_item(load_reward_fn("verl_rewards:gsm8k_like"), prompt, right, "72", {}) == (1.0, None)
