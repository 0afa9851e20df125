"""Process liveness helpers shared by the launcher and the controller (no MPI import here)."""

from __future__ import annotations


def process_gone(pid: int) -> bool:
    """True when no live (non-zombie) process has this pid on this host."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[0] in ("Z", "X")
    except OSError:
        return True
