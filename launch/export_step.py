"""Export a finished run's final checkpoint at the end of its job: the first half of a pipeline.

A job submitted with an export dir (`hpcrl.jobs.Executor.submit(..., export_to=DIR)`) runs, in the
batch script's finish step, after the step's final exit and before the result file is written:

    python -P -m launch.export_step RUN_DIR DIR "$rc" || rc=$?     # then: python -P -m launch.result ...

When the step exited 0 and RUN_DIR/final.json exists, it runs `hpcrl export RUN_DIR --step LAST
--out DIR` (LAST = final.json's num_steps - 1) with the job's Python, its output in the batch log.
Exit 0 when there was nothing to export (the run failed: the result file says why) or the export
succeeded; `EXPORT_FAILED_EXIT_CODE` when it failed, which the finish step makes the job's exit
code, so the job ends FAILED and a job waiting on it with afterok never starts. It records what
happened in RUN_DIR/.export.json ({"out", "rc", "step"}), which launch/result.py reads. Runs hpcrl
as a subprocess: launch imports nothing from hpcrl.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from launch.result import EXPORT_FAILED_EXIT_CODE, EXPORT_FILE, FINAL_FILE, read_json


def export_command(python: str, run_dir: Path, out_dir: Path) -> str:
    """`SlurmJobSpec.export_command`: export, and on failure make the export's exit code the job's
    (`rc`, the batch script's variable holding the step's exit code)."""
    q = shlex.quote
    return f'{q(python)} -P -m launch.export_step {q(str(run_dir))} {q(str(out_dir))} "$rc" || rc=$?'


def export_final(run_dir: Path, out_dir: Path, rc: int) -> int:
    """Export the finished run (see the module docstring); returns the exit code to use."""
    final = read_json(run_dir / FINAL_FILE)
    (run_dir / EXPORT_FILE).unlink(missing_ok=True)
    if rc != 0 or not isinstance(final, dict):
        print(f"[hpcrl-batch] not exporting to {out_dir}: the run did not finish (step exit code {rc})",
              flush=True)
        return 0
    step = final.get("num_steps")
    argv = [sys.executable, "-P", "-m", "hpcrl.cli", "export", str(run_dir), "--out", str(out_dir)]
    if isinstance(step, int) and step > 0:
        argv += ["--step", str(step - 1)]
    print(f"[hpcrl-batch] exporting the final checkpoint: {shlex.join(argv)}", flush=True)
    code = subprocess.run(argv, stdin=subprocess.DEVNULL).returncode
    record = {"out": str(out_dir), "rc": code, "step": None if step is None else step - 1}
    (run_dir / EXPORT_FILE).write_text(json.dumps(record) + "\n")
    if code != 0:
        print(f"[hpcrl-batch] hpcrl export failed with exit code {code}; the job fails with "
              f"{EXPORT_FAILED_EXIT_CODE}", flush=True)
        return EXPORT_FAILED_EXIT_CODE
    print(f"[hpcrl-batch] exported to {out_dir}", flush=True)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        print("usage: python -m launch.export_step RUN_DIR OUT_DIR RC", file=sys.stderr)
        sys.exit(2)
    sys.exit(export_final(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
