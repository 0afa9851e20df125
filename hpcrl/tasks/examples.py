"""Examples: one prompt, its reference answer and the row's other columns, read from a data file
as verl users have them (.jsonl / .parquet) and checked row by row.

    fmt = PromptFormat(tokenizer, prompt_key="prompt", answer_key="reward_model.ground_truth")
    file = ExampleFile(Path("train.parquet"), fmt)   # lazy: see hpcrl/tasks/files.py
    len(file); file[i] -> Example (rendered, encoded, checked) or ValueError naming file, row and fix

A row's prompt is a string or a message list ([{role, content}, ...]). With `apply_chat_template`
and a tokenizer that has a chat template, a message list is rendered with it (generation prompt
added, `chat_template_kwargs` passed) and a string becomes one user message; without one, strings
go to the tokenizer as they are and message lists are an error. The answer key may be dotted
(`reward_model.ground_truth`). `Example.extra` holds every other top-level column (a dotted answer
key's parent column stays whole). The same checks run when validation samples rows and when the
sampler draws one, with the same messages; `OverlongPrompt` marks the one check that
`data.overlong_prompts: drop` turns into a skip.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpcrl.tasks.files import DataError, JsonlRows, ParquetRows, open_rows
from hpcrl.tasks.tokenizer import Tokenizer, default_tokenizer


@dataclass(frozen=True)
class Example:
    """One prompt with its answer. Rewards read `prompt` (text), `answer` and `extra`."""

    prompt: str
    """The prompt as text the model sees: the file's string, or the chat-template rendering."""
    answer: str
    """The reference answer (numbers and lists from the file as their JSON text)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """The row's other columns, e.g. verl's data_source, reward_model, extra_info."""
    raw_prompt: str | list[dict[str, Any]] | None = None
    """The file's prompt value (a string or a message list); None for synthetic tasks."""
    prompt_ids: tuple[int, ...] = ()
    """Token ids of `prompt` (filled by the sampler / ExampleFile; () when not encoded)."""
    row: int = -1
    """0-based row of the file (-1 for synthetic tasks)."""


class OverlongPrompt(DataError):
    """A row's prompt is longer than the prompt limit (skipped under overlong_prompts: drop)."""


@dataclass(frozen=True)
class PromptFormat:
    """How rows become examples: column names, chat template use and the prompt token limit."""

    tokenizer: Tokenizer = field(default_factory=default_tokenizer)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    apply_chat_template: bool = True
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    max_prompt_tokens: int = 0
    """Longest prompt in tokens; 0: no limit."""
    limit_reason: str = "data.max_prompt_tokens"
    """What set the limit, for messages (e.g. "data.max_prompt_tokens=256")."""


