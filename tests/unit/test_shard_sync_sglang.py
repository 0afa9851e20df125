"""The shard route into SGLang engines, trainer and controller side (hpcrl/trainer/shard_sync.py,
hpcrl/rollout/shard_requests.py), on CPU.

Two trainer processes (TP 2 / EP 2, each holding its Megatron-named shards, built from full HF
tensors by moe.hf_megatron's own mapping) run ShardSync as a run does: connect (group ranks
T + engine index * tp + TP rank), then pushes; trainer rank 0 also plays the controller's part,
ShardRequests: each push one weight-update session per engine with `/update_weights_from_tensor`
naming hpcrl's loader. The engines are tests/sglang_server_stand_in.py: SGLang's routes and
session rules around two TP worker processes that receive through the real loader
(hpcrl/rollout/sglang_shard_loader.py) into SGLang-shaped parameters. Checked: both pushes land
bit-exact (the second's requests written before a stand-in update, received on prepared rounds);
an engine whose session is already open refuses, the push fails at once naming the engine and
SGLang's message, and the failed push leaves every session closed. SGLang's own code is checked
against the same request in tests/conformance/test_shard_loader.py; NCCL and real SGLang need a GPU
(tests/gpu).
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
import torch.multiprocessing as mp

from hpcrl.rollout.reshard_route import spec_at_dtype
from hpcrl.rollout.sglang_shard_loader import LOADER
from sglang_server_stand_in import serve
from sglang_stand_in import full_tensors, hf_config, sglang_params
from stores import hosted_store, joined_store

TRAINERS, ENGINES, ENGINE_TP = 2, 2, 2


class _Policy:
    """What ShardSync reads of a MegatronPolicy: Megatron-named params, the model dims, rank coords."""

    def __init__(self, cfg: dict, rank: int) -> None:
        from moe.hf_megatron import HFModelDims, RankCoords

        self.dims = HFModelDims.from_hf_config(cfg)
        self.coords = RankCoords(tp_rank=rank, tp=TRAINERS, ep_rank=rank, ep=TRAINERS)
        self.gpt = self  # policy.gpt's named_parameters() / named_buffers(): Megatron's names
        self.params: dict[str, torch.Tensor] = {}

    def hold(self, full: dict[str, torch.Tensor]) -> None:
        """Write this rank's shards of `full` in place (as an optimizer step does)."""
        from moe.hf_megatron import local_params

        for lp in local_params(self.dims, self.coords):
            self.params.setdefault(lp.name, torch.zeros(lp.shape))
            for pc in lp.pieces:
                self.params[lp.name][pc.local_box.index] = full[pc.hf_name][pc.hf_box.index]

    def named_parameters(self):
        return iter(self.params.items())

    def named_buffers(self):  # a torch module's: DeepSeek's router bias would be one (none here)
        return iter(())


def _job(cfg_path: str):
    from hpcrl.config.load import job_from_dict

    return job_from_dict({
        "model": {"config_path": cfg_path},
        "trainer": {"num_procs": TRAINERS, "tp": TRAINERS, "ep": TRAINERS, "etp": 1},
        "rollout": {"backend": "sglang", "num_engines": ENGINES, "tp_per_engine": ENGINE_TP,
                    "weight_sync": "shard", "sync_checksum": "full"}})


