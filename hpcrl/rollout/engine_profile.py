"""The reference engine's `/start_profile` and `/stop_profile`, as SGLang 0.5.23 serves them
(srt/entrypoints/http_server.py, srt/managers/tokenizer_control_mixin.py and
srt/managers/scheduler_components/profiler_manager.py; checked by tests/conformance):

- start: a ProfileReq body (all fields optional). `output_dir` defaults to $SGLANG_TORCH_PROFILER_DIR
  or /tmp, `activities` to ["CPU", "GPU"], `profile_id` to str(time.time()); `with_stack` and
  `record_shapes` are on unless false. Answer 200, text "Start profiling.\\n". A start while one is
  in progress: SGLang's message "Profiling is already in progress. Call /stop_profile first.",
  raised as a RuntimeError in SGLang (HTTP 500).
- stop: the trace goes to `output_dir/[<profile_prefix>-]<profile_id>-TP-0.trace.json.gz` (SGLang adds
  DP/PP/EP parts only above size 1); answer 200, text "Stop profiling. This will take some time.\\n".
  Without a profile in progress: "Profiling is not in progress. Call /start_profile first." (500).

SGLang profiles its scheduler's forward batches; the reference engine its `_run_batch` calls, each
in a torch.profiler session of its own (torch records the ops of the thread that started it, and
each batch runs on its request's thread), merged into one trace at stop: the sessions share one
clock. What SGLang has and this engine does not serve (a start or step count, stages, merged
profiles, the MEM/RPD/CUDA_PROFILER activities) is refused with 400, not ignored.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from hpcrl.profiling import TRACE_SUFFIX, trace_events, write_trace

UNSERVED_FIELDS = ("start_step", "num_steps", "profile_by_stage", "merge_profiles", "profile_stages",
                   "detailed_annotations")
ACTIVITIES = ("CPU", "GPU")


class ProfileRefused(Exception):
    """A profile request SGLang would refuse (`status` 500: its RuntimeError) or this engine cannot serve (400)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


class EngineProfile:
    """One profile at a time; `traced()` wraps each forward batch."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self._on: dict | None = None  # the profile in progress: its settings and the events so far
        self._lock = threading.Lock()  # start and stop come on request threads

    def start(self, req: dict) -> str:
        """Trace the batches that start from now (a batch running now is not: SGLang's trace, too,
        begins at its next forward step)."""
        with self._lock:
            return self._start(req)

    def _start(self, req: dict) -> str:
        for key in UNSERVED_FIELDS:
            if req.get(key) not in (None, False, [], 0):
                raise ProfileRefused(f"/start_profile field {key!r} is not supported by the reference engine; "
                                     "start and stop the profile around what to trace", 400)
        asked = req.get("activities") or ["CPU", "GPU"]
        other = [a for a in asked if a not in ACTIVITIES]
        if other:
            raise ProfileRefused(f"/start_profile activities {other} are not supported by the reference engine; "
                                 f"it records {list(ACTIVITIES)}", 400)
        if self._on is not None:
            raise ProfileRefused("Profiling is already in progress. Call /stop_profile first.", 500)
        activities = [torch.profiler.ProfilerActivity.CPU] if "CPU" in asked else []
        if "GPU" in asked and self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._on = {"dir": Path(req.get("output_dir") or os.environ.get("SGLANG_TORCH_PROFILER_DIR", "/tmp")
                                ).expanduser(),
                    "id": str(req.get("profile_id") or time.time()), "prefix": req.get("profile_prefix") or "",
                    "activities": activities, "with_stack": req.get("with_stack") is not False,
                    "record_shapes": req.get("record_shapes") is not False, "trace": None}
        return "Start profiling.\n"

    @contextlib.contextmanager
    def traced(self) -> Iterator[None]:
        """Profile what runs inside, when a profile is in progress (the caller holds the model lock)."""
        on = self._on
        if on is None or not on["activities"]:
            yield
            return
        with torch.profiler.profile(activities=on["activities"], with_stack=on["with_stack"],
                                    record_shapes=on["record_shapes"]) as prof:
            yield
        trace = trace_events(prof)
        if on["trace"] is None:
            on["trace"] = trace
        else:
            on["trace"]["traceEvents"] += trace["traceEvents"]

    def stop(self) -> str:
        """Write the trace (the caller holds the model lock: a batch running now is in it, whole)."""
        with self._lock:
            on, self._on = self._on, None
        if on is None:
            raise ProfileRefused("Profiling is not in progress. Call /start_profile first.", 500)
        name = (f"{on['prefix']}-" if on["prefix"] else "") + f"{on['id']}-TP-0{TRACE_SUFFIX}"
        write_trace(on["dir"] / name, on["trace"] or {"traceEvents": []})
        return "Stop profiling. This will take some time.\n"
