"""The MPI control plane under real mpiexec: roles from COMM_WORLD.Split, replies, and failures
(a rank that exits early, hangs or raises) reported within the deadline with rank, role, host
and phase, with no process left behind."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.timeout(120)]

WORLD = Path(__file__).with_name("_roles_world.py")


def _run(tmp_path: Path, fault: str | None, timeout_s: float = 5.0, num_trainer: int = 2):
    env = dict(os.environ)
    env.pop("HPCRL_FAULT", None)
    if fault:
        env["HPCRL_FAULT"] = fault
    code = (
        "import sys; from pathlib import Path; from launch.local import run_world;"
        f"rc, death = run_world({1 + num_trainer + 1}, [sys.executable, {str(WORLD)!r}, {str(tmp_path)!r}, "
        f"'{num_trainer}', '{timeout_s}'], Path({str(tmp_path)!r}));"
        "print('RC', rc); print('DEATH', death)"
    )
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    # The controller's RankFailure, also from its file: MPI_Abort can cut mpiexec's output forwarding.
    failure = tmp_path / ".failure.txt"
    text = out.stdout + out.stderr + (f"\nFAILURE FILE {failure.read_text()}" if failure.exists() else "")
    return text, time.monotonic() - t0


def _no_leftovers(tmp_path: Path) -> None:
    time.sleep(0.5)
    mine = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path) in " ".join(p.info["cmdline"] or [])]
    assert not mine, [p.info["cmdline"] for p in mine]


def test_roles_and_replies(tmp_path):
    out, _ = _run(tmp_path, None)
    assert "RC 0" in out, out
    who = next(line for line in out.splitlines() if line.startswith("WHO "))
    # controller = rank 0, trainer ranks 1..2, rollout rank 3; role communicators from Split
    assert '"1": {"rank": 1, "role": "trainer", "role_rank": 0, "role_size": 2}' in who
    assert '"2": {"rank": 2, "role": "trainer", "role_rank": 1, "role_size": 2}' in who
    assert '"3": {"rank": 3, "role": "rollout", "role_rank": 0, "role_size": 1}' in who
    assert 'RESULTS {"rollout": {"3": 18}, "trainer": {"1": 6, "2": 12}}' in out
    _no_leftovers(tmp_path)


@pytest.mark.parametrize("fault, expect", [
    ("2:work:hang", "no answer within 5 s in phase 'work' of step 0 from rank 2 (trainer, host"),
    ("3:work:crash", "rank 3 (rollout, host"),
])
def test_hang_and_crash_are_named_within_the_deadline(tmp_path, fault, expect):
    out, wall = _run(tmp_path, fault, timeout_s=5.0)
    assert expect in out, out
    assert "RC 0" not in out
    assert socket.gethostname() in out
    if "crash" in fault:
        assert "failed in phase 'work' of step 0" in out and "HPCRL_FAULT injected crash" in out
    assert wall < 60, wall
    _no_leftovers(tmp_path)


def test_rank_that_exits_early_is_named(tmp_path):
    out, wall = _run(tmp_path, "1:work:exit", timeout_s=5.0)
    # Hydra may end the world as soon as a rank exits without MPI_Finalize; either the
    # controller's deadline or the launcher's rank watch names the rank.
    assert ("rank 1 (trainer, host" in out and ("no answer within" in out or "DEATH rank 1 (trainer" in out)), out
    assert "phase" in out
    assert wall < 60
    _no_leftovers(tmp_path)


def test_a_rank_stuck_in_mpi_init_ends_the_world_within_the_startup_deadline(tmp_path):
    """MPI_Init has no timeout of its own: rank 1 stalls before it, so rank 0 waits inside MPI_Init.
    join_world_within ends rank 0 at its deadline with a traceback naming where it waited, and
    mpiexec takes the stalled rank down with it, long before the stall would end."""
    script = tmp_path / "stall.py"
    script.write_text(
        "import os, sys, time\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})\n"
        "if os.environ.get('PMI_RANK') == '1':\n"
        "    time.sleep(60)\n"
        "from hpcrl.worker_main import join_world_within\n"
        "join_world_within(1, 3.0)\n"
        "print('joined', flush=True)\n")
    from launch.local import mpiexec_path

    t0 = time.monotonic()
    out = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, str(script)], capture_output=True,
                         text=True, timeout=50)
    took = time.monotonic() - t0
    assert out.returncode != 0 and took < 30, (took, out.stdout, out.stderr)
    assert "Timeout (0:00:03)!" in out.stderr and "join_world_within" in out.stderr, out.stderr
    assert "joined" not in out.stdout
    _no_leftovers(tmp_path)


def test_ctrl_c_as_mpiexec_starts_stops_the_world(tmp_path):
    """A Ctrl-C that lands just after mpiexec has started, before the world formed, stops the world
    (exit 130, no process left): it once found Python's default handler there, raised
    KeyboardInterrupt in `hpcrl run` and left the world, a session of its own, to train unsupervised."""
    code = (
        "import os, signal, sys\nfrom pathlib import Path\nimport launch.local as local\n"
        "real = local.subprocess.Popen\n"
        "def started(*a, **k):\n"
        "    proc = real(*a, **k)\n"
        "    os.kill(os.getpid(), signal.SIGINT)\n"
        "    return proc\n"
        "local.subprocess.Popen = started\n"
        f"rc, death = local.run_world(4, [sys.executable, {str(WORLD)!r}, {str(tmp_path)!r}, '2', '5'], "
        f"Path({str(tmp_path)!r}))\n"
        "print('RC', rc)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "HPCRL_FAULT"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert "RC 130" in out.stdout, out.stdout + out.stderr
    assert "SIGINT before the MPI world formed: the world is stopped without saving" in out.stderr
    _no_leftovers(tmp_path)
