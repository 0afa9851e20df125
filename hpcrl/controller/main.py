"""Rank 0: build the session, run the loop, report failures and stop the world cleanly."""

from __future__ import annotations

import sys
from pathlib import Path

from hpcrl.config.schema import JobConfig
from hpcrl.controller.comm import RankFailure, World
from hpcrl.controller.sync_check import WeightSyncError

EXIT_FAILURE = 1


def _report(run_dir: Path, message: str) -> None:
    """Print the failure and leave it in RUN_DIR/.failure.txt (the launcher then adds nothing)."""
    (run_dir / ".failure.txt").write_text(message + "\n")
    print(f"\n{message}", file=sys.stderr, flush=True)


def controller_main(job: JobConfig, run_dir: Path, world: World) -> int:
    from hpcrl.controller import loop
    from hpcrl.controller.session import Session

    try:
        session = Session(job, run_dir, world)
        session.start()
        loop.run(session)
        digest = session.finish()
    except (RankFailure, WeightSyncError) as exc:
        _report(run_dir, f"hpcrl run failed: {exc}")
        world.comm.Abort(EXIT_FAILURE)
        return EXIT_FAILURE
    except BaseException as exc:  # the controller itself failed: say where, then stop every rank
        import traceback

        traceback.print_exc()
        _report(run_dir, f"hpcrl run failed on the controller (rank 0): {exc!r}")
        world.comm.Abort(EXIT_FAILURE)
        return EXIT_FAILURE
    print(f"policy sha256: {digest}", flush=True)
    print(f"run dir: {run_dir}", flush=True)
    return 0
