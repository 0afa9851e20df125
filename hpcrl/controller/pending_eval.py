"""An evaluation a preemption cut short, once the resume has run it: RUN_DIR/.pending_eval.json.

A checkpoint saved with its evaluation pending (hpcrl/controller/checkpointing.py, eval_state
"pending") makes the resume run that evaluation first and log it as a record of its own at the
checkpoint's step. Its metrics history cannot hold that record: it was saved before. Should that
attempt end before its next save (killed, failed, out of time), the next resume would run the
evaluation again and log its record twice, where metrics.jsonl is not rewritten from the history:
in TensorBoard (whose purge keeps the checkpoint's step) and in the W&B run it continues. So the
attempt that ran it writes the record here, with the checkpoint it resumed from (a digest of the
checkpoint's metadata, which is unique to each save), and a resume from that same checkpoint takes
the record from here instead of evaluating again. The next save removes the file: its own checkpoint
holds the record in its history.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

FILE = ".pending_eval.json"


def checkpoint_digest(meta: dict[str, Any]) -> str:
    """A checkpoint's identity: the sha256 of its metadata (step, config, metrics history with times)."""
    return hashlib.sha256(json.dumps(meta, sort_keys=True, default=str).encode()).hexdigest()


def record_done(run_dir: Path, checkpoint: str, step: int, record: dict[str, Any], eval_state: dict) -> None:
    """The evaluation after `step` of `checkpoint` ran and logged `record` (atomically written)."""
    path = Path(run_dir) / FILE
    tmp = path.with_name(FILE + ".tmp")
    tmp.write_text(json.dumps({"checkpoint": checkpoint, "step": step, "record": record,
                               "eval_state": eval_state}))
    os.replace(tmp, path)


def done(run_dir: Path, checkpoint: str, step: int) -> dict[str, Any] | None:
    """{"record", "eval_state"} of the evaluation after `step` when an attempt that resumed from
    `checkpoint` ran it; None otherwise (no file, another checkpoint, an unreadable file)."""
    try:
        saved = json.loads((Path(run_dir) / FILE).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(saved, dict) or saved.get("checkpoint") != checkpoint or saved.get("step") != step:
        return None
    return {"record": saved["record"], "eval_state": saved["eval_state"]}


def forget(run_dir: Path) -> None:
    """After a save: its checkpoint's history holds the record."""
    (Path(run_dir) / FILE).unlink(missing_ok=True)
