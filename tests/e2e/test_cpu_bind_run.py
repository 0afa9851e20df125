"""resources.cpu_bind auto in a real run: at the end, the kernel reports every thread of the trainer
rank and of the engine on the plan's block, the engine's host rank on the service cores. The run's
engine spans two nodes (rollout.nodes_per_engine=2): its follower node and that node's rollout rank
sit on the service cores, and the follower stopped when node 0 did, not as a death."""

import json
import os
import re

import pytest

from hpcrl.cpu_bind import make_plan

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(60)
@pytest.mark.skipif(make_plan(sorted(os.sched_getaffinity(0)), 1, 1, 1)[0] is None,
                    reason="fewer than 2 usable cores: `hpcrl run` binds nothing (says why)")
def test_trainer_and_engine_end_on_one_block(reference_run):
    """The threads gloo and the engine's server start after the binding are included; the trainer
    and the engine started on every core and moved once started."""
    run_dir, args = reference_run
    assert "resources.cpu_bind=auto" in args
    plan, _ = make_plan(sorted(os.sched_getaffinity(0)), 1, 1, 1)
    block, service = ",".join(map(str, plan.blocks[0])), ",".join(map(str, plan.service))
    logs = run_dir / "logs"
    assert "rollout.nodes_per_engine=2" in args
    trainer, rollout = (logs / "rank1-trainer.log").read_text(), (logs / "rank2-rollout.log").read_text()
    follower = (logs / "rank3-rollout.log").read_text()
    expected = ((trainer, r"rank 1 \(trainer\)", block), (rollout, "engine 0", block),
                (rollout, r"rank 2 \(rollout\)", service), (follower, "engine 0 node 1", service),
                (follower, r"rank 3 \(rollout\)", service))
    for log, what, cores in expected:
        line = rf"^cpu_bind: {what} \(pid \d+\): \d+ threads on cores? {cores}$"
        assert re.search(line, log, re.M), (line, log[-2000:])
    node_log = (logs / "engine0-node1.log").read_text()
    assert "node 1 ready on http://127.0.0.1:" in node_log and "stopped by node 0" in node_log, node_log
    record = json.loads((logs / "engine0-node1.json").read_text())
    assert (record["engine"], record["node"], record["rank"]) == (0, 1, 3) and "exit" not in record
