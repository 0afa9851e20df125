"""logging.profile_steps: torch.profiler traces of chosen RL steps, in RUN_DIR/profile/step_NNNNNN/.

- `trainer_rank<R>.trace.json.gz`: trainer rank R's ops (CPU, and CUDA kernels on a GPU) from the
  first command of the step to the first command of a later step: its reference/old log-probs,
  updates, weight push and the save after the step (`StepTrace`, in the rank's command loop), each
  command a span named `hpcrl.<command>` (hpcrl.train, hpcrl.sync, ...).
- `engine<I>/step<N>-TP-<t>.trace.json.gz`: engine I's forward batches between the step's start
  and end, through SGLang's own `/start_profile` and `/stop_profile` (SGLang names the file after
  the profile id and its TP rank); the reference engine serves the same two routes.

Chrome trace format (gzip): open it in Perfetto (ui.perfetto.dev) or chrome://tracing.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import tempfile
from pathlib import Path

import torch

TRACE_SUFFIX = ".trace.json.gz"


def step_dir(run_dir: Path, step: int) -> Path:
    """Where step `step`'s traces go."""
    return Path(run_dir) / "profile" / f"step_{step:06d}"


def activities(cuda: bool) -> list:
    """torch.profiler's activities: CPU ops, and CUDA kernels on a GPU."""
    out = [torch.profiler.ProfilerActivity.CPU]
    return out + [torch.profiler.ProfilerActivity.CUDA] if cuda else out


def trace_events(prof: torch.profiler.profile) -> dict:
    """A finished profile's chrome trace as an object (torch writes it only to a file)."""
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return json.loads(Path(path).read_text())
    finally:
        os.unlink(path)


def write_trace(path: Path, trace: dict) -> None:
    """Write a chrome trace, gzipped, atomically (a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with gzip.open(tmp, "wt") as f:
        json.dump(trace, f)
    os.replace(tmp, path)


class StepTrace:
    """A trainer rank's traces of `steps`: `at(step)` before each command, `close()` at shutdown."""

    def __init__(self, steps: list[int], run_dir: Path, rank: int, cuda: bool) -> None:
        self.steps, self.run_dir, self.rank, self.cuda = set(steps), Path(run_dir), rank, cuda
        self._prof: torch.profiler.profile | None = None
        self._step = -1
        self._done: set[int] = set()

    def at(self, step: int) -> None:
        """A command of `step` comes next: end the trace of an earlier step, start this one's."""
        if self._prof is not None and step != self._step:
            self.close()
        if step in self.steps and step not in self._done and self._prof is None:
            self._prof = torch.profiler.profile(activities=activities(self.cuda))
            self._prof.start()
            self._step = step

    def span(self, op: str):
        """A context naming a command's span in the trace (`hpcrl.<op>`), when one is recorded."""
        return torch.profiler.record_function(f"hpcrl.{op}") if self._prof is not None else contextlib.nullcontext()

    def close(self) -> None:
        """Stop the trace in progress, if any, and write it."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.stop()
        self._done.add(self._step)
        write_trace(step_dir(self.run_dir, self._step) / f"trainer_rank{self.rank}{TRACE_SUFFIX}",
                    trace_events(prof))
