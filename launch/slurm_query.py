"""Reading Slurm: the cluster's partitions and nodes, and the state of a submitted hpcrl job.

Everything here calls Slurm's client tools (`scontrol -o`, `squeue`, `scancel`) with a deadline and
turns a missing tool, a silent controller or a failing command into `SlurmError`, whose message names
the tool or argument, the bad value and the fix (the CLI prints it on one line and exits 2). Job
state comes from `scontrol show job` (Slurm keeps finished jobs for `MinJobAge`, 10 min on the local
cluster) and `squeue` (time left); only when Slurm has forgotten the job and accounting is on does
it fall back to `sacct`, whose output is parsed by submitit's `SlurmInfoWatcher.read_info`. A hetjob
answers with one record per component (`123+0`, `123+1`; sacct has no record `123`); the first is the
leader. Which states are final is defined here, once (`is_final`). The files of a
submitted run dir (RUN_DIR/slurm.json, the attempt and batch logs) are found here too; what `hpcrl
status/logs/cancel` make of them, through the run's `HetJob`, is in launch/slurm_runs.py.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from launch.result import read_json
from launch.slurm_spec import parse_time_limit

SLURM_CMD_TIMEOUT_S = 30.0
_KEY_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_:/.]*=")
# Slurm's job states, in scontrol/squeue/sacct spelling (sacct adds words: 'CANCELLED by 0').
FINAL_STATES = frozenset({"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "BOOT_FAIL",
                          "DEADLINE", "REVOKED"})
"""The job ended for good: Slurm never runs it again."""
REQUEUED_STATES = frozenset({"PREEMPTED", "NODE_FAIL"})
"""An attempt ended; a job submitted with --requeue (every hpcrl job) is requeued by Slurm itself and
comes back PENDING (seen on the local cluster for both), so only a job without --requeue ends here."""


def state_word(state: str) -> str:
    """The state's name: 'CANCELLED by 0' (sacct) -> 'CANCELLED'; '' stays ''."""
    words = state.split() if state else []
    return words[0].upper() if words else ""


def is_final(state: str, requeue: bool = True) -> bool:
    """Whether a job in `state` has ended for good. `requeue`: the job may be requeued (scontrol's
    `Requeue=1`, every hpcrl job), so PREEMPTED and NODE_FAIL are followed by PENDING. Every other
    state is not final: queued, running, COMPLETING (its processes are still being killed), held for
    a requeue (REQUEUE_HOLD, SPECIAL_EXIT: `scontrol release` starts it again) or unknown."""
    word = state_word(state)
    return word in FINAL_STATES or (not requeue and word in REQUEUED_STATES)


class SlurmError(ValueError):
    """A user-facing problem with Slurm or a run: `path` (YAML key, argument or tool), the bad
    `value` and a `hint` that says what to do; the message is "path=value: hint" like ConfigError."""

    def __init__(self, path: str, value: object, hint: str) -> None:
        self.path, self.value, self.hint = path, value, hint
        super().__init__(f"{path}={value!r}: {hint}")


def require_tool(tool: str) -> str:
    """The path of Slurm client `tool`; SlurmError naming PATH when it is not installed here."""
    found = shutil.which(tool)
    if found is None:
        raise SlurmError(tool, "not found", f"hpcrl needs Slurm's client tools on PATH; run it on a login "
                                            f"node of the cluster or add Slurm's bin directory to PATH "
                                            f"(PATH={os.environ.get('PATH', '')})")
    return found


