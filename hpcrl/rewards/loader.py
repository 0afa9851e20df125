"""Resolve `reward.fn` (a built-in name or `package.module:function`) to a checked callable."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from hpcrl.rewards.builtin import BUILTIN_REWARDS
from hpcrl.rewards.protocol import RewardFn
from hpcrl.user_module import import_user_module

SIGNATURE = ("def reward(prompt: str, completion: str, answer: str, extra: dict | None = None) -> float"
             " (the form without `extra` is accepted too, and verl's compute_score(data_source, solution_str, "
             "ground_truth, extra_info=None))")


class _Adapted:
    """A user function called through the four-argument protocol, keeping its name and `warm_up`."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.__name__ = getattr(fn, "__name__", repr(fn))
        if callable(getattr(fn, "warm_up", None)):
            self.warm_up = fn.warm_up


class _WithoutExtra(_Adapted):
    """Adapts a three-argument reward to the four-argument protocol (drops `extra`)."""

    def __call__(self, prompt: str, completion: str, answer: str,
                 extra: dict[str, Any] | None = None) -> float:
        return self.fn(prompt, completion, answer)


VERL_PARAMS = ("data_source", "solution_str", "ground_truth", "extra_info")
"""The keywords verl's reward managers call `compute_score` with (NaiveRewardManager)."""


class _VerlScore(_Adapted):
    """Adapts a verl `compute_score(data_source, solution_str, ground_truth, extra_info=None, ...)`:
    called by keyword, as verl's reward manager calls it, with the row's verl columns
    (`data_source`, `reward_model.ground_truth` as stored, `extra_info`; the answer text and None
    where a row lacks them) and the decoded completion (special tokens skipped, as verl decodes).
    A dict result is its "score" (verl's rule); `score_item` reads it."""

    def __init__(self, fn: Callable[..., Any], names: tuple[str, ...]) -> None:
        super().__init__(fn)
        self.names = names

    def __call__(self, prompt: str, completion: str, answer: str, extra: dict[str, Any] | None = None) -> Any:
        row = extra or {}
        model = row.get("reward_model")
        truth = model["ground_truth"] if isinstance(model, dict) and "ground_truth" in model else answer
        values = {"data_source": row.get("data_source"), "solution_str": completion, "ground_truth": truth,
                  "extra_info": row.get("extra_info")}
        return self.fn(**{k: values[k] for k in self.names})


def _verl_params(fn: Callable[..., Any]) -> tuple[str, ...] | None:
    """The verl keywords to call `fn` with when its parameters are verl's (solution_str and
    ground_truth among them, every required one a verl keyword), else None."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return None
    if not {"solution_str", "ground_truth"} <= set(params):
        return None
    named = [p for p in params.values() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.default is p.empty and p.name not in VERL_PARAMS for p in named):
        return None
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return VERL_PARAMS
    return tuple(k for k in VERL_PARAMS if k in params)


def _takes_extra(fn: Callable[..., Any], spec: str, name: str) -> bool:
    """True if `fn` accepts `extra=`, False if it only takes (prompt, completion, answer); ValueError
    with the expected signature if it takes neither."""
    sig = inspect.signature(fn)
    try:
        sig.bind("prompt", "completion", "answer", extra={})
        return True
    except TypeError:
        pass
    try:
        sig.bind("prompt", "completion", "answer")
        return False
    except TypeError:
        raise ValueError(f"reward.fn={spec!r}: {name}{sig} cannot be called as `{SIGNATURE}`") from None


def load_reward_fn(spec: str) -> RewardFn:
    """Return the reward callable named by `spec`, always callable with `extra` (a three-argument
    function is wrapped once, here); ValueError with the fix when it cannot be used."""
    if spec in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[spec]
    builtins = ", ".join(sorted(BUILTIN_REWARDS))
    if ":" not in spec:
        raise ValueError(f"reward.fn={spec!r} is neither a built-in reward ({builtins}) nor an import path "
                         f"'package.module:function' of a function `{SIGNATURE}`")
    module_name, _, attr = spec.partition(":")
    module = import_user_module(module_name, f"reward.fn={spec!r}",
                                f"put it on PYTHONPATH or use a built-in reward ({builtins})")
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(f"reward.fn={spec!r}: module {module_name!r} has no function {attr!r}")
    if inspect.iscoroutinefunction(fn) or inspect.isgeneratorfunction(fn) or inspect.isasyncgenfunction(fn):
        kind = "an async function" if inspect.iscoroutinefunction(fn) else "a generator function"
        raise ValueError(f"reward.fn={spec!r}: {attr!r} is {kind}, whose call returns no number (every "
                         f"completion would score 0); define a plain `{SIGNATURE}` that returns a float")
    verl = _verl_params(fn)
    if verl is not None:
        return _VerlScore(fn, verl)
    return fn if _takes_extra(fn, spec, attr) else _WithoutExtra(fn)
