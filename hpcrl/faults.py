"""Fault injection for tests.

HPCRL_SYNC_FAULT="<skip|perturb>:<weight version>" skips or corrupts one weight push (every trainer
rank), so that tests can show the per-step log-prob check catching a sync that went wrong.

HPCRL_FAULT="<rank>:<op>:<exit|crash|hang>" makes MPI rank <rank> exit(0), raise, or hang when it
receives the controller's command <op>. Generation requests go from the controller straight to the
engines (no command to the rollout rank), so for op `generate` a rollout rank hands the action to
the engine server it launches (HPCRL_ENGINE_FAULT=<action>), which injects it on /generate.
"<rank>:generate:<action>:<weight version>" injects it only on the generations (not the scoring
requests) the engine serves at that weight version: step s samples with version "s-1" (the push
after step s-1; the initial push is "-1"), so "2:generate:hang:3" hangs step 4's generation.
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
    f_rank, f_op, action, *version = spec.split(":")
    if action not in ACTIONS or (version and f_op != "generate") or len(version) > 1:
        raise ValueError(f"HPCRL_FAULT={spec!r}: the action must be one of {ACTIONS}, with a weight version "
                         "for op generate only")
    if int(f_rank) != rank or f_op != op:
        return None
    return ":".join([action, *version])


def engine_fault_due(fault: str | None, weight_version: str, request: dict) -> str | None:
    """The action of HPCRL_ENGINE_FAULT ("<action>[:<weight version>]") due on this /generate
    `request` at the engine's `weight_version`, or None."""
    if not fault:
        return None
    action, _, version = fault.partition(":")
    if version and (version != weight_version or "logprob_start_len" in request):
        return None
    return action


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


SYNC_ACTIONS = ("skip", "perturb")


def planned_sync(weight_version: str) -> str | None:
    """The action HPCRL_SYNC_FAULT="<skip|perturb>:<weight version>" asks of the weight push of that
    version ("-1" is the initial push; step s pushes version "s"), or None. skip: the trainer sends
    nothing; perturb: the push carries one tensor scaled (the trainer's own weights are restored)."""
    spec = os.environ.get("HPCRL_SYNC_FAULT", "")
    if not spec:
        return None
    action, _, version = spec.partition(":")
    if action not in SYNC_ACTIONS:
        raise ValueError(f"HPCRL_SYNC_FAULT={spec!r}: the action must be one of {SYNC_ACTIONS}")
    if version == weight_version:
        print(f"HPCRL_SYNC_FAULT: {action} the weight push of version {version}", flush=True)
        return action
    return None