def _trainer(rank: int, port: int, urls: list[str], cfg_path: str, out_dir: str) -> None:
    """Trainer rank `rank`; rank 0 also plays the controller's part (ShardRequests), as in a run."""
    import torch.distributed as dist

    from hpcrl.rollout.client import EngineClient
    from hpcrl.rollout.shard_requests import ShardRequests
    from hpcrl.trainer.shard_sync import ShardSync

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=joined_store(port, TRAINERS), rank=rank, world_size=TRAINERS)
    cfg = json.loads(open(cfg_path).read())
    spec = spec_at_dtype(cfg, "float32")
    policy = _Policy(cfg, rank)
    policy.hold(full_tensors(spec, seed=1))
    clients = [EngineClient(url, timeout_s=60) for url in urls]
    sync = ShardSync(policy, _job(cfg_path), clients if rank == 0 else None, timeout_s=60)
    sync.connect()
    info = sync.engine_request()
    requests = ShardRequests(urls, info["request"], info["tp"], info["sglang"], 60) if rank == 0 else None

    def push(version: str, deadline_s: float, update_s: float = 0.0):
        if requests is not None:
            requests.start(version, deadline_s)
            requests.watch()  # a refusal ends the push here, before any byte is sent
        time.sleep(update_s)
        out = sync.push(version)
        if requests is not None:
            requests.finish()
        return out

    report = {"v1": push("v1", 60)}
    policy.hold(full_tensors(spec, seed=2))
    report["v2"] = push("v2", 120, update_s=0.3)  # as a queued sync: requests written before the update
    if rank == 0:
        report["after_v2"] = [c.request("GET", "/server_info") for c in clients]
        for i, c in enumerate(clients):
            c.request("POST", "/stand_in/params", {"dir": f"{out_dir}/engine{i}"})
        clients[1].begin_weight_update()  # a session left open: SGLang refuses a second begin
    dist.barrier()
    sync.timeout_s = 5.0  # rank 0 sends nothing: the other trainer rank's round deadline ends it
    try:
        push("v3", 5.0)
        report["v3"] = None
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        report["v3"] = f"{type(exc).__name__}: {exc}"
    if rank == 0:
        report["after_v3"] = [c.request("GET", "/server_info") for c in clients]
    with open(os.path.join(out_dir, f"trainer{rank}.json"), "w") as f:
        json.dump(report, f)
    os._exit(0)  # leave without tearing down a group with unfinished sends


