"""hpcrl's SGLang launch command (hpcrl/rollout/worker.py `sglang_command`) parsed by SGLang 0.5.23's
own server-argument parser (server_args.py `ServerArgs.add_cli_args`, imported from the wheel in a
subprocess with SGLang's missing dependencies stubbed): every flag exists, every value parses to what
hpcrl means, GPU placement reaches `base_gpu_id`, and the flags validation reserves are real ones."""

from __future__ import annotations

from pathlib import Path

import pytest
from sglang_wheel import parse_with_sglang

from hpcrl.config import JobConfig
from hpcrl.config.validate_rollout import SGLANG_OWNED_FLAGS, SGLANG_SHARD_LAYOUT_FLAGS
from hpcrl.rollout.sglang_shard_loader import LOADER
from hpcrl.rollout.worker import node_args, sglang_command

API_KEY, ADMIN_KEY = "test-api-key", "test-admin-key"
NODE0 = "10.0.0.9:5000"  # an engine's node 0 rendezvous (--dist-init-addr)


def _job(dtype: str, tp: int, model_path: str | None = None, server_args=(), env_setup=(),
         weight_sync: str = "auto", ep: int = 1, dp_attention: int = 1, nodes: int = 1) -> JobConfig:
    job = JobConfig()
    job.rollout.ep, job.rollout.dp_attention, job.rollout.nodes_per_engine = ep, dp_attention, nodes
    job.rollout.weight_sync = weight_sync
    job.model.dtype, job.model.path = dtype, model_path
    job.rollout.backend, job.rollout.tp_per_engine = "sglang", tp
    job.rollout.server_args, job.rollout.env_setup = list(server_args), list(env_setup)
    job.rollout.python = "/opt/sglang/bin/python" if env_setup else None
    job.resources.device = "cuda"
    return job


# (job, the engine's GPUs from hpcrl.rollout.placement, expected parsed values)
CASES = [
    (_job("bfloat16", 2), (4, 5),
     {"tp_size": 2, "base_gpu_id": 4, "load_format": "dummy", "dtype": "bfloat16", "attention_backend": None}),
    # float32: triton attention (fa3/flashinfer, deterministic inference's picks, take fp16/bf16 only)
    (_job("float32", 1, model_path="/models/qwen3"), (0,),
     {"tp_size": 1, "base_gpu_id": 0, "model_path": "/models/qwen3", "dtype": "float32",
      "attention_backend": "triton"}),
    (_job("bfloat16", 4, server_args=["--mem-fraction-static", "0.7"], env_setup=["module load cuda"]),
     (0, 1, 2, 3), {"tp_size": 4, "base_gpu_id": 0, "mem_fraction_static": 0.7}),
    (_job("bfloat16", 2, weight_sync="shard"), (2, 3),  # the shard route: hpcrl's loader in the TP workers
     {"tp_size": 2, "base_gpu_id": 2, "custom_weight_loader": [LOADER]}),
    (_job("bfloat16", 8, ep=8, dp_attention=4), tuple(range(8)),  # EP and DP attention inside the engine
     {"tp_size": 8, "ep_size": 8, "attn_dp_size": 4, "enable_dp_attention": False}),
    # an engine over 2 nodes (rollout.nodes_per_engine), as its node 1 starts it
    (_job("bfloat16", 16, dp_attention=16, nodes=2), tuple(range(8)),
     {"tp_size": 16, "nnodes": 2, "node_rank": 1, "dist_init_addr": NODE0, "base_gpu_id": 0}),
]


def _command(job: JobConfig, run_dir: Path, host: str, port: int, gpus: tuple[int, ...]) -> list[str]:
    """sglang_command as a rollout rank runs it: node 1 of an engine over several nodes."""
    return sglang_command(job, run_dir, host, port, gpus, node_args(job, 1, NODE0))


def _sglang_argv(cmd: list[str]) -> list[str]:
    """The server arguments of a launch command (after `-m sglang.launch_server`, through bash -c)."""
    i = cmd.index("sglang.launch_server")
    assert cmd[i - 1] == "-m"
    return cmd[i + 1:]


@pytest.fixture(scope="module")
def parsed(sglang_root, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("run")
    (run_dir / "model_config.json").write_text("{}")
    argvs = [_sglang_argv(_command(job, run_dir, "10.0.0.7", 31234, gpus)) for job, gpus, _ in CASES]
    for argv in argvs:  # the engine key file hpcrl writes at start-up (hpcrl/rollout/engine_auth.py)
        if "--config" in argv:
            keys = Path(argv[argv.index("--config") + 1])
            if not keys.exists():
                keys.write_text(f"api-key: {API_KEY}\nadmin-api-key: {ADMIN_KEY}\n")
    argvs.append(["--model-path", "/m", "--no-such-flag", "1"])  # the parser does refuse unknown flags
    return parse_with_sglang(sglang_root, argvs, run_dir), run_dir


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sglang_parses_hpcrl_launch_command(parsed, case):
    report, run_dir = parsed
    got = report["results"][case]
    assert "error" not in got, got
    _, _, want = CASES[case]
    assert got["host"] == "10.0.0.7" and got["port"] == 31234 and got["skip_tokenizer_init"] is True
    if "model_path" not in want:
        assert got["model_path"] == str(run_dir / "engine_model")
    for key, value in want.items():
        assert got[key] == value, (key, got[key], value)
    if got.get("config"):  # the keys reach SGLang through its --config file, not the command line
        assert (got["api_key"], got["admin_api_key"]) == (API_KEY, ADMIN_KEY)


def test_unknown_flag_is_refused(parsed):
    assert "error" in parsed[0]["results"][-1]


def test_reserved_flags_are_sglangs_spellings(parsed):
    """validate_rollout.SGLANG_OWNED_FLAGS (refused in rollout.server_args) are SGLang flags, and they hold
    every spelling (aliases included) of every setting hpcrl's launch command writes."""
    options = parsed[0]["options"]
    missing = set(SGLANG_OWNED_FLAGS) - set(options)
    assert not missing, f"not SGLang 0.5.23 flags: {sorted(missing)}"
    # the broadcast route, the shard route, EP and DP attention, an engine over nodes
    hpcrl_dests = {options[a] for job, gpus, _ in (CASES[0], *CASES[3:])
                   for a in _sglang_argv(_command(job, parsed[1], "h", 1, gpus)) if a.startswith("--")}
    spellings = {o for o, dest in options.items() if dest in hpcrl_dests}
    assert spellings <= set(SGLANG_OWNED_FLAGS), sorted(spellings - set(SGLANG_OWNED_FLAGS))


def test_shard_layout_flags_are_sglangs_spellings(parsed):
    """validate_rollout.SGLANG_SHARD_LAYOUT_FLAGS (refused in rollout.server_args with the shard route) are
    SGLang flags, with every spelling of each setting they name."""
    options = parsed[0]["options"]
    flags = set(SGLANG_SHARD_LAYOUT_FLAGS)
    assert flags <= set(options), f"not SGLang 0.5.23 flags: {sorted(flags - set(options))}"
    dests = {options[f] for f in flags}
    spellings = {o for o, dest in options.items() if dest in dests}
    assert spellings <= flags, sorted(spellings - flags)
    assert "--moe-runner-backend" in options
