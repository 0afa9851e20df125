"""GPU placement (hpcrl/rollout/placement.py) as rendered command lines and environments: for each
layout, every rank's GPUs, the trainer's device, the reference engine's --device and SGLang's launch
command, compared with golden files in tests/golden/placement/. When a change is intended, delete
the golden file: the next run writes the new render and fails once so that the file gets reviewed.
Also: the layouts validation refuses (ConfigError naming the key, exit 2 from hpcrl validate)."""

from __future__ import annotations

import shlex
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from hpcrl.config import ConfigError, JobConfig, load_job, validate
from hpcrl.rollout.placement import (PlacementError, node_plan, rank_gpus, slurm_node_roles,
                                     visible_gpu_count)
from hpcrl.rollout.worker import node_args, reference_device, sglang_command

pytestmark = pytest.mark.timeout(120)

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden" / "placement"
RUN_DIR = Path("/RUN")


def _job(**sections: dict) -> JobConfig:
    job = JobConfig()
    for section, values in sections.items():
        for key, value in values.items():
            setattr(getattr(job, section), key, value)
    return job


def _world(job: JobConfig, rank: int) -> SimpleNamespace:
    """The rank table `hpcrl submit` gives `job`: node i of the Slurm placement is host node<i>."""
    ranks = [SimpleNamespace(rank=r, role=role, host=f"node{i}")
             for i, (_, node) in enumerate(slurm_node_roles(job)) for r, role in node]
    return SimpleNamespace(rank=rank, ranks=sorted(ranks, key=lambda x: x.rank))


def render(job: JobConfig, env: dict[str, str], tmp_path: Path) -> str:
    """One line per rank: host, role, GPUs and what the rank launches or sets, as the run does."""
    (tmp_path / "model_config.json").write_text("{}")
    lines = [f"# env: {' '.join(f'{k}={v}' for k, v in sorted(env.items())) or '(none)'}; "
             f"trainer.num_procs={job.trainer.num_procs} rollout.num_engines={job.rollout.num_engines} "
             f"tp_per_engine={job.rollout.tp_per_engine} backend={job.rollout.backend} "
             f"share_gpus={job.resources.share_gpus}"]
    for info in _world(job, 0).ranks:
        gpus = rank_gpus(_world(job, info.rank), job, env=env)
        what = ""
        if info.role == "trainer":
            what = f"torch.cuda.set_device({gpus[0]})"
        elif info.role == "rollout" and job.rollout.backend == "reference":
            what = f"reference_server --device {reference_device(job, gpus)}"
        elif info.role == "rollout":
            node = [r.rank for r in _world(job, 0).ranks if r.role == "rollout"].index(info.rank)
            nodes = node_args(job, node % job.rollout.nodes_per_engine, "LEADER:29500")
            cmd = sglang_command(job, tmp_path, "HOST", 30000, gpus, nodes)
            what = shlex.join(a.replace(str(tmp_path), "/RUN").replace(sys.executable, "PYTHON") for a in cmd)
        lines.append(f"rank {info.rank} {info.host} {info.role} gpus={list(gpus)} {what}".rstrip())
    return "\n".join(lines) + "\n"


