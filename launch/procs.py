"""Process liveness helpers shared by the launcher and the controller (no MPI import here)."""

from __future__ import annotations


def process_gone(pid: int) -> bool:
    """True when no live (non-zombie) process has this pid on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:
        return True


def stop(proc, timeout_s: float = 30.0) -> None:  # proc: subprocess.Popen
    """Ask a child to stop (SIGTERM), wait up to `timeout_s`, then kill it; reaped either way."""
    import signal
    import subprocess

    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def die_with_parent() -> None:
    """In a child (as Popen's preexec_fn): get SIGKILL when the parent dies (Linux prctl), so an
    engine server never outlives the rank that started it."""
    import ctypes
    import signal

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def session_members(sid: int) -> list[int]:
    """Pids of live processes in session `sid` (all descendants of a start_new_session child,
    whatever process groups they made)."""
    import os

    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                if os.getsid(int(entry)) == sid and not process_gone(int(entry)):
                    pids.append(int(entry))
            except OSError:
                continue
    return pids
