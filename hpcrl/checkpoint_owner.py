"""Which run a checkpoint dir belongs to: one run writes into it at a time, and an automatic resume
takes only its own run's checkpoints.

Runs may share a `checkpoint.dir` (one scratch directory for every job, a sweep's fixed setting).
Two runs writing into it at once overwrote and pruned each other's steps (`checkpoint.keep`), and
one of them failed at its first save on a step the other had committed (CheckpointExistsError),
after training: so the run's controller holds an exclusive lock on CKPT_DIR/.hpcrl_lock for its
life (`lock_checkpoint_dir`), and `hpcrl run` / `hpcrl submit` probe it first (`check_not_in_use`).
A run that starts later resumes by itself only from its own checkpoints (`check_own_checkpoint`: the
run id each checkpoint records, launch/checkpoint_step.py RUN_ID_FILE).

The lock is flock(2): node-local on a local disk; across nodes on NFS (the client maps it to a
POSIX lock, which the server clears within its lease time, about 90 s, after a node dies) and on
Lustre mounted with `-o flock`. A filesystem without flock (Lustre's `noflock`) runs unlocked, said
once in the log.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from hpcrl.config.errors import ConfigError
from hpcrl.config.schema import JobConfig
from launch.checkpoint_step import run_id

LOCK_FILE = ".hpcrl_lock"
_NO_FLOCK = (errno.ENOLCK, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


def lock_checkpoint_dir(job: JobConfig, ckpt_dir: Path, run_dir: Path) -> int | None:
    """An exclusive lock on CKPT_DIR/.hpcrl_lock, held by the returned fd until it is closed (or the
    process ends); None where the filesystem has no flock. ConfigError on checkpoint.dir while
    another run holds it, naming that run's dir and host."""
    import socket

    ckpt_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(ckpt_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    if not _locked(job, ckpt_dir, fd, warn=True):
        return None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"run dir {run_dir}, pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    return fd


def check_not_in_use(job: JobConfig, ckpt_dir: Path) -> None:
    """ConfigError where a running run holds `ckpt_dir` (`lock_checkpoint_dir`); writes nothing. (No
    lock file, or one this process cannot open, is not judged: the run's writability check names a
    path that is not a writable directory.)"""
    try:  # read-write: NFS maps flock to a POSIX write lock, which needs it
        fd = os.open(ckpt_dir / LOCK_FILE, os.O_RDWR)
    except OSError:  # none there, a file where a directory should be, no permission
        return
    if _locked(job, ckpt_dir, fd, warn=False):
        os.close(fd)


def _locked(job: JobConfig, ckpt_dir: Path, fd: int, warn: bool) -> bool:
    """Take the lock on `fd`: True; False (fd closed) where the filesystem has no flock; ConfigError
    (fd closed) while another process holds it."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise ConfigError("checkpoint.dir", job.checkpoint.dir or str(ckpt_dir),
                          f"is in use by another run ({holder}): runs writing into one checkpoint dir at once "
                          "overwrite and prune each other's checkpoints; give this run a checkpoint.dir of its own, "
                          "or wait for that run to end") from None
    except OSError as exc:
        os.close(fd)
        if exc.errno not in _NO_FLOCK:
            raise
        if warn:
            print(f"hpcrl: warning: {ckpt_dir} has no flock ({exc.strerror}): another run writing into it at "
                  "the same time is not detected (Lustre: mount with -o flock)", file=sys.stderr, flush=True)
        return False


def check_own_checkpoint(job: JobConfig, run_dir: Path, ckpt_dir: Path, step: int, existing: list[int]) -> None:
    """An automatic resume takes only this run's checkpoints: in a checkpoint.dir shared by runs, a
    new run (or another run dir) resumed the latest run's state and history without a word. A
    checkpoint written before checkpoints recorded their run is not judged."""
    writer = _writer(ckpt_dir, step)
    mine = run_id(run_dir)
    if writer is None or writer[0] == mine:
        return
    own = [s for s in existing if s < step and (_writer(ckpt_dir, s) or ("",))[0] == mine] if mine else []
    other, key, value = writer[1], "checkpoint.dir", job.checkpoint.dir or str(ckpt_dir)
    if own:
        raise ConfigError(key, value,
                          f"holds checkpoints of two runs: steps {own} are this run's, and the latest, step {step}, "
                          f"is another run's (run dir {other}); runs that share a checkpoint.dir overwrite each "
                          f"other's steps and prune each other's checkpoints (checkpoint.keep). Give each run a "
                          f"checkpoint.dir of its own: move that run's checkpoints away and resume, or "
                          f"`--resume-from {own[-1]}` resumes this run's (and deletes the newer steps, that run's too)")
    raise ConfigError(key, value,
                      f"its latest checkpoint, step {step}, is another run's (run dir {other}), and this run dir "
                      f"{run_dir} would resume it as its own: resume that run (`--run-dir {other}`), start from its "
                      f"checkpoint on purpose (`--resume-from {step}`; steps {existing}), or give this run a "
                      "checkpoint.dir of its own")


def _writer(ckpt_dir: Path, step: int) -> tuple[str, str] | None:
    """(run id, run dir) of the run that wrote checkpoint `step`, or None where it does not say."""
    from checkpoints import read_metadata

    try:
        meta = read_metadata(ckpt_dir, step)
    except Exception:  # noqa: BLE001 - an older or damaged checkpoint: the controller judges it
        return None
    return (meta["run_id"], str(meta.get("run_dir", "?"))) if meta.get("run_id") else None
