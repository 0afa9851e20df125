"""Local executor: start one MPI world with mpiexec (PyPI MPICH's Hydra, fork launcher) and
supervise it until it ends, leaving no process behind.

The world runs in its own session (process group). The supervisor forwards its output, forwards
SIGINT/SIGTERM/SIGUSR1/SIGUSR2 to the world, watches every rank's pid (from RUN_DIR/.ranks.json, written
by the controller) so a rank that dies without a word is named with its role, host and the phase
the controller was in (RUN_DIR/.phase.json), and on exit kills whatever is left of the group.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch.procs import process_gone, session_members
from launch.result import EXIT_INTERRUPTED, REQUEUE_EXIT_CODE

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def mpiexec_path() -> str:
    """The mpiexec next to this Python (the PyPI `mpich` wheel installs it in the venv's bin)."""
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("mpiexec not found: install hpcrl's dependencies (pip install mpich mpi4py) "
                                "in the environment that runs hpcrl")
    return found


def _read_json(path: Path) -> object | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class _RankWatch(threading.Thread):
    """Records the first rank whose process disappears, with the controller's phase at that time."""

    def __init__(self, run_dir: Path) -> None:
        super().__init__(daemon=True)
        self.run_dir = run_dir
        self.first_death: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        ranks = None
        while not self.stop.wait(0.1):
            ranks = ranks or _read_json(self.run_dir / ".ranks.json")
            if not ranks:
                continue
            gone = [r for r in ranks if process_gone(r["pid"])]
            if gone:  # seen in one poll: a worker before the controller, which aborts when one dies
                r = next((r for r in gone if r["role"] != "controller"), gone[0])
                phase = _read_json(self.run_dir / ".phase.json") or {}
                self.first_death = (f"rank {r['rank']} ({r['role']}, host {r['host']}, pid {r['pid']}) "
                                    f"ended during phase '{phase.get('phase', '?')}' of step "
                                    f"{phase.get('step', '?')}")
                return


def _kill_session(sid: int, grace_s: float) -> None:
    """TERM then KILL every process of the world's session (Hydra's proxies put ranks in process
    groups of their own, so a process-group kill would miss them)."""
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        members = session_members(sid)
        if not members:
            return
        for pid in members:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and session_members(sid):
            time.sleep(0.05)


def run_world(world_size: int, argv: list[str], run_dir: Path, env: dict[str, str] | None = None,
              grace_s: float = 5.0, keep_fds: tuple[int, ...] = ()) -> tuple[int, str | None]:
    """Run `argv` as `world_size` MPI ranks; return (exit code, first rank death or None).
    `keep_fds` stay open in mpiexec (the run dir's lock: a world whose supervisor was killed keeps it)."""
    # -disable-auto-cleanup: a rank that dies must not take the others down with it before the
    # controller has named it; the controller then aborts the world and we kill what is left.
    cmd = [mpiexec_path(), "-launcher", "fork", "-disable-auto-cleanup", "-n", str(world_size), *argv]
    env = dict(os.environ if env is None else env)
    env["HPCRL_LAUNCHER"] = "mpiexec"
    world: list[subprocess.Popen] = []  # mpiexec, once started
    stopped: list[int] = []  # the exit code of a world stopped here, without its controller
    interrupts = [0]  # Ctrl-Cs so far

    def forward(signum: int, _frame: object) -> None:
        # Preemption (USR1/USR2/TERM) and Ctrl-C go to the controller (rank 0), which saves a
        # checkpoint and stops the workers. Before the controller is known there is nothing to
        # save: stop the world (a TERM would be recorded as a preemption, and the world would start
        # up and train a step first). A second Ctrl-C stops it at once, without saving.
        ranks = _read_json(run_dir / ".ranks.json")
        name = signal.Signals(signum).name
        interrupts[0] += signum == signal.SIGINT
        if not ranks or interrupts[0] >= 2:
            why = "before the MPI world formed" if not ranks else "a second time"
            print(f"hpcrl run: {name} {why}: the world is stopped without saving", file=sys.stderr, flush=True)
            stopped.append(EXIT_INTERRUPTED if signum == signal.SIGINT else REQUEUE_EXIT_CODE)
            if world:
                _kill_session(world[0].pid, 0.0)
            return
        try:
            # TERM, not USR1: Hydra uses USR1 inside the world to report a dead rank.
            if signum != signal.SIGTERM:  # the controller then names SIGTERM
                print(f"hpcrl run: {name} forwarded to the controller as SIGTERM (a second Ctrl-C stops "
                      "the world without saving)", file=sys.stderr, flush=True)
            os.kill(ranks[0]["pid"], signal.SIGTERM)
        except ProcessLookupError:
            pass

    # The handlers come first: a Ctrl-C while mpiexec starts would otherwise be a KeyboardInterrupt
    # here, leaving the world (a session of its own) to form and train unsupervised.
    previous = {s: signal.signal(s, forward) for s in FORWARDED_SIGNALS}
    watch = _RankWatch(run_dir)
    try:
        world.append(subprocess.Popen(cmd, env=env, start_new_session=True, pass_fds=keep_fds))
        if stopped:  # signalled while mpiexec was being started
            _kill_session(world[0].pid, 0.0)
        watch.start()
        rc = world[0].wait()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        watch.stop.set()
        if world:
            _kill_session(world[0].pid, grace_s)
    return (stopped[0] if stopped else rc), watch.first_death
