"""Weights & Biases logging of the metrics records (`logging.wandb_project`), beside metrics.jsonl
and TensorBoard (hpcrl/controller/metrics.py).

Each record goes to W&B as one `log` call with its numeric metrics and its `step`, a metric of its
own that is every other metric's x axis: W&B's internal step must only grow, while hpcrl's steps
start at -1 (eval.before_train's record) and go back on a resume.

RUN_DIR/.wandb.json keeps the W&B run's id, project, entity and the last step it logged. Online, a
requeued or resumed run continues that W&B run (wandb's resume), after logging the records of the
restored metrics history W&B lacks. A new W&B run starts (same name), fed the restored history
first, so that each W&B run shows one whole trajectory as metrics.jsonl does:
- when the W&B run already has steps this run will log again (an earlier attempt logged past the
  checkpoint it resumes from, or a rerun from step 0): W&B cannot take a logged step back;
- when the project or entity changed;
- offline (WANDB_MODE=offline): wandb cannot resume offline runs (a second offline run under one id
  starts its own step count, and `wandb sync` of both can replace the first's history), so each
  attempt's offline run is whole by itself, and the last one is the run's.
The W&B run ends with the run's exit code (a failed or preempted run is not shown as finished).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

STATE_FILE = ".wandb.json"
RECORD_KEYS = ("step", "time")  # a metrics record's own keys: `step` is logged as the x axis


class WandbError(RuntimeError):
    """wandb does not import or wandb.init failed: the message says what to set."""


def numeric(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics a chart can show: numbers, not bools (as TensorBoard gets them)."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


def continues(state: dict[str, Any] | None, where: dict[str, Any], offline: bool, first_step: int) -> bool:
    """Whether an attempt whose first step is `first_step` continues the W&B run RUN_DIR/.wandb.json
    records (`state`): online, in the same project and entity (`where`), when that run has logged
    no step from `first_step` on (see the module docstring)."""
    if state is None or offline or any(state.get(k) != v for k, v in where.items()):
        return False
    last = state.get("last_step")
    return last is None or last < first_step


class WandbLog:
    """The run dir's W&B run, opened on the controller once the resume step is known.

    `first_step`: the first step this run logs (-1 when it starts from step 0: eval.before_train's
    record may come); `history`: the metrics records restored from the checkpoint (metrics.jsonl)."""

    def __init__(self, project: str, name: str | None, run_dir: Path, config: dict[str, Any], first_step: int,
                 history: list[dict[str, Any]]) -> None:
        try:
            import wandb

            offline = wandb.setup().settings.mode in ("offline", "dryrun")
        except Exception as exc:  # an environment (slurm.python) where wandb is missing or broken
            raise WandbError(f"logging.wandb_project={project!r}: wandb does not import in the controller's "
                             f"environment ({type(exc).__name__}: {exc}); install it there (`bash install.sh "
                             "--wandb`), or logging.wandb_project: null") from None
        self.path = Path(run_dir) / STATE_FILE
        state = json.loads(self.path.read_text()) if self.path.is_file() else None
        self._where = {"project": project, "entity": os.environ.get("WANDB_ENTITY")}
        self.continued = continues(state, self._where, offline, first_step)
        self.run_id = state["id"] if self.continued else uuid.uuid4().hex[:16]
        self.last_step: int | None = state["last_step"] if self.continued else None
        try:
            self._run = wandb.init(project=project, name=name or Path(run_dir).name, id=self.run_id,
                                   resume="allow", dir=str(run_dir), config=config,
                                   settings=wandb.Settings(console="off"))  # hpcrl's output stays its own
        except Exception as exc:  # wandb's own errors, and others from its service
            raise WandbError(f"logging.wandb_project={project!r}: wandb.init failed ({type(exc).__name__}: "
                             f"{exc}); without a login set WANDB_API_KEY (wandb login), and on nodes without "
                             "internet WANDB_MODE=offline (then `wandb sync RUN_DIR/wandb/offline-run-*`)") from None
        self._run.define_metric("step")
        self._run.define_metric("*", step_metric="step")
        self._save()
        for record in history:  # what this W&B run lacks of the restored history
            self.log(record["step"], record)

    def _save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps({"id": self.run_id, **self._where, "last_step": self.last_step}))
        os.replace(tmp, self.path)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        evaluation_only = "timing/step_s" not in metrics  # a resume's pending evaluation: a row of its own
        if self.last_step is not None and (step < self.last_step or step == self.last_step and not evaluation_only):
            return  # logged before this attempt (a continued W&B run has the history up to it)
        self._run.log({**{k: v for k, v in numeric(metrics).items() if k not in RECORD_KEYS}, "step": step})
        self.last_step = step
        self._save()

    def close(self, wait_s: float | None = None, exit_code: int = 0) -> None:
        """Finish the W&B run with the run's exit code (its service writes and uploads what is left);
        with `wait_s`, wait at most that long (a run being aborted: an upload that hangs must not hold
        the abort)."""
        if wait_s is None:
            self._run.finish(exit_code=exit_code)
            return
        finishing = threading.Thread(target=self._run.finish, kwargs={"exit_code": exit_code}, daemon=True)
        finishing.start()
        finishing.join(wait_s)