def lookup(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) of `key` in `row`; a dotted key walks nested mappings unless the row has a
    column of that exact name."""
    if key in row:
        return True, row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


class ExampleFile:
    """The checked examples of a data file, read lazily row by row (see the module docstring)."""

    def __init__(self, path: Path, fmt: PromptFormat, key: str = "data.path") -> None:
        self.path, self.fmt, self.key = path, fmt, key
        self.rows: JsonlRows | ParquetRows = open_rows(path, key)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Example:
        return self.example(self.rows[i], i)

    def _error(self, i: int, problem: str, cls: type[DataError] = DataError) -> DataError:
        return cls(f"{self.key}={str(self.path)!r}: {self.rows.where(i)} {problem}")

    def example(self, row: dict[str, Any], i: int) -> Example:
        """Row `i` as a rendered and encoded Example; ValueError (OverlongPrompt) on a bad row."""
        f, tok = self.fmt, self.fmt.tokenizer
        found, prompt = lookup(row, f.prompt_key)
        if not found:
            raise self._error(i, f"lacks {f.prompt_key!r} (data.prompt_key); its keys are {sorted(row)}; "
                                 "set data.prompt_key to the prompt's column")
        found, answer = lookup(row, f.answer_key)
        if not found or answer is None:
            why = "lacks" if not found else "has null for"
            raise self._error(i, f"{why} {f.answer_key!r} (data.answer_key); its keys are {sorted(row)}; "
                                 "set data.answer_key to the answer's column (dotted for nested "
                                 "columns, e.g. reward_model.ground_truth)")
        text, rendered = self._render(prompt, i)
        what = f"a prompt ({f.prompt_key!r})"
        bad = tok.unknown_chars(text)
        if bad:
            raise self._error(i, f"has {what} {_short(text)} with characters outside the alphabet of "
                                 f"{tok.name}: {' '.join(repr(c) for c in bad)}; set model.path to a model "
                                 "directory with a real tokenizer (tokenizer.json), or keep prompts to "
                                 "that alphabet")
        ids = tok.encode_prompt(text, rendered)
        if not ids:  # an engine refuses an empty input
            how = (f"the chat template of {tok.name} renders it as {_short(text)}" if rendered
                   else f"{tok.name} encodes {_short(text)} as no token")
            raise self._error(i, f"has {what} of no tokens: {how}; fix the template (or set "
                                 "data.apply_chat_template: false), or drop the row")
        if f.max_prompt_tokens and len(ids) > f.max_prompt_tokens:
            raise self._error(i, f"has {what} of {len(ids)} tokens, over {f.limit_reason}; shorten it, "
                                 "raise data.max_prompt_tokens, or set data.overlong_prompts: drop to "
                                 "skip such rows", OverlongPrompt)
        top = {f.prompt_key if f.prompt_key in row else f.prompt_key.split(".")[0]}
        if f.answer_key in row:
            top.add(f.answer_key)
        extra = {k: v for k, v in row.items() if k not in top}
        try:
            answer_text = answer if isinstance(answer, str) else json.dumps(answer)
        except (TypeError, ValueError):
            raise self._error(i, f"has an answer ({f.answer_key!r}) of type {type(answer).__name__}, which "
                                 "is neither text nor JSON; store the answers as strings (or numbers, lists, "
                                 "objects)") from None
        return Example(text, answer_text, extra, prompt, tuple(ids), i)

    def _render(self, prompt: Any, i: int) -> tuple[str, bool]:
        """(prompt text, whether the chat template rendered it)."""
        f, tok = self.fmt, self.fmt.tokenizer
        what = f"({f.prompt_key!r})"
        if isinstance(prompt, str):
            if not prompt:
                raise self._error(i, f"has an empty prompt {what}; drop the row or fill it in")
            if not (f.apply_chat_template and tok.chat_template):
                return prompt, False
            messages = [{"role": "user", "content": prompt}]
        elif _is_messages(prompt):
            if not f.apply_chat_template:
                raise self._error(i, f"has a message-list prompt {what} but data.apply_chat_template is "
                                     "false; set it to true (the tokenizer's chat template renders the "
                                     "messages), or give string prompts")
            if not tok.chat_template:
                raise self._error(i, f"has a message-list prompt {what} but {tok.name} has no chat "
                                     "template; set model.path to a model directory whose tokenizer has "
                                     "one (chat_template in tokenizer_config.json or chat_template.jinja)")
            messages = prompt
        else:
            raise self._error(i, f"has a prompt {what} {_short(prompt)} of type {type(prompt).__name__}, "
                                 "neither a string nor a list of {role, content} messages; fix the row or "
                                 "set data.prompt_key to the prompt's column")
        try:
            return tok.render(messages, f.chat_template_kwargs), True
        except Exception as exc:  # jinja2 errors (TemplateError, TypeError from a user's template)
            raise self._error(i, f"has a prompt {what} {_short(prompt)} the chat template fails on "
                                 f"({type(exc).__name__}: {exc}); fix the messages or "
                                 f"data.chat_template_kwargs={f.chat_template_kwargs!r}") from None


def _is_messages(prompt: Any) -> bool:
    return (isinstance(prompt, list) and len(prompt) > 0
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m
                    for m in prompt))


def read_examples(path: Path, prompt_key: str, answer_key: str, key: str = "data.path",
                  fmt: PromptFormat | None = None) -> list[Example]:
    """All examples of a small file, in order (tests, small eval sets); ValueError naming the row."""
    fmt = fmt or PromptFormat(prompt_key=prompt_key, answer_key=answer_key)
    file = ExampleFile(Path(path), fmt, key)
    return [file[i] for i in range(len(file))]