def slurm_cmd(args: list[str], timeout_s: float = SLURM_CMD_TIMEOUT_S, check: bool = True
              ) -> subprocess.CompletedProcess:
    """Run a Slurm client command under a deadline; SlurmError with its stderr when it fails."""
    require_tool(args[0])
    shown = " ".join(args)
    try:
        proc = subprocess.run(args, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise SlurmError(args[0], shown, f"no answer within {timeout_s:.0f} s; is the Slurm controller up "
                                         "(`scontrol ping`)?") from None
    if check and proc.returncode != 0:
        err = (proc.stderr.strip() or proc.stdout.strip() or "no output").splitlines()[-1]
        raise SlurmError(args[0], shown, f"exited with code {proc.returncode}: {err}")
    return proc


def parse_records(text: str) -> list[dict[str, str]]:
    """`scontrol -o show ...` output -> one dict per line. A value with spaces (`Reason=Not
    responding`) keeps its words: a token without `key=` continues the previous value."""
    records = []
    for line in text.splitlines():
        rec: dict[str, str] = {}
        last = None
        for token in line.split():
            if _KEY_RE.match(token):
                last, _, value = token.partition("=")
                rec[last] = value
            elif last is not None:
                rec[last] += " " + token
        if rec:
            records.append(rec)
    return records


def gpu_count(gres: str) -> int:
    """GPUs in a node's `Gres=` value: 'gpu:2', 'gpu:a100:4(S:0-1)', 'gpu:a:2,gpu:b:2', '(null)'."""
    total = 0
    for entry in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        parts = entry.strip().split(":")
        if parts[0] == "gpu":
            total += int(parts[-1]) if len(parts) > 1 and parts[-1].isdigit() else 1
    return total


def _limit(text: str, parse: Callable[[str], int]) -> int | None:
    return None if text in ("", "UNLIMITED", "INFINITE", "NONE", "n/a") else parse(text)


@dataclass(frozen=True)
class NodeInfo:
    """One node as `scontrol show node` reports it."""

    name: str
    cpus: int
    gpus: int
    memory_mb: int
    state: str


@dataclass(frozen=True)
class PartitionInfo:
    """One partition and its nodes; `max_time_min`/`max_nodes` None means unlimited."""

    name: str
    default: bool
    state: str
    max_time_min: int | None
    max_nodes: int | None
    nodes: tuple[NodeInfo, ...]


def cluster_partitions() -> dict[str, PartitionInfo]:
    """Every partition of the cluster with its nodes (two scontrol calls)."""
    nodes: dict[str, tuple[NodeInfo, list[str]]] = {}
    for rec in parse_records(slurm_cmd(["scontrol", "-o", "show", "node"]).stdout):
        info = NodeInfo(name=rec["NodeName"], cpus=int(rec.get("CPUTot", "0")),
                        gpus=gpu_count(rec.get("Gres", "")), memory_mb=int(rec.get("RealMemory", "0")),
                        state=rec.get("State", "UNKNOWN"))
        nodes[info.name] = (info, rec.get("Partitions", "").split(","))
    partitions = {}
    for rec in parse_records(slurm_cmd(["scontrol", "-o", "show", "partition"]).stdout):
        name = rec["PartitionName"]
        members = tuple(info for info, parts in nodes.values() if name in parts)
        partitions[name] = PartitionInfo(
            name=name, default=rec.get("Default") == "YES", state=rec.get("State", "UNKNOWN"),
            max_time_min=_limit(rec.get("MaxTime", ""), parse_time_limit),
            max_nodes=_limit(rec.get("MaxNodes", ""), int), nodes=members)
    return partitions


@dataclass(frozen=True)
class JobState:
    """What Slurm knows of a job now. `components` is [(component id, node list)] ('123+0', 'n1').
    `time_left` is squeue's `%L` ('59:31', 'UNLIMITED') while the job is pending or running."""

    job_id: str
    state: str
    reason: str
    restarts: int
    exit_code: str
    run_time: str
    time_limit: str
    time_left: str | None
    partition: str
    components: tuple[tuple[str, str], ...]
    source: str
    requeue: bool = True
    """Slurm may requeue the job (scontrol `Requeue=1`); False for a job only accounting remembers."""

    @property
    def final(self) -> bool:
        """The job has ended for good (`is_final`)."""
        return is_final(self.state, self.requeue)


def sacct_state(job_id: str) -> str | None:
    """The job's state from accounting (a hetjob's: its leader `<id>+0`'s), or None without `sacct`
    or accounting, or when accounting has no record of the job."""
    if shutil.which("sacct") is None:
        return None
    proc = slurm_cmd(["sacct", "-j", job_id, "-X", "-o", "JobID,State,NodeList", "--parsable2"],
                     check=False)
    if proc.returncode != 0:
        return None
    from submitit.slurm.slurm import SlurmInfoWatcher  # parses sacct's --parsable2 table

    info = SlurmInfoWatcher().read_info(proc.stdout)
    record = info.get(job_id) or info.get(f"{job_id}+0") or {}
    return state_word(record.get("State", "")) or None


def job_state(job_id: str) -> JobState | None:
    """The job's state, or None when neither scontrol nor accounting knows the job any more."""
    proc = slurm_cmd(["scontrol", "-o", "show", "job", job_id], check=False)
    records = parse_records(proc.stdout) if proc.returncode == 0 else []
    if not records:
        if "Invalid job id" not in proc.stderr and proc.returncode != 0:
            slurm_cmd(["scontrol", "-o", "show", "job", job_id])  # raises with the real error
        state = sacct_state(job_id)
        if state is None:
            return None
        # Slurm has forgotten the job, so no requeue is coming: accounting's last state is final.
        return JobState(job_id=job_id, state=state, reason="", restarts=0, exit_code="", run_time="",
                        time_limit="", time_left=None, partition="", components=(), source="sacct",
                        requeue=False)
    lead = records[0]
    requeue = lead.get("Requeue", "1") != "0"
    time_left = None
    if not is_final(lead.get("JobState", ""), requeue):
        out = slurm_cmd(["squeue", "-h", "-j", job_id, "-o", "%L"], check=False).stdout.split()
        time_left = out[0] if out else None
    components = tuple((f"{r.get('HetJobId', r['JobId'])}+{r['HetJobOffset']}" if "HetJobOffset" in r
                        else r["JobId"], r.get("NodeList", "(null)")) for r in records)
    return JobState(job_id=job_id, state=lead.get("JobState", "UNKNOWN"), reason=lead.get("Reason", "None"),
                    restarts=int(lead.get("Restarts", "0")), exit_code=lead.get("ExitCode", ""),
                    run_time=lead.get("RunTime", ""), time_limit=lead.get("TimeLimit", ""),
                    time_left=time_left, partition=lead.get("Partition", ""), components=components,
                    source="scontrol", requeue=requeue)


def cancel_job(job_id: str, timeout_s: float = 60.0, poll_s: float = 0.5) -> JobState | None:
    """`scancel` the job (every component) and wait until Slurm reports it final; its last state."""
    slurm_cmd(["scancel", job_id])
    deadline = time.monotonic() + timeout_s
    state = job_state(job_id)
    while state is not None and not state.final and time.monotonic() < deadline:
        time.sleep(poll_s)
        state = job_state(job_id)
    return state


def job_workdir(job_id: str) -> Path | None:
    """The working directory Slurm recorded for the job (hpcrl's run dir), or None if unknown."""
    proc = slurm_cmd(["scontrol", "-o", "show", "job", job_id], check=False)
    records = parse_records(proc.stdout) if proc.returncode == 0 else []
    return Path(records[0]["WorkDir"]) if records and records[0].get("WorkDir") else None


# ---- the files of a run dir made by `hpcrl submit` (RUN_DIR/slurm.json names its job) ------------

SUBMISSION_FILE = "slurm.json"
_ATTEMPT_RE = re.compile(r"^(?P<job>\d+)-attempt(?P<n>\d+)\.log$")


def resolve_run(target: str) -> tuple[Path, dict]:
    """A run dir, or the job id of one, -> (run dir, its slurm.json record); SlurmError otherwise."""
    path = Path(target).expanduser()
    if not path.exists() and re.fullmatch(r"\d+(\+\d+)?", target):
        workdir = job_workdir(target.split("+")[0])
        if workdir is None:
            raise SlurmError("RUN", target, "Slurm does not know this job id (any more); give the run dir "
                                            "printed by hpcrl submit")
        path = workdir
    if not path.is_dir():
        raise SlurmError("RUN", target, "no such run dir; give the run dir printed by hpcrl submit "
                                        "(or the job id while Slurm still knows the job)")
    sub = path / SUBMISSION_FILE
    if not sub.is_file():
        raise SlurmError("RUN", target, f"{path} has no {SUBMISSION_FILE}: it was not submitted with hpcrl "
                                        "submit (an `hpcrl run` dir has its logs in logs/)")
    record = read_json(sub)
    if not isinstance(record, dict) or not isinstance(record.get("job_id"), (str, int)):
        raise SlurmError("RUN", target, f"{sub} is not the record hpcrl submit writes (a JSON object with the "
                                        "job_id): it was damaged or is not hpcrl's; squeue, sacct and scancel still reach the job")
    return path.resolve(), record


def attempt_logs(run_dir: Path, record: dict) -> list[tuple[int, Path]]:
    """[(attempt, path)] of the step logs of the run's job, oldest attempt first."""
    log_dir = Path(record.get("log_dir", run_dir / "logs"))
    found = []
    for path in log_dir.glob(f"{record['job_id']}-attempt*.log"):
        m = _ATTEMPT_RE.match(path.name)
        if m:
            found.append((int(m["n"]), path))
    return sorted(found)


def batch_logs(run_dir: Path, record: dict) -> list[Path]:
    """The batch script's own output and error files (signals, requeues, step exit codes)."""
    log_dir = Path(record.get("log_dir", run_dir / "logs"))
    names = (f"slurm-{record['job_id']}.out", f"slurm-{record['job_id']}.err")
    return [log_dir / name for name in names if (log_dir / name).is_file()]


def pick_log(run_dir: Path, record: dict, attempt: int | None) -> Path | None:
    """The step log of attempt `attempt` (None: the latest), or None when it has none yet."""
    logs = attempt_logs(run_dir, record)
    if attempt is None:
        return logs[-1][1] if logs else None
    return dict(logs).get(attempt)


def write_logs(run_dir: Path, record: dict, out: TextIO, attempt: int | None = None, every: bool = False,
               batch: bool = False) -> None:
    """Copy the latest attempt's step log (or attempt `attempt`, or every attempt, or the batch
    script's logs) to the text stream `out`; SlurmError when there is none."""
    if batch:
        paths = batch_logs(run_dir, record)
    elif every:
        paths = [p for _, p in attempt_logs(run_dir, record)]
    else:
        chosen = pick_log(run_dir, record, attempt)
        paths = [chosen] if chosen else []
    if not paths:
        have = [n for n, _ in attempt_logs(run_dir, record)]
        what = f"attempt {attempt}" if attempt is not None else "a step log"
        raise SlurmError("RUN", str(run_dir), f"no {what} of job {record['job_id']} yet (attempts with "
                                              f"logs: {have or 'none'}); the job may be pending: "
                                              f"hpcrl status {run_dir}")
    for path in paths:
        if len(paths) > 1:
            out.write(f"==> {path} <==\n")
        out.write(path.read_text(errors="replace"))
    out.flush()
