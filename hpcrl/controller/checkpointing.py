"""The controller's checkpoint seam.

The loop calls `resume_step()` once and `maybe_save(step)` after every step; the checkpointer
decides whether a step saves. This version keeps no state: runs start at step 0 and nothing is
saved. The sharded HDF5 store with resume and preemption handling (issue 4) plugs in here without
touching the loop.
"""

from __future__ import annotations


class Checkpointer:
    def __init__(self, interval_steps: int, keep: int) -> None:
        self.interval_steps = interval_steps
        self.keep = keep

    def resume_step(self) -> int:
        """First step to run: 0 for a fresh run."""
        return 0

    def maybe_save(self, step: int) -> None:
        """Save after `step` when the schedule asks for it (no store yet: nothing to do)."""
