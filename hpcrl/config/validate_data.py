"""Validation of what a job reads: the model's config, the data (files sampled row by row, or a
synthetic task) and the reward function. Split from hpcrl/config/validate.py, which calls
`check_data_and_reward` and re-exports `read_model_config` and `prompt_limit`."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.config.errors import ConfigError, did_you_mean, job_field
from hpcrl.config.schema import JobConfig
from hpcrl.models.presets import CONFIG_DIR, preset_names
from hpcrl.rewards import load_reward_fn
from hpcrl.rewards.builtin import BUILTIN_REWARDS
from hpcrl.tasks import TASKS, ExampleFile, OverlongPrompt, Tokenizer, load_tokenizer, prompt_format
from hpcrl.tasks.hf_tokenizer import RemoteCodeTokenizerError
from moe.hf_megatron import HFModelDims


def read_model_config(job: JobConfig) -> tuple[str, Any, str, dict[str, Any]]:
    """(YAML key, its value, how messages name the model, the config.json dict) of the job's model.

    Reads `model.config_path` (relative to the job file) or the `model.preset` config; raises
    ConfigError when the file is missing, not JSON or not a JSON object. Does not parse the model.
    """
    m = job.model
    if m.path is not None:
        key, value = "model.path", m.path
        model_dir = Path(job.base_dir, m.path)
        if not model_dir.is_dir():
            raise ConfigError(key, value, "no such directory; give a local HuggingFace model directory "
                                          "(config.json, *.safetensors, tokenizer files), relative to the "
                                          "job file; nothing is downloaded")
        file = model_dir / "config.json"
        source = f"config.json {file}"
        if not file.is_file():
            raise ConfigError(key, value, "the directory has no config.json; give the directory of a "
                                          "HuggingFace model (the one holding config.json and *.safetensors)")
        try:
            hf = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(key, value, f"{file} is not a JSON file ({exc})") from None
    elif m.config_path is not None:
        key, value = "model.config_path", m.config_path
        file = Path(job.base_dir, m.config_path)
        source = f"config.json {file}"
        if file.is_dir():
            raise ConfigError(key, value, "is a directory; give the path of the config.json file in it")
        if not file.is_file():
            raise ConfigError(key, value, "no such file; give a HuggingFace config.json "
                                          "(relative to the job file), or set it to null and use "
                                          f"model.preset ({', '.join(preset_names())})")
        try:
            hf = json.loads(file.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(key, value, f"not a JSON file ({exc})") from None
    else:
        key, value = "model.preset", m.preset
        names = preset_names()
        if m.preset is None:
            raise ConfigError(key, value, f"no model: set model.preset ({', '.join(names)}) or "
                                          "model.config_path (a HuggingFace config.json)")
        if m.preset not in names:
            raise ConfigError(key, value, f"unknown preset{did_you_mean(str(value), names)}; valid: "
                                          f"{', '.join(names)}, or set model.config_path to a config.json")
        source = f"preset {m.preset!r}"
        hf = json.loads((CONFIG_DIR / f"{m.preset}.json").read_text())
    if not isinstance(hf, dict):
        raise ConfigError(key, value, "the model config must be a JSON object (a HuggingFace config.json)")
    return key, value, source, hf


def _strip_prefix(message: str, path: str, value: Any) -> str:
    """Drop a leading "path='value': " that lower layers (rewards, tasks) already put in messages."""
    for prefix in (f"{path}={value!r}: ", f"{path}={value!r} ", f"{path}={str(value)!r}: "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message


def task_draws(task: str, n: int = 16) -> list[tuple[str, str]]:
    """(prompt, answer) of `n` seeded draws of a synthetic task: its prompts and answers have a fixed
    length, and a few draws make the lengths measured from them robust to future variants."""
    rng = np.random.default_rng(0)
    return [TASKS[task].make(rng) for _ in range(n)]


def task_prompt_tokens(task: str, tok: Tokenizer) -> int:
    """The longest prompt of a synthetic task in `tok`'s tokens (its seeded draws, `task_draws`)."""
    return max(len(tok.encode_prompt(prompt)) for prompt, _ in task_draws(task))


