"""The user-facing configuration error."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad job file or override. The message names the YAML path, the bad value and the fix."""

    def __init__(self, path: str, value: object, hint: str) -> None:
        self.path = path
        self.value = value
        self.hint = hint
        super().__init__(f"{path}={value!r}: {hint}")
