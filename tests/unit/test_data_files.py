"""Data files as verl users have them: lazy .jsonl / .parquet rows, dotted answer keys, extra columns,
per-row checks with messages naming file, row and fix, and the sampler's determinism (drop mode too).
Everything here uses the built-in character tokenizer (no transformers); see test_hf_tokenizer.py for
chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import hpcrl.tasks.files as files
from hpcrl.tasks import Example, ExampleFile, OverlongPrompt, PromptFormat, PromptSampler, make_sampler
from hpcrl.tasks.files import _line_starts, open_rows

pytestmark = pytest.mark.timeout(120)

VERL_ROWS = [
    {"data_source": "gsm8k", "prompt": "what is 2+3?", "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": "5"}, "extra_info": {"index": 0}},
    {"data_source": "gsm8k", "prompt": "what is 4*4?", "ability": "math",
     "reward_model": {"style": "rule", "ground_truth": 16}, "extra_info": {"index": 1}},
]


def jsonl(path: Path, rows: list, blank_lines: bool = False) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text(("\n\n" if blank_lines else "\n").join(lines) + "\n")
    return path


def parquet(path: Path, rows: list[dict], row_group_size: int | None = None) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    return path


VERL = PromptFormat(answer_key="reward_model.ground_truth")


@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_verl_rows_dotted_answer_and_extra_columns(tmp_path, kind):
    rows = [{**VERL_ROWS[0]}, {**VERL_ROWS[1], "reward_model": {"style": "rule", "ground_truth": "16"}}]
    path = jsonl(tmp_path / "d.jsonl", rows) if kind == "jsonl" else parquet(tmp_path / "d.parquet", rows)
    file = ExampleFile(path, VERL)
    assert len(file) == 2
    ex = file[1]
    assert (ex.prompt, ex.answer, ex.row, ex.raw_prompt) == ("what is 4*4?", "16", 1, "what is 4*4?")
    # every column but the prompt travels in extra; the dotted answer's parent column stays whole
    assert ex.extra == {"data_source": "gsm8k", "ability": "math",
                        "reward_model": {"style": "rule", "ground_truth": "16"}, "extra_info": {"index": 1}}
    # <bos> (1) then one id per character: 'w' is 36, 'h' 21 in char_vocab.json
    assert ex.prompt_ids[:3] == (1, 36, 21) and len(ex.prompt_ids) == 1 + len("what is 4*4?")


def test_answers_that_are_not_strings_and_top_level_answer_columns(tmp_path):
    path = jsonl(tmp_path / "d.jsonl", [{"q": "1+1=", "a": 2, "id": 7}, {"q": "2+2=", "a": [4, "four"]}])
    file = ExampleFile(path, PromptFormat(prompt_key="q", answer_key="a"))
    assert (file[0].answer, file[0].extra) == ("2", {"id": 7})
    assert (file[1].answer, file[1].extra) == ('[4, "four"]', {})
    # a column named with a dot wins over the nested walk
    path = jsonl(tmp_path / "e.jsonl", [{"q": "1=", "a.b": "x", "a": {"b": "y"}}])
    assert ExampleFile(path, PromptFormat(prompt_key="q", answer_key="a.b"))[0].answer == "x"


def test_jsonl_index_skips_empty_lines_and_names_lines(tmp_path, monkeypatch):
    path = jsonl(tmp_path / "d.jsonl", [{"prompt": "ab", "answer": "x"}, "{not json", {"prompt": "cd"}],
                 blank_lines=True)
    rows = open_rows(path)
    assert len(rows) == 3 and rows[0] == {"prompt": "ab", "answer": "x"}
    with pytest.raises(ValueError, match=r"row 2: line 3 is not JSON \(Expecting property name"):
        rows[1]
    with pytest.raises(ValueError, match=r"row 3 \(line 5\) lacks 'answer' \(data.answer_key\); its keys "
                                         r"are \['prompt'\]; set data.answer_key"):
        ExampleFile(path, PromptFormat())[2]
    # the chunked index equals a plain reading at every chunk size, across "\r\n" and blank lines
    text = b'{"a": 1}\r\n\r\n{"b": 2}\n\n\n{"c": 3}'
    path.write_bytes(text)
    for chunk in (1, 2, 3, 5, 1 << 20):
        monkeypatch.setattr(files, "CHUNK_BYTES", chunk)
        starts, size = _line_starts(path)
        assert starts.dtype == np.int64 and starts.tolist() == [0, 12, 23] and size == len(text), chunk
    assert [r for r in open_rows(path)] == [{"a": 1}, {"b": 2}, {"c": 3}]


def test_parquet_reads_row_groups_on_demand(tmp_path):
    rows = [{"prompt": f"{i}+0=", "answer": str(i)} for i in range(10)]
    path = parquet(tmp_path / "d.parquet", rows, row_group_size=3)
    file = ExampleFile(path, PromptFormat())
    assert len(file) == 10 and file.rows.group_starts.tolist() == [0, 3, 6, 9, 10]
    assert [file[i].answer for i in (9, 0, 4, 3, 8)] == ["9", "0", "4", "3", "8"]
    assert len(file.rows._groups) == files.CACHED_GROUPS  # only the last groups stay in memory


def _error(path: Path, row: dict | str, fmt: PromptFormat = PromptFormat()) -> str:
    jsonl(path, [{"prompt": "ok", "answer": "1"}, row])
    with pytest.raises(ValueError) as info:
        ExampleFile(path, fmt)[1]
    return str(info.value)


def test_bad_rows_name_file_row_key_value_and_fix(tmp_path):
    p = tmp_path / "d.jsonl"
    head = f"data.path={str(p)!r}: row 2 "
    assert _error(p, {"prompt": "What is 2+3? Tell me!", "answer": "5"}) == (
        head + "has a prompt ('prompt') 'What is 2+3? Tell me!' with characters outside the alphabet of "
        "the built-in character tokenizer: '!' 'T' 'W'; set model.path to a model directory with a real "
        "tokenizer (tokenizer.json), or keep prompts to that alphabet")
    msg = _error(p, {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"})
    assert msg.startswith(head + "has a message-list prompt ('prompt') but the built-in character tokenizer "
                                 "has no chat template; set model.path")
    msg = _error(p, {"prompt": [{"role": "user", "content": "hi"}], "answer": "1"},
                 PromptFormat(apply_chat_template=False))
    assert "data.apply_chat_template is false; set it to true" in msg
    assert _error(p, {"prompt": 42, "answer": "1"}).startswith(
        head + "has a prompt ('prompt') 42 of type int, neither a string nor a list of {role, content}")
    assert _error(p, {"prompt": "", "answer": "1"}).startswith(head + "has an empty prompt ('prompt')")
    msg = _error(p, {"prompt": "ab", "reward_model": {"style": "rule"}}, VERL)
    assert msg.startswith(head + "lacks 'reward_model.ground_truth' (data.answer_key); its keys are "
                                 "['prompt', 'reward_model']; set data.answer_key")
    assert _error(p, {"prompt": "ab", "answer": None}).startswith(head + "has null for 'answer'")
    assert _error(p, '["a", "b"]').startswith(head + "is a JSON list, not an object")
    fmt = PromptFormat(max_prompt_tokens=4, limit_reason="data.max_prompt_tokens=4")
    assert _error(p, {"prompt": "abcdef", "answer": "1"}, fmt) == (
        head + "has a prompt ('prompt') of 7 tokens, over data.max_prompt_tokens=4; shorten it, raise "
        "data.max_prompt_tokens, or set data.overlong_prompts: drop to skip such rows")
    with pytest.raises(ValueError, match="unsupported file type '.csv'; use .jsonl or .parquet"):
        open_rows(tmp_path / "x.csv")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="the file has no rows"):
        open_rows(tmp_path / "empty.jsonl")


def _digits_file(tmp_path: Path, n: int, long_rows: tuple[int, ...] = ()) -> Path:
    rows = [{"prompt": ("9" * 20 if i in long_rows else str(i)), "answer": str(i)} for i in range(n)]
    return jsonl(tmp_path / "d.jsonl", rows)


def test_file_sampler_is_a_pure_function_of_seed_and_step(tmp_path):
    path = _digits_file(tmp_path, 7)
    a, b = (make_sampler(None, str(path), "prompt", "answer", 3, seed=5) for _ in range(2))
    steps = [[ex.row for ex in a.batch(s)] for s in range(7)]
    # a second instance (a resumed run) asked for the steps in another order agrees
    assert [[ex.row for ex in b.batch(s)] for s in reversed(range(7))] == steps[::-1]
    flat = [r for s in steps for r in s]
    for epoch in range(3):  # draw k is position k % 7 of the epoch's permutation
        assert flat[7 * epoch:7 * epoch + 7] == np.random.default_rng([5, epoch]).permutation(7).tolist()
    assert all(isinstance(ex, Example) and ex.prompt_ids for ex in a.batch(0))


def test_drop_mode_skips_overlong_rows_deterministically(tmp_path):
    long_rows = (1, 4, 5)
    path = _digits_file(tmp_path, 8, long_rows)
    fmt = PromptFormat(max_prompt_tokens=5, limit_reason="data.max_prompt_tokens=5")
    a, b = (make_sampler(None, str(path), "prompt", "answer", 4, seed=3, fmt=fmt, drop_overlong=True)
            for _ in range(2))
    got = [[ex.row for ex in a.batch(s)] for s in range(6)]
    assert got == [[ex.row for ex in b.batch(s)] for s in range(6)]
    assert not {r for s in got for r in s} & set(long_rows)
    # each skipped row is replaced by the next row of the same epoch's order
    order = np.random.default_rng([3, 0]).permutation(8).tolist()
    expected, dropped = [], []
    for pos in range(4):
        shift = 0
        while order[(pos + shift) % 8] in long_rows:
            dropped.append(order[(pos + shift) % 8])
            shift += 1
        expected.append(order[(pos + shift) % 8])
    assert got[0] == expected and a.dropped(0) == dropped
    assert sum(len(a.dropped(s)) for s in range(6)) > 0
    strict = make_sampler(None, str(path), "prompt", "answer", 8, seed=3, fmt=fmt)
    with pytest.raises(OverlongPrompt, match="row [256] has a prompt .* of 21 tokens, over data.max_prompt"):
        strict.batch(0)
    every = make_sampler(None, str(_digits_file(tmp_path, 3, (0, 1, 2))), "prompt", "answer", 1, seed=0,
                         fmt=fmt, drop_overlong=True)
    with pytest.raises(ValueError, match="every row is over data.max_prompt_tokens=5"):
        every.batch(0)


def test_task_sampler_encodes_prompts():
    s = PromptSampler(2, seed=0, task=make_sampler("add", None, "p", "a", 1, 0).task)
    for ex in s.batch(0):
        assert ex.prompt_ids == (1, *(4 + "0123456789".index(c) if c.isdigit() else {"+": 40, "=": 43}[c]
                                      for c in ex.prompt))
