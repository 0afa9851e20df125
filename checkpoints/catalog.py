"""Which checkpoints exist: complete steps, the `latest` pointer, retention and discarding.

A step is complete when its directory holds `manifest.json`; directories without one are
leftovers of an interrupted save and are invisible to readers. The newest complete step is the
latest checkpoint; the `latest` file names it for people and tools (it lags by one only after a
crash between a manifest rename and the pointer update). Resuming from an older step must discard
the newer ones (`discard_newer`), which keeps "newest complete" meaning "latest".
"""

from __future__ import annotations

import os

from .store import LATEST, MANIFEST, ShardStore, as_store


def list_checkpoints(store: ShardStore | str | os.PathLike[str]) -> list[int]:
    """The steps of all complete checkpoints, ascending."""
    s = as_store(store)
    return [step for step in s.list_steps() if MANIFEST in s.list_names(step)]


def latest_step(store: ShardStore | str | os.PathLike[str]) -> int | None:
    """The newest complete step, or None if there is none.

    The `latest` file names the same step, except right after a crash between a manifest's
    rename and the pointer's update, when it still names the previous (also complete) step: the
    manifest rename is the commit point, so the newest complete step wins.
    """
    complete = list_checkpoints(store)
    return complete[-1] if complete else None


def latest_pointer(store: ShardStore | str | os.PathLike[str]) -> int | None:
    """The step the `latest` file names (for tools that read it), or None if it is absent."""
    s = as_store(store)
    text = s.get_text(None, LATEST)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise ValueError(f"{s.location(None, LATEST)} holds {text[:40]!r}, not a step number; "
                         f"delete it (the next commit rewrites it)") from None


def apply_retention(store: ShardStore | str | os.PathLike[str], keep_last: int,
                    *, below_step: int | None = None) -> list[int]:
    """Delete all but the `keep_last` newest complete checkpoints; return the removed steps.

    The checkpoint `latest` names is never deleted. Incomplete directories with a step below
    `below_step` (rank 0 passes the step it just committed) are deleted too: no save of an older
    step can still be running once a newer one committed, if callers wait() between saves.
    """
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an int >= 1, got {keep_last!r}")
    s = as_store(store)
    complete = list_checkpoints(s)
    keep = set(complete[-keep_last:])
    try:
        pointer = latest_pointer(s)
    except ValueError:
        pointer = None
    if pointer is not None:
        keep.add(pointer)
    removed = []
    for step in s.list_steps():
        stale = step not in complete and below_step is not None and step < below_step
        if (step in complete and step not in keep) or stale:
            s.remove(step)
            removed.append(step)
    return removed


def discard_newer(store: ShardStore | str | os.PathLike[str], step: int) -> list[int]:
    """Delete every checkpoint directory (complete or not) with a step above `step`.

    Call it when resuming from an older step (`--resume-from`), so the abandoned timeline's
    checkpoints neither block new saves of the same steps nor count against retention. `latest`
    is pointed at `step` first, so a crash midway leaves a consistent store.
    """
    s = as_store(store)
    if step not in list_checkpoints(s):
        raise ValueError(f"step {step} is not a complete checkpoint in {s.location(None, '')}; "
                         f"complete: {list_checkpoints(s)}")
    s.put_text(None, LATEST, f"{step}\n")
    removed = [t for t in s.list_steps() if t > step]
    for t in removed:
        s.remove(t)
    return removed


def read_metadata(store: ShardStore | str | os.PathLike[str], step: int) -> dict:
    """The JSON metadata of committed checkpoint `step` (its manifest only: no torch, no tensor
    file opened); ValueError when the step has no manifest or a damaged one."""
    from .manifest import Manifest

    text = as_store(store).get_text(step, MANIFEST)
    if text is None:
        raise ValueError(f"checkpoint step {step} has no {MANIFEST}")
    return Manifest.from_text(text).metadata