@pytest.mark.timeout(240)
def test_trainer_pushes_into_sglang_tp_workers_through_the_loader(tmp_path):
    cfg = hf_config()
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg))
    ctx = mp.get_context("spawn")
    engines, urls = [], []
    for i in range(ENGINES):
        (tmp_path / f"engine{i}").mkdir()
        ports = ctx.Queue()
        # not a daemon: its TP workers are
        engines.append(ctx.Process(target=serve, args=(ENGINE_TP, 1, cfg, [LOADER], ports)))
        engines[-1].start()
        urls.append(f"http://127.0.0.1:{ports.get(timeout=120)}")
    store = hosted_store(TRAINERS)
    procs = [ctx.Process(target=_trainer, args=(r, store.port, urls, str(cfg_path), str(tmp_path)))
             for r in range(TRAINERS)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(180)
        assert [p.exitcode for p in procs] == [0] * TRAINERS
    finally:
        for p in [*procs, *engines]:
            if p.is_alive():
                p.kill()
    reports = [json.loads((tmp_path / f"trainer{r}.json").read_text()) for r in range(TRAINERS)]
    spec = spec_at_dtype(cfg, "float32")
    model_bytes = sum(t.nbytes for t in spec.tensors)
    for v in ("v1", "v2"):  # every byte once (EP 2 / TP 2 trainers hold no replicas of one box twice)
        assert reports[0][v]["bytes"] >= model_bytes and reports[1][v] is None
    assert reports[0]["after_v2"] == [{"weight_version": "v2", "weight_update_session": False}] * ENGINES

    want_full = full_tensors(spec, seed=2)
    for i in range(ENGINES):
        for r in range(ENGINE_TP):
            got = torch.load(tmp_path / f"engine{i}" / f"tp{r}.pt")
            want = sglang_params(want_full, spec.dims, r, ENGINE_TP, 1)
            assert got.keys() == want.keys()
            bad = [n for n in want if not torch.equal(got[n], want[n])]
            assert not bad, f"engine {i}, TP worker {r}: {bad}"  # vocab padding rows: still SENTINEL

    refused = reports[0]["v3"]  # raised by ShardRequests.watch, before rank 0 sent anything
    assert refused is not None and refused.startswith("ShardPushError: shard-to-shard weight push v3 failed: "
                                                      f"engine 1 ({urls[1]}): begin_weight_update"), refused
    assert "a weight-update session is already open" in refused
    assert reports[1]["v3"] is not None  # the other trainer rank fails too (its round deadline)
    assert [e["weight_update_session"] for e in reports[0]["after_v3"]] == [False] * ENGINES  # closed


def test_engine_env_puts_hpcrl_and_moe_and_nothing_else_first_on_the_engines_path(tmp_path):
    import subprocess
    import sys

    from hpcrl.config import JobConfig
    from hpcrl.rollout.worker import engine_env, sglang_command

    job = JobConfig()
    job.rollout.backend, job.resources.device = "sglang", "cuda"
    assert engine_env(job, tmp_path, {"PYTHONPATH": "/x"}) == {"PYTHONPATH": "/x"}  # auto: broadcast
    job.rollout.weight_sync = "shard"
    (tmp_path / "model_config.json").write_text("{}")
    assert sglang_command(job, tmp_path, "h", 1)[-2:] == ["--custom-weight-loader", LOADER]
    env = engine_env(job, tmp_path, {"PYTHONPATH": "/x", "PATH": os.environ["PATH"]})
    assert engine_env(job, tmp_path, {}) == {"PYTHONPATH": f"{tmp_path}/engine_python"}  # links kept
    first, rest = env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/x" and sorted(os.listdir(first)) == ["hpcrl", "moe"]
    # SGLang's environment as the loader meets it: no site-packages of hpcrl's (python -S), only the
    # engine's PYTHONPATH and the distributions SGLang has because it needs torch, run from another
    # directory (under Slurm the engine's cwd is the run dir, not a checkout).
    site = sglang_like_site(tmp_path / "site")
    env["PYTHONPATH"] = os.pathsep.join([first, str(site)])
    probe = ("import sys, hpcrl.rollout.sglang_shard_loader as m, moe.runtime as r; "
             "assert callable(m.load); print(m.__file__); print(r.__file__); "
             "print(*sorted({n.split('.')[0] for n in sys.modules} - set(sys.stdlib_module_names)))")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = subprocess.run([sys.executable, "-S", "-c", probe],
                         env=env, cwd=elsewhere, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    loader_file, runtime_file, imported = out.stdout.splitlines()
    assert loader_file.startswith(first) and runtime_file.startswith(first), out.stdout
    assert not {"launch", "slurm_templates", "checkpoints", "yaml", "h5py", "mpi4py"} & set(imported.split())


SGLANG_SIDE_DISTRIBUTIONS = ("torch", "numpy", "typing_extensions", "filelock", "sympy", "mpmath", "networkx",
                             "jinja2", "markupsafe", "fsspec")
"""torch 2.13's requirements on CPU Linux and numpy: what every SGLang environment has because SGLang
needs torch (it has much more; the loader must not need more)."""


def sglang_like_site(path):
    """A directory of links to the top-level packages of SGLANG_SIDE_DISTRIBUTIONS only."""
    from importlib.metadata import distribution

    path.mkdir()
    for name in SGLANG_SIDE_DISTRIBUTIONS:
        dist = distribution(name)
        tops = {f.parts[0] for f in dist.files
                if not f.parts[0].endswith((".dist-info", "__pycache__", ".."))}
        for top in tops:
            src = dist.locate_file(top)
            if src.exists() and not (path / top).exists():
                (path / top).symlink_to(src)
    return path


def test_importing_hpcrl_config_loads_no_launch_code():
    """`hpcrl.config` is imported by code that runs in SGLang's environment or on engines; the Slurm
    side (launch, slurm_templates) is loaded only by validate() when it checks the slurm section."""
    import subprocess
    import sys

    probe = ("import sys, hpcrl.config, hpcrl.models.job_model, hpcrl.rollout.reshard_route; "
             "print(*sorted(m for m in sys.modules if m.split('.')[0] in ('launch', 'slurm_templates')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == []
