"""The run's latest complete checkpoint step, for the batch script's requeue cap.

    python -P -m launch.checkpoint_step CKPT_DIR      # prints the step, or 'none'

The Slurm batch script runs it when an attempt starts and again when the step asks to be requeued.
An attempt after which the latest complete checkpoint is still the one it started from made no
progress, and more than `SlurmJobSpec.max_requeues` such requeues in a row stop the job instead of
requeueing it forever (slurm_templates/_common.sbatch.j2). Reads the checkpoint store's catalog
only (`checkpoints.latest_step`: no torch, about 0.25 s); launch imports nothing from hpcrl.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any


def checkpoint_dir(job: Any, run_dir: Path) -> Path:
    """Where the run's checkpoints go: checkpoint.dir, or RUN_DIR/checkpoints."""
    return Path(job.checkpoint.dir) if job.checkpoint.dir else run_dir / "checkpoints"


RUN_ID_FILE = ".run_id"
"""The run's identity, made with its run dir (hpcrl/runner.py prepare_run_dir) and recorded in each of
its checkpoints: whichever path a node mounts the run dir under, another run's checkpoint in a shared
checkpoint.dir is told apart (hpcrl/runner.py check_resume)."""


def run_id(run_dir: Path) -> str | None:
    """The run dir's identity, or None before its first run (or for run dirs older than it)."""
    try:
        return (Path(run_dir) / RUN_ID_FILE).read_text().strip() or None
    except FileNotFoundError:
        return None


def checkpoint_step_command(python: str, ckpt_dir: str) -> str:
    """The command line the batch script runs (`SlurmJobSpec.checkpoint_step_command`). `-P`: the
    job runs in the run dir, whose `checkpoints/` folder would shadow the `checkpoints` package."""
    return f"{shlex.quote(python)} -P -m launch.checkpoint_step {shlex.quote(ckpt_dir)}"


def main(argv: list[str]) -> int:
    """Print the latest complete step under `argv[0]`, or 'none' when it holds no checkpoint."""
    if len(argv) != 1:
        print("usage: python -m launch.checkpoint_step CKPT_DIR", file=sys.stderr)
        return 2
    from checkpoints import latest_step

    step = latest_step(argv[0])
    print("none" if step is None else step)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
