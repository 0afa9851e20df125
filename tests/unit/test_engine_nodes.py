"""rollout.nodes_per_engine: an engine over several nodes, as SGLang 0.5.23 runs one (--nnodes,
--node-rank, --dist-init-addr; spellings checked against its parser in
tests/conformance/test_launch_args.py). One rollout rank per engine node: the MPI world, the Slurm
component and the GPU placement count them; the layouts SGLang or hpcrl cannot run are refused
naming the key; the follower nodes' records and logs have names of their own. Runs with such
engines (reference backend, CPU): tests/e2e/conftest.py's reference run (checked in
test_cpu_bind_run, compared in test_resume) and test_engine_death's follower case."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcrl.config import ConfigError, JobConfig, load_job, validate
from hpcrl.rollout.engine_watch import EngineRecord, describe, record_path
from hpcrl.rollout.placement import PlacementError, check_engine_hosts, engine_node_gpus, slurm_node_roles
from launch.slurm_submit import job_spec

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
DEEPSEEK = REPO / "examples" / "deepseek_v3_671b.yaml"


def _job(nodes: int = 2, tp: int = 16, rollout_nodes: int = 4, **rollout) -> JobConfig:
    """The tiny preset on 2 SGLang engines of `tp` GPUs over `nodes` nodes of 8 GPUs each."""
    job = JobConfig()
    job.model.dtype = "bfloat16"
    job.rollout.logprob_tolerance, job.rollout.logprob_mean_tolerance = 1.0, 0.02  # the bf16 sync check
    job.resources.device, job.resources.gpus_per_node = "cuda", 8
    job.resources.rollout_nodes = rollout_nodes
    job.rollout.backend, job.rollout.num_engines, job.rollout.tp_per_engine = "sglang", 2, tp
    job.rollout.nodes_per_engine, job.rollout.dp_attention = nodes, tp  # 4 heads: attention TP 1
    for key, value in rollout.items():
        setattr(job.rollout, key, value)
    return job


def test_one_rollout_rank_per_engine_node_in_the_world_and_on_slurm(tmp_path):
    job = _job()
    validate(job)
    assert job.world_size == 1 + 1 + 4 and engine_node_gpus(job) == 8
    roles = slurm_node_roles(job)
    assert [key for key, _ in roles] == ["resources.nodes"] + ["resources.rollout_nodes"] * 4
    assert [ranks for _, ranks in roles[1:]] == [[(r, "rollout")] for r in (2, 3, 4, 5)]
    spec, _, _ = job_spec(job, tmp_path / "run", "debug")
    rollout = spec.components[1]
    assert (rollout.nodes, rollout.ntasks_per_node, rollout.gpus_per_node) == (4, 1, 8)
    assert spec.world_size == job.world_size


def test_the_deepseek_v3_example_validates_with_engines_over_four_nodes():
    job = load_job(DEEPSEEK)
    assert (job.rollout.num_engines, job.rollout.tp_per_engine, job.rollout.nodes_per_engine) == (4, 32, 4)
    assert job.resources.rollout_nodes == 16 and engine_node_gpus(job) == job.resources.gpus_per_node
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "plan", str(DEEPSEEK)], capture_output=True,
                         text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "4 engines x tp=32 ep=32 dp_attention=32, each engine over 4 nodes" in out.stdout, out.stdout


@pytest.mark.parametrize(("job", "path", "words"), [
    (_job(nodes=4, tp=32, rollout_nodes=8), "", None),  # fits: 32 = 4 nodes x 8 GPUs
    (_job(nodes=3), "rollout.nodes_per_engine", "splits an engine's rollout.tp_per_engine=16 GPUs evenly"),
    (_job(weight_sync="shard", dp_attention=1, tp=4), "rollout.weight_sync",
     "shard loader has not been run on an engine over several nodes"),
    (_job(rollout_nodes=5), "resources.rollout_nodes",
     "set rollout_nodes = num_engines x nodes_per_engine = 4"),
    (_job(nodes=0), "rollout.nodes_per_engine", ">= 1"),
    (_job(backend="reference", tp=1, dp_attention=1), "rollout.nodes_per_engine",
     "the reference engine computes on its first node alone"),
], ids=["fits", "tp-not-divisible", "shard-route", "rollout-nodes", "zero", "reference-gpu"])
def test_layouts_that_cannot_run_name_the_key(job, path, words):
    if words is None:
        validate(job)
        return
    with pytest.raises(ConfigError) as exc:
        validate(job)
    assert exc.value.path == path and words in str(exc.value), str(exc.value)


@pytest.mark.parametrize("flag", ["--nnodes", "--node-rank", "--dist-init-addr=h:1"])
def test_the_node_flags_are_the_jobs_not_server_args(flag):
    job = _job(server_args=[flag, "2"] if "=" not in flag else [flag])
    with pytest.raises(ConfigError) as exc:
        validate(job)
    assert exc.value.path == "rollout.server_args[0]" and "set rollout.nodes_per_engine" in str(exc.value)


def test_an_engines_nodes_must_be_on_hosts_of_their_own():
    """Locally (no Slurm layout to check in validation) every rollout rank checks at start."""
    job = _job()
    ranks = [SimpleNamespace(rank=0, role="controller", host="a"),
             SimpleNamespace(rank=1, role="trainer", host="a"),
             *(SimpleNamespace(rank=r, role="rollout", host=h)
               for r, h in zip((2, 3, 4, 5), "bcdd", strict=True))]
    world = SimpleNamespace(ranks=ranks, ranks_of=lambda role: [r.rank for r in ranks if r.role == role])
    with pytest.raises(PlacementError, match=r"engine 1 spans rollout.nodes_per_engine=2 nodes but its "
                                             r"rollout ranks \[4, 5\] run on hosts \['d', 'd'\]"):
        check_engine_hosts(world, job)
    ranks[5].host = "e"
    check_engine_hosts(world, job)
    job.rollout.backend = "reference"  # its followers compute nothing: one host is fine
    ranks[5].host = "d"
    check_engine_hosts(world, job)


def _join_watcher(name: str) -> None:
    """Wait for the EngineRecord's watcher thread (it records the exit, or not, then ends)."""
    for thread in threading.enumerate():
        if thread.name == name:
            thread.join(timeout=30)


