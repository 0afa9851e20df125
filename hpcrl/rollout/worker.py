"""A rollout rank: launches one generation engine server, keeps it alive and stops it. The controller
sends prompts straight to the engine over SGLang's HTTP API (hpcrl/controller/groups.py); the rank
answers one heartbeat per step, so a rollout rank that died is named even if its engine lives on.
An engine over rollout.nodes_per_engine nodes has a rank per node (consecutive rollout ranks): each
starts its node with SGLang's --nnodes / --node-rank / --dist-init-addr (`node_args`; node 0's rank
picks the rendezvous, `engine_rendezvous`), and node 0's serves the HTTP API (docs/sglang.md,
"Engines over several nodes").

backend `reference`: hpcrl's reference engine (hpcrl.rollout.reference_server), CPU or GPU.
backend `sglang`: a real SGLang 0.5.x server (`python -m sglang.launch_server`) started from
`model.path`'s weights, or with dummy weights for a random-init model or an FP8 model.path (it serves
bf16; `sglang_command`); no tokenizer (token ids in and out). The trainer's initial weight sync
pushes the policy either way, and step 0's log-prob check verifies it.

Either engine is protected by the job's keys (hpcrl/rollout/engine_auth.py: RUN_DIR/engine_keys.yaml,
0600, given with --config so no key is on a command line); engine logs are user-only. SGLang runs
with --enable-deterministic-inference, without which it ignores `sampling_seed` (docs/sglang.md).
The rank records its engine in RUN_DIR/logs/engine<i>.json and, if the engine dies unasked, how it
died (hpcrl/rollout/engine_watch.py): the controller's failure report names that engine first.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from hpcrl import faults
from hpcrl.config.schema import JobConfig, engine_dtype, engine_routes, weight_sync_mode
from hpcrl.cpu_bind import CpuPlan, bind_process, report_line
from hpcrl.dist import free_port, free_port_block, routable_host
from hpcrl.rollout.engine_auth import job_keys, keys_path
from hpcrl.rollout.engine_watch import EngineDied, EngineRecord, engine_log_name, engine_name
from hpcrl.rollout.placement import check_engine_hosts, rank_gpus, sglang_gpu_args
from launch.procs import die_with_parent, stop as stop_process


FP32_LM_HEAD_FLAG = "--enable-fp32-lm-head"
"""SGLang's flag for rollout.fp32_lm_head (exec.features.enable_fp32_lm_head); the reference server
takes the same spelling."""


def engine_server_args(job: JobConfig) -> list[str]:
    """rollout.server_args, plus SGLang's flag that makes an engine return its MoE routes when
    rollout.routing_replay asks for them (without it SGLang drops the request field silently), and
    its fp32 LM head flag with rollout.fp32_lm_head. Both backends take these flags."""
    from hpcrl.rollout.client import ROUTED_EXPERTS_FLAG

    args = list(job.rollout.server_args)
    if engine_routes(job) and ROUTED_EXPERTS_FLAG not in args:
        args.append(ROUTED_EXPERTS_FLAG)
    if job.rollout.fp32_lm_head and FP32_LM_HEAD_FLAG not in args:
        args.append(FP32_LM_HEAD_FLAG)
    return args


FP32_ATTENTION = ("--attention-backend", "triton")
"""A float32 engine's attention backend. Deterministic inference (which hpcrl enables) picks fa3 on
Hopper and flashinfer on Blackwell when none is given (SGLang 0.5.23, arg_groups/overrides.py), and
both kernels take fp16/bf16 only; triton computes in the tensors' dtype, is among the deterministic
backends and keeps the radix cache."""


def fp32_attention_args(job: JobConfig) -> list[str]:
    """FP32_ATTENTION for a float32 engine whose rollout.server_args name no attention backend."""
    named = any(a.split("=")[0] == FP32_ATTENTION[0] for a in job.rollout.server_args)
    return list(FP32_ATTENTION) if engine_dtype(job) == "float32" and not named else []


def engine_parallel_args(job: JobConfig) -> list[str]:
    """rollout.ep and rollout.dp_attention as SGLang 0.5.23's --ep-size and --attn-dp-size (its
    spelling of `--dp-size N --enable-dp-attention`), each only when above 1."""
    r = job.rollout
    return [*(["--ep-size", str(r.ep)] if r.ep > 1 else []),
            *(["--attn-dp-size", str(r.dp_attention)] if r.dp_attention > 1 else [])]


def node_args(job: JobConfig, node_rank: int, dist_init_addr: str | None) -> list[str]:
    """An engine over rollout.nodes_per_engine nodes: SGLang's `--nnodes N --node-rank R
    --dist-init-addr HOST:PORT` (node 0's rendezvous); nothing for an engine of one node."""
    n = job.rollout.nodes_per_engine
    if n == 1:
        return []
    assert dist_init_addr is not None
    return ["--nnodes", str(n), "--node-rank", str(node_rank), "--dist-init-addr", dist_init_addr]


SGLANG_DIST_INIT_PORTS = 7
"""Ports SGLang 0.5.23 takes from --dist-init-addr's on: the rendezvous and, under DP attention, the
6 after it (server_args.py PortArgs.init_new, NUM_DERIVED_PORTS; tests/conformance/
test_follower_nodes.py reads it)."""


def engine_rendezvous(world, engine_index: int, node_rank: int, host: str) -> str:
    """HOST:PORT of the engine's node 0 rendezvous (SGLang's --dist-init-addr), chosen by its node 0
    rank where SGLANG_DIST_INIT_PORTS ports from it are free, and sent to the engine's other ranks.
    Collective over the rollout ranks."""
    comm = world.role_comm.Split(color=engine_index, key=node_rank)
    try:
        bracketed = f"[{host}]" if ":" in host else host
        addr = f"{bracketed}:{free_port_block(host, SGLANG_DIST_INIT_PORTS)}" if node_rank == 0 else None
        return comm.bcast(addr, root=0)
    finally:
        comm.Free()


def sglang_command(job: JobConfig, run_dir: Path, host: str, port: int,
                   gpus: tuple[int, ...] = (), nodes: Sequence[str] = ()) -> list[str]:
    """SGLang's launch command: `--model-path` is the job's model directory (its real weights) or,
    for a random-init model or an FP8 block-scaled model.path, RUN_DIR/engine_model holding only its
    config.json (without `quantization_config`) and `--load-format dummy`: the trainer's initial sync
    pushes the weights. An FP8 directory served as stored would build FP8 layers, and the trainer's
    bf16 pushes would be cast into them beside the checkpoint's scales; so the engines serve bf16, as
    the trainer holds it. Token ids in and out: no tokenizer in the engine.
    `gpus` (hpcrl.rollout.placement.rank_gpus) become `--base-gpu-id`. The interpreter is
    `rollout.python` (else this one); with `rollout.env_setup` the command runs in bash after those
    lines (`bash -c '<lines>; exec "$@"' hpcrl-engine python ...`). `--config` is the job's key file
    (engine_auth.keys_path: --api-key/--admin-api-key off the command line);
    `--enable-deterministic-inference` makes SGLang honour each request's `sampling_seed`;
    rollout.ep and rollout.dp_attention become `--ep-size` and `--attn-dp-size`
    (engine_parallel_args); `nodes` are an engine's node flags (`node_args`). With
    `rollout.weight_sync: shard`, `--custom-weight-loader` names hpcrl's loader
    (hpcrl/rollout/sglang_shard_loader.py; `engine_env` makes it importable)."""
    hf_config = json.loads((run_dir / "model_config.json").read_text())
    if job.model.path and "quantization_config" not in hf_config:
        model_dir, load = Path(job.model.path), []
    else:
        model_dir, load = run_dir / "engine_model", ["--load-format", "dummy"]
        model_dir.mkdir(exist_ok=True)
        hf_config.pop("quantization_config", None)
        # Every rollout rank writes the same file while others' engines may be reading it: a
        # rename, so no engine reads it half written.
        part = model_dir / f"config.json.{os.uname().nodename}.{os.getpid()}.part"
        part.write_text(json.dumps(hf_config, indent=2))
        os.replace(part, model_dir / "config.json")
    python = job.rollout.python or sys.executable
    cmd = [python, "-m", "sglang.launch_server", "--model-path", str(model_dir), "--host", host,
           "--port", str(port), "--tp-size", str(job.rollout.tp_per_engine), *engine_parallel_args(job),
           *nodes, *sglang_gpu_args(gpus), *load,
           "--skip-tokenizer-init", "--dtype", engine_dtype(job), "--config", str(keys_path(run_dir)),
           "--enable-deterministic-inference", *engine_server_args(job), *fp32_attention_args(job)]
    if weight_sync_mode(job) == "shard":
        from hpcrl.rollout.sglang_shard_loader import LOADER

        cmd += ["--custom-weight-loader", LOADER]
    if job.rollout.env_setup:
        script = "\n".join([*job.rollout.env_setup, 'exec "$@"'])
        cmd = ["bash", "-c", script, "hpcrl-engine", *cmd]
    return cmd


def engine_env(job: JobConfig, run_dir: Path, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The SGLang engine's environment: this one, and for the shard route `PYTHONPATH` led by
    RUN_DIR/engine_python, which holds links to hpcrl's `hpcrl` and `moe` packages and nothing else
    (the loader's imports; not hpcrl's site-packages, whose torch would shadow SGLang's)."""
    env = dict(os.environ if environ is None else environ)
    if weight_sync_mode(job) != "shard":
        return env
    import moe

    path = run_dir / "engine_python"
    path.mkdir(exist_ok=True)
    for pkg in (Path(__file__).resolve().parents[1], Path(moe.__file__).resolve().parent):
        try:  # every rollout rank of the node makes the same links
            (path / pkg.name).symlink_to(pkg, target_is_directory=True)
        except FileExistsError:
            pass
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(path), env.get("PYTHONPATH")) if p)
    return env


def _launch_sglang(job: JobConfig, run_dir: Path, host: str, port: int, log_path: Path,
                   gpus: tuple[int, ...] = (), nodes: Sequence[str] = ()) -> subprocess.Popen:
    """Start SGLang on the job's model (see `sglang_command`, `engine_env`)."""
    from hpcrl.rollout.client import open_private_log

    cmd = sglang_command(job, run_dir, host, port, gpus, nodes)
    with open_private_log(log_path) as log:  # SGLang logs its server args, the keys among them
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent,
                                env=engine_env(job, run_dir))


def reference_device(job: JobConfig, gpus: tuple[int, ...]) -> str:
    """The reference engine's --device: cpu, or cuda:N on its GPU (hpcrl.rollout.placement)."""
    return f"cuda:{gpus[0]}" if job.resources.device == "cuda" else "cpu"


def engine_init_seed(job: JobConfig) -> int:
    """The seed of a random-init engine's own weights: not the trainer's, so that the engines start
    from other weights than the policy and step 0's log-prob check tests the initial push."""
    return job.trainer.seed + 1


def rollout_handlers(job: JobConfig, run_dir: Path, world, plan: CpuPlan | None = None) -> dict:
    """The rollout rank's commands. `plan` (resources.cpu_bind): the reference engine starts where
    this rank does, on every core (beside the trainer's model build), and is moved onto its block
    once healthy; the rank itself moves onto the service cores after 'init' (hpcrl.worker_main)."""
    from hpcrl.rollout.client import EngineClient, launch_reference_server

    engine_index, node_rank = divmod(world.role_comm.Get_rank(), job.rollout.nodes_per_engine)
    state: dict = {}

    def init(cmd):
        fault = faults.planned(world.rank, "generate")  # generation never reaches this rank: the engine
        if fault is not None:                           # injects it (tests only, hpcrl/faults.py)
            os.environ["HPCRL_ENGINE_FAULT"] = fault
        host = routable_host() if job.resources.nodes + job.resources.rollout_nodes > 1 else "127.0.0.1"
        check_engine_hosts(world, job)
        nodes = node_args(job, node_rank, engine_rendezvous(world, engine_index, node_rank, host)
                          if job.rollout.nodes_per_engine > 1 else None)
        log_path = run_dir / "logs" / engine_log_name(engine_index, node_rank)
        gpus = rank_gpus(world, job) if job.resources.device == "cuda" else ()
        job_keys(run_dir)  # the key file the engine reads (made at start-up by hpcrl.worker_main)
        if job.rollout.backend == "reference":
            state["proc"], url = launch_reference_server(
                str(run_dir / "model_config.json"), reference_device(job, gpus), engine_init_seed(job),
                str(log_path),
                host=host, dtype=engine_dtype(job), threads=job.resources.cpus_per_rank,
                startup_timeout_s=job.resources.startup_timeout_s,
                extra_args=[*engine_server_args(job), *nodes],
                model_path=job.model.path, config_path=str(keys_path(run_dir)))
            if plan is not None:  # a follower node computes nothing (hpcrl/rollout/reference_nodes.py)
                cores = plan.for_engine(engine_index) if node_rank == 0 else plan.service
                bind_process(cores, state["proc"].pid)
        else:
            port = free_port(host)  # SGLang takes an explicit port
            state["proc"] = _launch_sglang(job, run_dir, host, port, log_path, gpus, nodes)
            url = f"http://{host}:{port}"
        client = EngineClient(url, timeout_s=job.resources.timeout_s)
        client.wait_healthy(job.resources.startup_timeout_s)  # a follower node: SGLang's health routes
        state["client"] = client
        state["record"] = EngineRecord(run_dir, engine_index, world.rank, world.ranks[world.rank].host,
                                       state["proc"], url, node_rank)
        return url

    def heartbeat(cmd):
        record = state.get("record")
        death = record.death() if record is not None else None
        if death is not None:
            raise EngineDied(death)
        return None

    def shutdown(cmd):
        if state.get("record") is not None:
            state["record"].stop()  # an exit from here on is asked for, not a death
        proc = state.get("proc")
        if proc is not None and proc.poll() is None:
            print(report_line(engine_name(engine_index, node_rank), proc.pid), flush=True)
            # a follower node ignores SIGTERM and exits when node 0 (stopped now by its own rank)
            # tells it to; the kill after 10 s is SGLang's backstop too
            stop_process(proc, 10)
        return None

    return {"init": init, "heartbeat": heartbeat, "shutdown": shutdown}
