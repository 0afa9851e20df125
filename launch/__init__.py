"""launch: executors that start one hpcrl MPI world (local mpiexec, Slurm hetjob), signals, requeue.

The public surface is `__all__`: the Slurm executor and its job (submitit classes), the local twin,
the rendered-job plan and spec, and the error type. Names are imported on first use, so the ranks'
`import launch.procs` does not pay for submitit (about 80 ms).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from launch.local_job import LocalRunExecutor, LocalRunJob
    from launch.result import run_summary
    from launch.slurm_executor import HetJob, HetJobExecutor
    from launch.slurm_query import SlurmError
    from launch.slurm_runs import resolve_job
    from launch.slurm_spec import SlurmComponent, SlurmJobSpec, render
    from launch.slurm_submit import SubmitPlan, plan_submission, submit_run

_HOMES = {
    "HetJob": "launch.slurm_executor",
    "HetJobExecutor": "launch.slurm_executor",
    "LocalRunExecutor": "launch.local_job",
    "LocalRunJob": "launch.local_job",
    "SlurmComponent": "launch.slurm_spec",
    "SlurmError": "launch.slurm_query",
    "SlurmJobSpec": "launch.slurm_spec",
    "SubmitPlan": "launch.slurm_submit",
    "plan_submission": "launch.slurm_submit",
    "render": "launch.slurm_spec",
    "resolve_job": "launch.slurm_runs",
    "run_summary": "launch.result",
    "submit_run": "launch.slurm_submit",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'launch' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
