"""Fault injection for tests.

HPCRL_FAULT="<rank>:<op>:<exit|crash|hang>" makes MPI rank <rank> exit(0), raise, or hang when it
receives the controller's command <op>. Generation requests go from the controller straight to the
engines (no command to the rollout rank), so for op `generate` a rollout rank hands the action to
the engine server it launches (HPCRL_ENGINE_FAULT=<action>), which injects it on /generate.
"""

from __future__ import annotations

import os
import time

ACTIONS = ("exit", "crash", "hang")


def planned(rank: int, op: str) -> str | None:
    """The action HPCRL_FAULT asks of this rank at this op, or None."""
    spec = os.environ.get("HPCRL_FAULT", "")
    if not spec:
        return None
    f_rank, f_op, action = spec.split(":")
    if action not in ACTIONS:
        raise ValueError(f"HPCRL_FAULT={spec!r}: the action must be one of {ACTIONS}")
    return action if int(f_rank) == rank and f_op == op else None


def inject(action: str | None, op: str) -> None:
    """Exit, raise or hang as `action` says (nothing when None)."""
    if action is None:
        return
    print(f"HPCRL_FAULT: injecting {action} at {op}", flush=True)
    if action == "exit":
        os._exit(0)
    if action == "crash":
        raise RuntimeError(f"HPCRL_FAULT injected crash in {op}")
    while True:  # hang
        time.sleep(1)
