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