CASES = {
    # one 8-GPU node: controller, 2 trainer ranks, 3 SGLang engines of TP 2 (2 + 6 = 8 GPUs)
    "colocated_8gpu": (_job(trainer={"num_procs": 2}, model={"dtype": "bfloat16"},
                            rollout={"backend": "sglang", "num_engines": 3, "tp_per_engine": 2},
                            resources={"device": "cuda", "gpus_per_node": 8}),
                       {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}),
    # hetjob: controller + 8 trainer ranks on 2 nodes (5 + 4 ranks), 4 engines of TP 4 on 2 rollout
    # nodes, from a separate SGLang environment set up by env_setup
    "hetjob_tp4": (_job(trainer={"num_procs": 8}, model={"dtype": "bfloat16"},
                        rollout={"backend": "sglang", "num_engines": 4, "tp_per_engine": 4,
                                 "python": "/opt/sglang/bin/python",
                                 "env_setup": ["module load cuda/12.8"]},
                        resources={"device": "cuda", "nodes": 2, "rollout_nodes": 2, "gpus_per_node": 8}),
                   {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}),
    # DeepSeek-V3-sized engines: 2 engines of TP 16, each over 2 rollout nodes of 8 GPUs (SGLang
    # --nnodes 2), one rollout rank per node
    "hetjob_engines_over_nodes": (_job(trainer={"num_procs": 8}, model={"dtype": "bfloat16"},
                                       rollout={"backend": "sglang", "num_engines": 2, "tp_per_engine": 16,
                                                "nodes_per_engine": 2, "dp_attention": 16},
                                       resources={"device": "cuda", "nodes": 1, "rollout_nodes": 4,
                                                  "gpus_per_node": 8}),
                                  {"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}),
    # a 1-GPU workstation: the tiny example on CUDA, trainer and reference engine share GPU 0
    "shared_1gpu_reference": (_job(resources={"device": "cuda", "share_gpus": True}),
                              {"CUDA_VISIBLE_DEVICES": "3"}),
    # a step with per-task binding (srun --gpus-per-task): every rank uses the GPUs it sees
    "slurm_per_task": (_job(trainer={"num_procs": 2}, rollout={"num_engines": 2},
                            resources={"device": "cuda"}),
                       {"SLURM_GPUS_PER_TASK": "1", "CUDA_VISIBLE_DEVICES": "5"}),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_render_matches_golden(name, tmp_path):
    job, env = CASES[name]
    got = render(job, env, tmp_path)
    golden = GOLDEN_DIR / f"{name}.txt"
    if not golden.exists():
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(got)
        pytest.fail(f"wrote {golden}; review it and run again")
    assert got == golden.read_text(), f"placement of {name} changed; delete {golden} if this is intended"


def test_no_gpu_is_shared_without_share_gpus():
    """Every layout that fits gives each process its own GPUs (exhaustive over small layouts)."""
    for trainers in range(0, 4):
        for engines in range(0, 4):
            for tp in (1, 2, 4):
                ranks = [(0, "controller")] + [(1 + i, "trainer") for i in range(trainers)] + \
                        [(1 + trainers + i, "rollout") for i in range(engines)]
                need = trainers + engines * tp
                for gpus in range(max(need, tp), need + 2):
                    plan = node_plan(ranks, tp, gpus)
                    used = [g for v in plan.values() for g in v]
                    assert sorted(used) == list(range(need)) and len(set(used)) == len(used)


def test_node_that_does_not_fit_names_the_keys():
    ranks = [(0, "controller"), (1, "trainer"), (2, "rollout"), (3, "rollout")]
    with pytest.raises(PlacementError, match=r"has 4 GPU\(s\) but its ranks need 5.*share_gpus"):
        node_plan(ranks, 2, 4)
    with pytest.raises(PlacementError, match=r"an engine node's 8 GPUs \(rollout.tp_per_engine / "
                                             r"nodes_per_engine\) are more than the 4 of"):
        node_plan(ranks, 8, 4, share=True)
    with pytest.raises(PlacementError, match="no GPU"):
        node_plan(ranks, 1, 0, share=True)
    assert node_plan(ranks, 2, 4, share=True) == {0: (), 1: (0,), 2: (1, 2), 3: (0, 1)}


def test_visible_gpu_count_reads_cuda_visible_devices():
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": "GPU-aa,GPU-bb"}) == 2
    assert visible_gpu_count({"CUDA_VISIBLE_DEVICES": ""}) == 0


def test_run_start_refuses_a_node_that_does_not_fit():
    """Locally (no gpus_per_node, so validation cannot know) the rank refuses at start."""
    job = _job(trainer={"num_procs": 2}, resources={"device": "cuda"})
    with pytest.raises(PlacementError, match="node node0 has 2 GPU"):
        rank_gpus(_world(job, 3), job, env={"CUDA_VISIBLE_DEVICES": "0,1"})


BAD = [
    ("colocated", "trainer: {num_procs: 4}\nrollout: {backend: sglang, num_engines: 2, tp_per_engine: 4}\n"
                  "resources: {device: cuda, gpus_per_node: 8}", "resources.gpus_per_node",
     "node 0 (resources.nodes, resources.gpus_per_node=8) has 8 GPU(s) but its ranks need 12"),
    # 12 engine GPUs on 2 x 6: enough in total, but 2 engines of TP 4 land on each node
    ("rollout-nodes", "rollout: {backend: sglang, num_engines: 3, tp_per_engine: 4}\n"
                      "resources: {device: cuda, rollout_nodes: 2, gpus_per_node: 6}",
     "resources.gpus_per_node",
     "node 1 (resources.rollout_nodes, resources.gpus_per_node=6) has 6 GPU(s) but its ranks need 8"),
    ("engine-wider-than-node", "rollout: {backend: sglang, num_engines: 1, tp_per_engine: 4}\n"
                               "resources: {device: cuda, nodes: 1, rollout_nodes: 2, gpus_per_node: 2, "
                               "share_gpus: true}", "rollout.nodes_per_engine",
     "an engine runs on one node unless rollout.nodes_per_engine spreads it"),
    ("owned-flag", "rollout: {backend: sglang, server_args: [--base-gpu-id=2]}\nresources: {device: cuda}",
     "rollout.server_args[0]", "hpcrl sets --base-gpu-id itself"),
    ("missing-python",
     "rollout: {backend: sglang, python: /nonexistent/bin/python}\nresources: {device: cuda}",
     "rollout.python", "no such interpreter"),
    ("python-without-sglang", f"rollout: {{backend: sglang, python: {sys.executable}}}\n"
                              "resources: {device: cuda}", "rollout.python", "cannot import sglang"),
    ("env-setup-two-lines", "rollout: {env_setup: [\"a\\nb\"]}", "rollout.env_setup[0]", "one line"),
]


@pytest.mark.parametrize(("yaml_text", "key", "words"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_validation_refuses(tmp_path, yaml_text, key, words):
    path = tmp_path / "job.yaml"
    path.write_text(textwrap.dedent(yaml_text))
    with pytest.raises(ConfigError) as info:
        validate(load_job(path))
    assert info.value.path == key and words in str(info.value), str(info.value)


def test_hpcrl_validate_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(BAD[0][1])
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "validate", str(path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "resources.gpus_per_node" in out.stderr + out.stdout


def test_slurm_node_roles_spread_evenly():
    """As launch/slurm_submit.py asks Slurm: 7 ranks on 3 nodes are 3 + 2 + 2, 9 on 2 are 5 + 4."""
    job = _job(trainer={"num_procs": 4}, rollout={"num_engines": 2}, resources={"nodes": 3})
    assert [len(ranks) for _, ranks in slurm_node_roles(job)] == [3, 2, 2]
    job = _job(trainer={"num_procs": 8}, rollout={"num_engines": 3},
               resources={"nodes": 2, "rollout_nodes": 2})
    assert [(k, len(r)) for k, r in slurm_node_roles(job)] == [("resources.nodes", 5), ("resources.nodes", 4),
                                                              ("resources.rollout_nodes", 2),
                                                              ("resources.rollout_nodes", 1)]
