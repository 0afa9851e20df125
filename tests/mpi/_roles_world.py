"""A small hpcrl MPI world for control-plane tests: the real join_world / RoleGroup / serve code
with trivial handlers. argv: RUN_DIR NUM_TRAINER TIMEOUT_S."""

import json
import sys
import time
from pathlib import Path


def main() -> int:
    from hpcrl.controller.comm import RankFailure, RoleGroup, join_world
    from hpcrl.worker_main import serve

    run_dir, num_trainer, timeout_s = Path(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    world = join_world(num_trainer)
    if world.role != "controller":
        def whoami(cmd):
            return {"rank": world.rank, "role": world.role, "role_rank": world.role_comm.Get_rank(),
                    "role_size": world.role_comm.Get_size()}

        def work(cmd):
            return sum(cmd.payload) * world.rank

        serve(world, {"whoami": whoami, "work": work, "shutdown": lambda cmd: None}, idle_timeout_s=60)
        return 0
    (run_dir / ".ranks.json").write_text(json.dumps([r.__dict__ for r in world.ranks]))
    groups = {role: RoleGroup(world, role) for role in ("trainer", "rollout")}
    try:
        who = {role: g.call("whoami", 0, None, timeout_s) for role, g in groups.items()}
        t0 = time.monotonic()
        for step in range(3):
            results = {role: g.call("work", step, [1, 2, 3], timeout_s) for role, g in groups.items()}
        for g in groups.values():
            g.call("shutdown", -1, None, timeout_s)
    except RankFailure as exc:
        # The file first: MPI_Abort may tear down mpiexec's stdout forwarding before the print arrives.
        (run_dir / ".failure.txt").write_text(str(exc))
        print(f"RANKFAILURE after {time.monotonic() - t0 if 't0' in dir() else 0:.1f}s: {exc}", flush=True)
        world.comm.Abort(1)
    print("WHO " + json.dumps({k: {str(r): v for r, v in sorted(d.items())} for k, d in who.items()}, sort_keys=True), flush=True)
    print("RESULTS " + json.dumps({k: {str(r): v for r, v in sorted(d.items())} for k, d in results.items()}, sort_keys=True), flush=True)
    (run_dir / "final.json").write_text("{}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