def test_a_follower_nodes_record_and_log_are_its_own(tmp_path):
    (tmp_path / "logs").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    record = EngineRecord(tmp_path, 1, 5, socket.gethostname(), proc, "http://127.0.0.1:1", node=1)
    assert record.path == record_path(tmp_path, 1, 1) == tmp_path / "logs" / "engine1-node1.json"
    _join_watcher("engine1-node1-watch")
    death = describe(json.loads(record.path.read_text()))
    assert death.startswith("engine 1 node 1 (rollout rank 5, host ") and "exited with code 3" in death
    assert death.endswith("see RUN_DIR/logs/engine1-node1.log")
    # exit 0: node 0 stopped it (its rank's shutdown may come first), no death
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    record = EngineRecord(tmp_path, 1, 5, socket.gethostname(), proc, "http://127.0.0.1:1", node=1)
    _join_watcher("engine1-node1-watch")
    assert record.death() is None and "exit" not in json.loads(record.path.read_text())


def test_the_rendezvous_port_has_free_ports_after_it(monkeypatch):
    """SGLang takes the ports after --dist-init-addr's: node 0's rank picks a block free now. A
    candidate with a held port in its block is passed over for the next."""
    import socket as sockets

    from hpcrl import dist

    first = dist.free_port_block("127.0.0.1", 7)
    held = sockets.socket()
    held.bind(("127.0.0.1", first + 3))
    candidates = iter([first, first + 10, first + 20])
    monkeypatch.setattr(dist, "free_port", lambda host: next(candidates))
    try:
        assert dist.free_port_block("127.0.0.1", 7) == first + 10
    finally:
        held.close()


def test_hpcrl_run_refuses_sglang_engines_over_nodes_before_it_starts(tmp_path):
    """`hpcrl run` puts every rank on this host; SGLang's nodes would share it (and its ports)."""
    example = str(REPO / "examples" / "tiny_moe_grpo.yaml")
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "run", example,
                          "--run-dir", str(tmp_path / "run"), "--set", "rollout.backend=sglang", "--set",
                          "resources.device=cuda", "--set", "rollout.nodes_per_engine=2", "--set",
                          "rollout.tp_per_engine=2", "--set", "rollout.weight_sync=broadcast"],
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 2 and not (tmp_path / "run").exists(), out.stderr[-2000:]
    assert out.stderr.strip() == ("hpcrl run: error: rollout.nodes_per_engine=2: `hpcrl run` starts every "
                                  "rank on this host, and an SGLang engine's nodes need a host each: run it "
                                  "with `hpcrl submit`, or set rollout.nodes_per_engine: 1"), out.stderr


def test_a_generation_wait_stops_at_an_engine_nodes_death(tmp_path):
    """An SGLang engine whose follower node died hangs in its collectives instead of answering:
    the controller's wait for the engines reads their records and stops at the death (within
    groups.DEATH_CHECK_S), instead of waiting out resources.timeout_s for a heartbeat."""
    from hpcrl.controller.comm import RankFailure
    from hpcrl.controller.groups import DEATH_CHECK_S, PendingRollout, RolloutGroup
    from hpcrl.rollout.client import EngineClient

    hung = socket.socket()  # node 0: takes the request, never answers
    hung.bind(("127.0.0.1", 0))
    hung.listen()
    ranks = [SimpleNamespace(rank=r, role=role, host="h") for r, role in enumerate(("controller", "trainer",
                                                                                     "rollout", "rollout"))]
    world = SimpleNamespace(ranks=ranks, ranks_of=lambda role: [r.rank for r in ranks if r.role == role])
    group = RolloutGroup(world, timeout_s=60, nodes_per_engine=2, run_dir=tmp_path)
    assert group.leaders == [2]
    client = EngineClient(f"http://127.0.0.1:{hung.getsockname()[1]}", timeout_s=60)
    started = PendingRollout(0, None, [(2, client.start("POST", "/generate", {"input_ids": [[1]]}))])
    (tmp_path / "logs").mkdir()
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    EngineRecord(tmp_path, 0, 3, "h", proc, "http://127.0.0.1:1", node=1)
    begin = time.monotonic()
    try:
        with pytest.raises(RankFailure,
                           match=r"^engine 0 node 1 \(rollout rank 3, host h\) died at .*SIGKILL"):
            group._await(started, None)
    finally:
        client.close()
        hung.close()
    assert time.monotonic() - begin < DEATH_CHECK_S + 10  # not the 60 s deadline
