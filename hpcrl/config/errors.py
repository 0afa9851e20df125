"""The user-facing configuration error, and the helpers its messages share."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A bad job file or override. The message names the YAML path, the bad value and the fix."""

    def __init__(self, path: str, value: object, hint: str) -> None:
        self.path = path
        self.value = value
        self.hint = hint
        super().__init__(f"{path}={value!r}: {hint}")


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the closest of `choices`, or '' when none is close."""
    close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def job_field(job: Any, path: str) -> Any:
    """The value at a dotted YAML path of a JobConfig ("algorithm.lr")."""
    obj: Any = job
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
