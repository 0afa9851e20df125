"""`hpcrl status / logs / cancel` of a submitted run, through its submitit job (`HetJob`).

    job = resolve_job("/shared/runs/a")      # or the job id, while Slurm still knows the job
    print(status_text(job))                  # what `hpcrl status` prints
    follow_logs(job, sys.stdout)             # `hpcrl logs -f`: until the job ends, across requeues
    print(cancel_run(job))                   # `hpcrl cancel`: HetJob.cancel(), then one line

The job's Slurm state comes from `HetJob.slurm_state()` (scontrol/squeue, then sacct), its files
from its job folder RUN_DIR/logs (launch/slurm_query.py finds the attempt and batch logs) and the
run's progress from the run dir (launch/result.py reads it). Problems are `SlurmError`s, which the
CLI prints on one line with exit code 2.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO

from launch.result import last_metrics, read_json, read_outcome
from launch.slurm_executor import HetJob
from launch.slurm_query import JobState, attempt_logs, batch_logs, pick_log, resolve_run


def resolve_job(target: str) -> HetJob:
    """The job of a run dir made by `hpcrl submit` or `hpcrl.jobs.Executor`, or of the job id of
    one (`launch.slurm_query.resolve_run`'s SlurmError when it is neither)."""
    run_dir, record = resolve_run(target)
    folder = Path(record.get("submitit_folder", record.get("log_dir", run_dir / "logs")))
    return HetJob(folder.resolve(), record["job_id"])


def _world_line(run_dir: Path) -> str | None:
    ranks = read_json(run_dir / ".ranks.json")
    if not isinstance(ranks, list) or not ranks:
        return None
    by_role: dict[str, list[str]] = {}
    for r in sorted(ranks, key=lambda r: r["rank"]):
        by_role.setdefault(r["role"], []).append(str(r["rank"]))
    roles = "; ".join(f"{role} {','.join(ids)}" for role, ids in by_role.items())
    hosts = sorted({r["host"] for r in ranks})
    return f"{len(ranks)} ranks ({roles}) on {', '.join(hosts)}"


def status_text(job: HetJob) -> str:
    """What `hpcrl status` prints: Slurm state, attempt and restarts, time, progress, why the job
    stopped without finishing (its result: a cancel, the requeue cap, a failure), world, logs."""
    job_id, run_dir = job.job_id, job.run_dir
    state = job.slurm_state()
    rows: list[tuple[str, str]] = [("run dir", str(run_dir))]
    if state is None:
        rows.append(("job", f"{job_id}: no longer known to Slurm (it keeps finished jobs for MinJobAge; "
                            "no accounting to ask)"))
    else:
        reason = f" ({state.reason})" if state.reason not in ("", "None") else ""
        exit_code = f", exit code {state.exit_code}" if state.final and state.exit_code else ""
        rows.append(("job", f"{job_id} {state.state}{reason}{exit_code}, partition {state.partition or '?'}"))
        if state.components:
            rows.append(("nodes", ", ".join(f"{cid}: {nodes}" for cid, nodes in state.components)))
        rows.append(("attempt", f"{state.restarts} ({state.restarts} restarts; SLURM_RESTART_COUNT)"))
        if state.run_time:
            left = f", {state.time_left} left" if state.time_left else ""
            rows.append(("time", f"{state.run_time} elapsed of {state.time_limit}{left}"))
    config = read_json(run_dir / "config.json") or {}
    num_steps = config.get("algorithm", {}).get("num_steps", "?")
    last = last_metrics(run_dir)
    if last is None or last["step"] < 0:  # step -1: eval.before_train's record
        rows.append(("progress", f"no step finished yet (0/{num_steps})"))
    else:
        reward = last.get("reward/mean")
        shown = f"{reward:.4f}" if isinstance(reward, (int, float)) else "n/a"
        rows.append(("progress", f"step {last['step'] + 1}/{num_steps} done, reward/mean {shown}"))
    final = read_json(run_dir / "final.json")
    if isinstance(final, dict):
        rows.append(("finished", f"policy sha256 {final.get('policy_sha256')}"))
    failure = run_dir / ".failure.txt"
    outcome = read_outcome(job.paths.folder, job_id)
    if outcome is not None and outcome[0] == "error" and str(outcome[1]).strip():
        rows.append(("outcome", str(outcome[1]).strip().splitlines()[0]))
    elif failure.is_file():
        rows.append(("failure", failure.read_text().strip().splitlines()[0]))
    world = _world_line(run_dir)
    if world:
        rows.append(("world", world))
    attempts = attempt_logs(run_dir, job.log_record)
    where = str(attempts[-1][1]) if attempts else "no step log yet"
    rows.append(("logs", f"{where}  (hpcrl logs {run_dir} [-f])"))
    return "\n".join(f"{key:<9} {value}" for key, value in rows)


def follow_logs(job: HetJob, out: TextIO, attempt: int | None = None, poll_s: float = 0.5,
                state_every_s: float = 2.0) -> JobState | None:
    """`tail -f` of the current attempt's step log, switching to the next attempt after a requeue;
    returns the job's final state once it has ended and its log is drained. Ctrl-C raises
    KeyboardInterrupt for the caller to end quietly."""
    run_dir, record = job.run_dir, job.log_record
    current: Path | None = None
    pos = 0
    next_state = 0.0
    state = None
    while True:
        target = pick_log(run_dir, record, attempt)
        if target is not None and target != current:
            if current is not None:
                pos = _copy_from(current, pos, out)  # the rest of the previous attempt first
            out.write(f"==> {target} <==\n")
            current, pos = target, 0
        grew = False
        if current is not None:
            new_pos = _copy_from(current, pos, out)
            grew, pos = new_pos != pos, new_pos
        out.flush()
        if not grew and time.monotonic() >= next_state:
            next_state = time.monotonic() + state_every_s
            state = job.slurm_state()
            if state is None or state.final:
                if current is not None:
                    _copy_from(current, pos, out)
                else:
                    for path in batch_logs(run_dir, record):  # it ended before any step ran
                        out.write(f"==> {path} <==\n{path.read_text(errors='replace')}")
                out.flush()
                return state
        time.sleep(poll_s)


def _copy_from(path: Path, pos: int, out: TextIO) -> int:
    """Write `path`'s bytes from offset `pos` to `out`; the new offset."""
    try:
        with path.open("rb") as f:
            f.seek(pos)
            data = f.read()
    except FileNotFoundError:
        return pos
    if data:
        out.write(data.decode(errors="replace"))
    return pos + len(data)


def cancel_run(job: HetJob) -> str:
    """Cancel the run's job unless it already ended (`HetJob.cancel`: scancel every component and
    wait until Slurm reports the job ended); a one-line outcome."""
    state = job.slurm_state()
    if state is None:
        return f"job {job.job_id} is no longer known to Slurm; nothing to cancel"
    if state.final:
        return f"job {job.job_id} already ended ({state.state}); nothing to cancel"
    job.cancel()
    final = job.slurm_state()
    shown = final.state if final is not None else "gone"
    return f"cancelled job {job.job_id} ({shown}); run dir {job.run_dir}"