def check_data_and_reward(job: JobConfig) -> int | None:
    """Checks data and reward; returns the prompt length in tokens for synthetic tasks, else None.

    Data files (data.path, data.val_path) are checked on a sample of rows (`_check_data_file`)."""
    d = job.data
    if d.task not in TASKS and (d.path is None or d.task is not None):  # a typo, even where data.path wins
        raise ConfigError("data.task", d.task, f"unknown task{did_you_mean(str(d.task), TASKS)}; "
                                               f"valid: {', '.join(TASKS)}, or set data.path to a file"
                                               + (" (data.path is set: data.task: null)" if d.path else ""))
    tok = job_tokenizer(job)
    if d.path is not None:
        if d.path == "":
            raise ConfigError("data.path", d.path, "empty; give a .jsonl/.parquet file, or null to use "
                                                   "data.task")
        _check_data_file(job, "data.path", tok)
        prompt_len = None
    else:
        prompt_len = task_prompt_tokens(d.task, tok)
        if d.max_prompt_tokens and prompt_len > d.max_prompt_tokens:  # else it only sizes plan's routes
            raise ConfigError("data.max_prompt_tokens", d.max_prompt_tokens,
                              f"data.task={d.task}'s prompts are {prompt_len} tokens ({tok.name}); use "
                              f"max_prompt_tokens >= {prompt_len}, or 0 for no limit")
    if d.val_path is not None:
        _check_data_file(job, "data.val_path", tok)
    try:
        load_reward_fn(job.reward.fn)
    except ValueError as exc:
        hint = _strip_prefix(str(exc), "reward.fn", job.reward.fn)
        if hint.startswith("is "):  # "reward.fn='x' is neither a built-in ... nor ..."
            hint = f"unknown reward{did_you_mean(job.reward.fn, BUILTIN_REWARDS)}: it {hint}"
        raise ConfigError("reward.fn", job.reward.fn, hint) from None
    return prompt_len


NUM_CHECKED_ROWS = 64
"""Validation checks the first NUM_CHECKED_ROWS rows of a data file and the first NUM_CHECKED_ROWS
of the sampler's epoch-0 order (seeded by data.seed); the sampler checks every row it draws."""


CONTEXT_RESERVE = 7
"""Tokens of the model's context that a prompt and its longest completion leave free. SGLang 0.5.23
refuses (400) an input of context_len - 6 tokens or more (the scheduler's max_req_input_len =
context_len - 1 - 5), and the sync check scores prompt + completion as one input (a partial rollout
resumes from prompt + the tokens so far): P + max_new_tokens <= context_len - 7. Generation alone
would need 2 (its cap min(max_new_tokens, context_len - 2 - P))."""


def engine_context(job: JobConfig) -> tuple[int, str]:
    """(the engines' context in tokens, how messages name it): the model's max_position_embeddings, or
    a smaller SGLang `--context-length` in rollout.server_args (a larger one SGLang refuses unless
    SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN is set on the engines, configs/model_config.py
    `_derive_context_length`: the model's stays the bound)."""
    from hpcrl.config.validate_rollout import server_arg_number, server_arg_values

    _, _, source, hf = read_model_config(job)
    context = HFModelDims.from_hf_config(hf).max_position_embeddings
    named = f"the model's context (max_position_embeddings={context} of {source}"
    for i, arg, flag, value in server_arg_values(job.rollout.server_args):
        if flag == "--context-length":
            length = server_arg_number(i, arg, flag, value)
            if length < context:
                context, named = length, f"the engines' context (rollout.server_args[{i}] {flag} {length}"
    return context, named


def prompt_limit(job: JobConfig) -> tuple[int, str]:
    """(longest prompt in tokens a run accepts, what sets it, for messages): data.max_prompt_tokens
    when set, else the engines' context (`engine_context`) less rollout.max_new_tokens +
    CONTEXT_RESERVE. Reads the model config; `validate` has checked it."""
    context, named = engine_context(job)
    new = job.rollout.max_new_tokens
    room = context - CONTEXT_RESERVE - new
    cap = job.data.max_prompt_tokens
    if cap and cap <= room:
        return cap, f"data.max_prompt_tokens={cap}"
    return room, f"{named} - rollout.max_new_tokens={new} - {CONTEXT_RESERVE} = {room} tokens)"


