"""Per-step metrics: RUN_DIR/metrics.jsonl, TensorBoard event files, W&B (logging.wandb_project,
hpcrl/controller/wandb_log.py) and a progress bar.

One JSON object per step, flushed at once (a crash loses nothing already logged). Keys use the
`group/name` convention: `reward/mean`, `reward/std`, `reward/errors` (completions whose reward
raised or timed out, scored 0), `data/dropped_prompts` (overlong rows skipped while drawing the
step's prompts, `data.overlong_prompts: drop`), `dynamic_sampling/*` (dapo), `rollout/*`,
`train/*`, `sync/*`, `timing/*_s` (`timing/save_s`: the checkpoint save after the previous step);
at evaluation steps also `val/*` (per data source too) and `timing/eval_s`
(hpcrl/controller/evaluation.py; `eval.before_train`'s record is step -1). TensorBoard gets every
numeric key as a scalar at its step, all of a step's scalars in one event (`tensorboard_summary`:
one `add_scalar` per key cost ~0.5-1 ms per step on the controller's critical path, one event
~0.06 ms; benchmarks/small_kernels.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any


class MetricsLogger:
    """Writes each step's metrics to jsonl and TensorBoard and advances the progress bar."""

    def __init__(self, run_dir: Path, num_steps: int, start_step: int = 0, tensorboard: bool = True,
                 progress: bool = True, wandb: Any = None) -> None:
        self.path = run_dir / "metrics.jsonl"
        self._wandb = wandb  # a WandbLog (logging.wandb_project, hpcrl/controller/wandb_log.py) or None
        self._file = self.path.open("a")
        self._tb = None
        if tensorboard:
            from torch.utils.tensorboard.writer import FileWriter

            earlier = any((run_dir / "tensorboard").glob("events.out.tfevents.*"))
            self._tb = FileWriter(str(run_dir / "tensorboard"))
            if start_step > 0 or earlier:  # hide the events of steps >= start_step an earlier attempt wrote
                _purge_from(self._tb, start_step or -1)  # (from -1, eval.before_train's, when it saved no
                # checkpoint: its metrics.jsonl was set aside)
        self._bar = None
        self._val = ""  # the last evaluation's val/reward_mean, shown until the next one
        if progress:
            from tqdm import tqdm

            self._bar = tqdm(total=num_steps, initial=start_step, desc="hpcrl", unit="step",
                             file=sys.stderr, dynamic_ncols=True, mininterval=0.5)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Write `step`'s record (returned: metrics.jsonl's line)."""
        record = {"step": step, "time": round(time.time(), 3), **metrics}
        self._file.write(json.dumps(record, sort_keys=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            self._tb.add_summary(tensorboard_summary(metrics), step)
        if self._wandb is not None:
            self._wandb.log(step, metrics)
        if self._bar is not None:
            postfix = {"reward": f"{metrics['reward/mean']:.3f}"} if "reward/mean" in metrics else \
                {"nll": f"{metrics['train/nll']:.3f}"} if "train/nll" in metrics else {}  # sft scores nothing
            if "timing/step_s" in metrics:  # not in eval.before_train's record (step -1)
                postfix["step_s"] = f"{metrics['timing/step_s']:.2f}"
            if "val/reward_mean" in metrics:
                self._val = f"{metrics['val/reward_mean']:.3f}"
            if self._val:
                postfix["val"] = self._val
            self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(1 if "timing/step_s" in metrics else 0)  # an evaluation's own record: no step
        return record

    def close(self, wandb_wait_s: float | None = None, exit_code: int = 0) -> None:
        """Close every log; W&B's with the run's exit code, within `wandb_wait_s` when given (a run
        being aborted)."""
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.close(wandb_wait_s, exit_code)
        self._file.close()


def _purge_from(writer, step: int) -> None:
    """TensorBoard's restart marker (what SummaryWriter(purge_step=step) writes): readers drop the
    events of `step` and later from the files before it, as metrics.jsonl is rewritten on resume."""
    from tensorboard.compat.proto.event_pb2 import Event, SessionLog

    writer.add_event(Event(step=step, file_version="brain.Event:2"))
    writer.add_event(Event(step=step, session_log=SessionLog(status=SessionLog.START)))


def tensorboard_summary(metrics: dict[str, Any]):
    """One TensorBoard `Summary` holding every numeric (not bool) metric as a scalar under its key:
    what `SummaryWriter.add_scalar` writes per key (`simple_value`), in a single event."""
    from tensorboard.compat.proto.summary_pb2 import Summary

    return Summary(value=[Summary.Value(tag=key, simple_value=float(value)) for key, value in metrics.items()
                          if isinstance(value, (int, float)) and not isinstance(value, bool)])


def set_aside_metrics(run_dir: Path) -> Path | None:
    """Before a fresh run's first step: an earlier attempt's RUN_DIR/metrics.jsonl (one that stopped
    before its first checkpoint) is renamed to metrics.jsonl.N, the first N free, so the new run's
    records do not follow the old ones in one file and none is lost; returns the new path, or None
    when there was nothing to move."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists() or path.stat().st_size == 0:
        return None
    n = 1
    while path.with_name(f"metrics.jsonl.{n}").exists():
        n += 1
    return path.rename(path.with_name(f"metrics.jsonl.{n}"))


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """All records of RUN_DIR/metrics.jsonl, in order."""
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
