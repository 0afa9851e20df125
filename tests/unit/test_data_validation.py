"""Validation of data files and tokenizers: every bad input is one ConfigError naming the file, row and
key, the bad value and the fix (and `hpcrl validate` exits 2 with that one line, no traceback)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hf_fixtures import QWEN3_MOE, model_dir
from hpcrl.config import ConfigError, job_from_dict, validate

pytestmark = pytest.mark.timeout(300)

MESSAGES = [{"role": "user", "content": "what is 2+3?"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"ok": model_dir(root / "ok"),
            "small-vocab": model_dir(root / "small", config={**QWEN3_MOE, "vocab_size": 256})}


def rows_file(tmp_path: Path, rows: list, name: str = "train.jsonl") -> str:
    (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return name


def check(tmp_path: Path, cfg: dict) -> ConfigError | None:
    try:
        validate(job_from_dict(cfg, base_dir=tmp_path))
    except ConfigError as exc:
        return exc
    return None


def error(tmp_path: Path, cfg: dict, key: str, *parts: str) -> str:
    exc = check(tmp_path, cfg)
    assert exc is not None, cfg
    msg = str(exc)
    assert exc.path == key, msg
    for part in parts:
        assert part in msg, (part, msg)
    return msg


def test_message_lists_need_a_chat_template(tmp_path, models):
    path = rows_file(tmp_path, [{"prompt": "ab", "answer": "1"}, {"prompt": MESSAGES, "answer": "5"}])
    error(tmp_path, {"data": {"path": path}}, "data.path", f"{tmp_path / path}",
          "row 2 has a message-list prompt ('prompt') but the built-in character tokenizer has no chat "
          "template; set model.path to a model directory whose tokenizer has one")
    cfg = {"model": {"path": str(models["ok"])}, "data": {"path": path, "apply_chat_template": False}}
    error(tmp_path, cfg, "data.path", "row 2 has a message-list prompt ('prompt') but "
                                      "data.apply_chat_template is false; set it to true")
    cfg["data"] |= {"apply_chat_template": True, "chat_template_kwargs": {"enable_thinking": False}}
    assert check(tmp_path, cfg) is None


def test_char_tokenizer_alphabet_names_row_and_characters(tmp_path):
    rows = [{"prompt": "what is 2+3?", "answer": "5"}, {"prompt": "What is 2+3?", "answer": "5"}]
    path = rows_file(tmp_path, rows)
    msg = error(tmp_path, {"data": {"path": path}}, "data.path")
    assert msg == (f"data.path={str(tmp_path / path)!r}: row 2 has a prompt ('prompt') 'What is 2+3?' with "
                   "characters outside the alphabet of the built-in character tokenizer: 'W'; set model.path "
                   "to a model directory with a real tokenizer (tokenizer.json), or keep prompts to that "
                   "alphabet")


def test_prompt_length_limits(tmp_path):
    # The tiny preset's context is 64 tokens: 64 - rollout.max_new_tokens (8) - 7 = 49 for the prompt (SGLang
    # refuses an input of 64 - 6 tokens or more, and the sync check scores prompt + completion as one).
    path = rows_file(tmp_path, [{"prompt": "ab", "answer": "1"}, {"prompt": "abcdef", "answer": "1"}])
    error(tmp_path, {"data": {"path": path, "max_prompt_tokens": 4}}, "data.path",
          "row 2 has a prompt ('prompt') of 7 tokens, over data.max_prompt_tokens=4; shorten it, raise "
          "data.max_prompt_tokens, or set data.overlong_prompts: drop")
    drop = {"path": path, "max_prompt_tokens": 4, "overlong_prompts": "drop"}
    assert check(tmp_path, {"data": drop}) is None
    error(tmp_path, {"data": {"path": path, "max_prompt_tokens": 60}}, "data.max_prompt_tokens",
          "use max_prompt_tokens <= 49")
    assert check(tmp_path, {"data": {"path": rows_file(tmp_path, [{"prompt": "a" * 48, "answer": "1"}],
                                                       "fits.jsonl")}}) is None  # <bos> + 48 = 49 tokens
    long = rows_file(tmp_path, [{"prompt": "a" * 49, "answer": "1"}], "long.jsonl")
    error(tmp_path, {"data": {"path": long}}, "data.path",
          "row 1 has a prompt ('prompt') of 50 tokens, over the model's context (max_position_embeddings=64 "
          "of preset 'tiny-qwen3-moe' - rollout.max_new_tokens=8 - 7 = 49 tokens)")
    error(tmp_path, {"data": {"path": long, "overlong_prompts": "drop"}}, "data.path",
          "every checked row (1) is over the model's context")


def test_answer_key_and_val_path(tmp_path):
    verl = [{"prompt": "ab", "reward_model": {"ground_truth": "1", "style": "rule"}, "data_source": "x"}]
    path = rows_file(tmp_path, verl)
    error(tmp_path, {"data": {"path": path}}, "data.path",
          "row 1 lacks 'answer' (data.answer_key); its keys are ['data_source', 'prompt', 'reward_model']; "
          "set data.answer_key to the answer's column (dotted for nested columns, e.g. "
          "reward_model.ground_truth)")
    good = {"path": path, "answer_key": "reward_model.ground_truth"}
    assert check(tmp_path, {"data": good}) is None
    error(tmp_path, {"data": good | {"val_path": "val.jsonl"}}, "data.val_path", "no such file")
    val = rows_file(tmp_path, [{"prompt": "cd", "reward_model": {"style": "rule"}}], "val.jsonl")
    error(tmp_path, {"data": good | {"val_path": val}}, "data.val_path",
          f"data.val_path={str(tmp_path / val)!r}: row 1 lacks 'reward_model.ground_truth'")


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path, models):
    path = rows_file(tmp_path, [{"prompt": "What is 2+3?", "answer": "5"}])
    small = models["small-vocab"]
    error(tmp_path, {"model": {"path": str(small)}, "data": {"path": path}}, "model.path",
          f"vocab_size=256 of config.json {small / 'config.json'} is smaller than the 320 ids of the "
          f"tokenizer of model.path={str(small)!r}", "use the tokenizer that belongs to the model")
    assert check(tmp_path, {"model": {"path": str(models["ok"])}, "data": {"path": path}}) is None


@pytest.mark.parametrize(("rows", "expected"), [
    ([{"prompt": "What is 2+3?", "answer": "5"}],
     "row 1 has a prompt ('prompt') 'What is 2+3?' with characters outside the alphabet of the built-in "
     "character tokenizer: 'W'"),
    ([{"prompt": MESSAGES, "answer": "5"}],
     "row 1 has a message-list prompt ('prompt') but the built-in character tokenizer has no chat template"),
], ids=["alphabet", "messages"])
def test_hpcrl_validate_exits_2_with_one_line(tmp_path, rows, expected):
    rows_file(tmp_path, rows)
    (tmp_path / "job.yaml").write_text("data: {path: train.jsonl}\n")
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "validate", "job.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert lines[0].startswith("hpcrl validate: error: data.path=") and expected in lines[0], lines[0]


def test_answers_that_are_not_text_or_json_and_prompts_of_no_tokens_are_named(tmp_path, models):
    """A parquet answer column of bytes (or a timestamp, a decimal) cannot become the reward's answer
    text: named with its type, not a TypeError from json.dumps. A chat template that renders a prompt to
    nothing would reach the engine as an empty input (400 at step 0): named at validation."""
    import shutil

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["ab", "cd"], "answer": [b"1", b"2"]}), tmp_path / "bin.parquet")
    error(tmp_path, {"data": {"path": "bin.parquet"}}, "data.path",
          "row 1 has an answer ('answer') of type bytes, which is neither text nor JSON")
    blank = tmp_path / "blank_template"
    shutil.copytree(models["ok"], blank)
    config = json.loads((blank / "tokenizer_config.json").read_text())
    (blank / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": "{{ '' }}"}))
    (blank / "chat_template.jinja").unlink(missing_ok=True)
    path = rows_file(tmp_path, [{"prompt": MESSAGES, "answer": "5"}])
    error(tmp_path, {"model": {"path": str(blank)}, "data": {"path": path, "apply_chat_template": True}},
          "data.path", "row 1 has a prompt ('prompt') of no tokens: the chat template of", "fix the template")


def test_a_task_typo_is_named_even_where_data_path_wins(tmp_path):
    """data.task is not used with data.path, but 'revers' there is still a typo (it was accepted
    silently); data.task: null is how to say none."""
    path = rows_file(tmp_path, [{"prompt": "ab", "answer": "1"}])
    error(tmp_path, {"data": {"path": path, "task": "revers"}}, "data.task", "did you mean 'reverse'",
          "data.task: null")
    assert check(tmp_path, {"data": {"path": path, "task": None}}) is None


def test_a_task_longer_than_max_prompt_tokens_is_refused(tmp_path):
    """A built-in task's prompts are not cut: a data.max_prompt_tokens below them was ignored without
    a word (the run's prompts broke the limit that hpcrl plan sized the routes by)."""
    error(tmp_path, {"data": {"task": "reverse", "max_prompt_tokens": 3}}, "data.max_prompt_tokens",
          "data.task=reverse's prompts are 5 tokens", "use max_prompt_tokens >= 5, or 0 for no limit")
    assert check(tmp_path, {"data": {"task": "reverse", "max_prompt_tokens": 5}}) is None
