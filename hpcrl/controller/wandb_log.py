"""Weights & Biases logging of the metrics records (`logging.wandb_project`), beside metrics.jsonl
and TensorBoard (hpcrl/controller/metrics.py).

Each record goes to W&B as one `log` call with its numeric metrics and its `step`, a metric of its
own that is every other metric's x axis: W&B's internal step must only grow, while hpcrl's steps
start at -1 (eval.before_train's record) and go back on a resume.

RUN_DIR/.wandb.json keeps the W&B run's id and the last step it logged, so a requeued or resumed
run continues the same W&B run, after logging the records of metrics.jsonl that W&B lacks. W&B
cannot take a logged step back: when the W&B run already has steps this run will log again (an
earlier attempt logged past the checkpoint it resumes from, or a rerun from step 0), a new W&B run
starts (same name) and gets the restored metrics history first, so each W&B run shows one
trajectory, as metrics.jsonl does.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

STATE_FILE = ".wandb.json"


class WandbError(RuntimeError):
    """wandb.init failed (no API key, no network): the message says what to set."""


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a chart can show: numbers, not bools (as TensorBoard gets them)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class WandbLog:
    """The run dir's W&B run, opened on the controller once the resume step is known.

    `first_step`: the first step this run logs (-1 when it starts from step 0: eval.before_train's
    record may come); `history`: the metrics records restored from the checkpoint (metrics.jsonl)."""

    def __init__(self, project: str, name: str | None, run_dir: Path, config: dict[str, Any], first_step: int,
                 history: list[dict[str, Any]]) -> None:
        import wandb

        self.path = Path(run_dir) / STATE_FILE
        state = json.loads(self.path.read_text()) if self.path.is_file() else None
        last = None if state is None else state.get("last_step")
        self.continued = state is not None and (last is None or last < first_step)
        self.run_id = state["id"] if self.continued else uuid.uuid4().hex[:16]
        self.last_step: int | None = last if self.continued else None
        try:
            self._run = wandb.init(project=project, name=name or Path(run_dir).name, id=self.run_id,
                                   resume="allow", dir=str(run_dir), config=config,
                                   settings=wandb.Settings(console="off"))  # hpcrl's output stays its own
        except Exception as exc:  # wandb's own errors, and others from its service
            raise WandbError(f"logging.wandb_project={project!r}: wandb.init failed ({type(exc).__name__}: "
                             f"{exc}); set WANDB_API_KEY (wandb login), or WANDB_MODE=offline on nodes without "
                             "internet (then `wandb sync RUN_DIR/wandb/offline-run-*`)") from None
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self._save()
        for record in history:  # what this W&B run lacks of the restored history
            self.log(record["step"], record)

    def _save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"id": self.run_id, "last_step": self.last_step}))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if self.last_step is not None and step <= self.last_step:
            return  # logged before this attempt (a continued W&B run has the history up to it)
        self._run.log({**{k: v for k, v in numeric(metrics).items() if k != "time"}, "step": step})
        self.last_step = step
        self._save()

    def close(self, wait_s: float | None = None) -> None:
        """Finish the W&B run (its service writes and uploads what is left); with `wait_s`, wait at
        most that long (a run being aborted: an upload that hangs must not hold the abort)."""
        if wait_s is None:
            self._run.finish()
            return
        finishing = threading.Thread(target=self._run.finish, daemon=True)
        finishing.start()
        finishing.join(wait_s)