def longest_prompt(job: JobConfig, tok: Tokenizer | None = None) -> tuple[int, str]:
    """The longest prompt a step may hold, in tokens, and what sets it: data.max_prompt_tokens, else a
    synthetic task's prompts, else the engines' context less rollout.max_new_tokens and a reserve
    (`prompt_limit`, which also caps max_prompt_tokens there; no data file is read). ConfigError on
    rollout.max_new_tokens when that leaves no room for a prompt. `tok`: the job's tokenizer, if loaded."""
    d = job.data
    if d.path is None and d.task in TASKS and not d.max_prompt_tokens:
        prompt = task_prompt_tokens(d.task, tok or job_tokenizer(job))
        return prompt, f"data.task={d.task}'s {prompt}-token prompts"
    prompt, prompt_from = prompt_limit(job)
    if prompt < 1:
        new = job.rollout.max_new_tokens
        raise ConfigError("rollout.max_new_tokens", new, f"leaves no room for a prompt: {prompt_from}; use "
                                                         f"max_new_tokens <= {new + prompt - 1}")
    return prompt, prompt_from


def job_tokenizer(job: JobConfig) -> Tokenizer:
    try:
        return load_tokenizer(job)
    except RemoteCodeTokenizerError as exc:
        raise ConfigError("model.trust_remote_code", job.model.trust_remote_code,
                          f"model.path={job.model.path!r}: {exc}") from None
    except ImportError as exc:  # the directory's own tokenizer code (trusted) imports what is not here
        raise ConfigError("model.path", job.model.path,
                          f"its tokenizer code needs a package hpcrl's environment lacks ({exc}); install it "
                          f"there ({sys.executable} -m pip install ...)") from None
    except Exception as exc:  # transformers raises OSError/ValueError/... for broken tokenizer files
        raise ConfigError("model.path", job.model.path, f"cannot load its tokenizer "
                                                        f"({type(exc).__name__}: {exc}); fix or remove "
                                                        "the tokenizer files") from None


def _check_data_file(job: JobConfig, key: str, tok: Tokenizer) -> None:
    """`key` (data.path / data.val_path) names a readable file whose sampled rows are good examples:
    prompt type, answer key, chat template, alphabet, length (see hpcrl/tasks/examples.py)."""
    value = job_field(job, key)
    file = Path(job.base_dir, value)
    if not file.is_file():
        other = f"data.task ({', '.join(TASKS)})" if key == "data.path" else "no evaluation"
        raise ConfigError(key, value, f"no such file; give a .jsonl or .parquet file (relative to the job "
                                      f"file), or null to use {other}")
    limit, reason = prompt_limit(job)
    cap = job.data.max_prompt_tokens
    if cap and cap > limit and limit >= 1:
        raise ConfigError("data.max_prompt_tokens", cap,
                          f"prompts of {cap} tokens leave no room for rollout.max_new_tokens: {reason}; "
                          f"use max_prompt_tokens <= {limit} or fewer max_new_tokens")
    if limit < 1:
        raise ConfigError("rollout.max_new_tokens", job.rollout.max_new_tokens,
                          f"no room is left for a prompt: {reason}; use fewer max_new_tokens")
    try:
        examples = ExampleFile(file, prompt_format(job, tok, limit, reason), key)
        n = len(examples)
        rows = sorted(set(range(min(n, NUM_CHECKED_ROWS))) | set(
            np.random.default_rng([job.data.seed, 0]).permutation(n)[:NUM_CHECKED_ROWS].tolist()))
        overlong = 0
        for i in rows:
            try:
                examples[i]
            except OverlongPrompt:
                if job.data.overlong_prompts != "drop":
                    raise
                overlong += 1
    except (ValueError, OSError) as exc:
        raise ConfigError(key, value, _strip_prefix(str(exc), key, str(file))) from None
    if overlong == len(rows):
        raise ConfigError(key, value, f"every checked row ({len(rows)}) is over {reason}, so "
                                      "data.overlong_prompts: drop would leave nothing; raise "
                                      "data.max_prompt_tokens or shorten the prompts")
