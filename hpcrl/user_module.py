"""Importing a module a job file names (reward.fn, algorithm.name, a loss): every failure is a
ValueError naming the job's key and the module, never a traceback from inside the user's code.

    module = import_user_module("my_pkg.rewards", "reward.fn='my_pkg.rewards:score'",
                                "put it on PYTHONPATH")

An ImportError says what could not be imported and `fix`; anything else the module raises while it
is imported (a SyntaxError, an exception at module level, a sys.exit() there) is named with its
type, message and the file and line it came from.
"""

from __future__ import annotations

import importlib
import traceback
from types import ModuleType


def import_user_module(name: str, what: str, fix: str, missing: str | None = None) -> ModuleType:
    """`importlib.import_module(name)`; ValueError starting with `what` when the import fails
    (`missing`, when given, instead of `what` where the module is not found)."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        raise ValueError(f"{missing or what}: cannot import module {name!r} ({exc}); {fix}") from None
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the module's own code failed at import time
        text = exc.msg if isinstance(exc, SyntaxError) else exc  # a SyntaxError's str repeats its position
        raise ValueError(f"{what}: importing module {name!r} raised {type(exc).__name__}: {text}"
                         f"{_where(exc)}; fix the module") from None


def _where(exc: BaseException) -> str:
    """ ' (file:line)' of the failure: a SyntaxError's own position, else the innermost frame."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f" ({exc.filename}:{exc.lineno})"
    frames = traceback.extract_tb(exc.__traceback__)
    return f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
