"""The rollout side of `hpcrl validate`: where and how the engines run, SGLang's server arguments
(the flags hpcrl writes itself, the shard route's layout, deterministic sampling, the engine's
python) and routing replay's engine arguments. Split from hpcrl/config/validate.py, which calls
`check_rollout_layout` and `check_routing_replay`; the spellings are SGLang 0.5.23's
(tests/conformance/test_launch_args.py checks them against its parser).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from hpcrl.config.errors import ConfigError, job_field
from hpcrl.config.schema import JobConfig, engine_dtype

if TYPE_CHECKING:
    from hpcrl.config.validate import ModelDims


SGLANG_SHARD_MODEL_TYPES = ("qwen3_moe",)
"""Model types whose SGLang parameters hpcrl/rollout/sglang_shard_loader.py maps (Qwen3-MoE)."""
_DEEPSEEK_LOAD = ("SGLang 0.5.23's DeepSeek load derives parameters a custom loader does not produce: "
                  "fused_qkv_a_proj_with_mqa, and w_kc/w_vc, which it rebuilds from kv_b_proj only inside "
                  "load_weights (an update through --custom-weight-loader skips that step and leaves "
                  "decode on the old weights; dev/notes_deepseek_sglang.md)")
SHARD_ROUTE_REFUSALS = {"deepseek_v3": _DEEPSEEK_LOAD, "deepseek_v2": _DEEPSEEK_LOAD}  # one DeepseekV2ForCausalLM
"""Why the shard route refuses a model type, where there is more to say than 'not mapped'."""


ROUTES_UNSUPPORTED_ARGS = {
    "--speculative-algorithm": "speculative decoding's verify tokens are not in SGLang 0.5.23's route buffer",
    "--enable-hierarchical-cache": "a prefix loaded back from the hierarchical cache reads stale routes",
    "--enable-pdmux": "it has not been checked with the routes capture",
}
"""SGLang server arguments rollout.routing_replay refuses (dev/notes_routing_replay.md)."""


def check_routing_replay(job: JobConfig, m: ModelDims) -> None:
    """rollout.routing_replay needs MoE layers and engine arguments under which SGLang's routes are the
    ones that produced the tokens."""
    r = job.rollout
    if r.routing_replay == "none":
        return
    if not m.num_moe_layers:
        raise ConfigError("rollout.routing_replay", r.routing_replay,
                          f"{m.source} has no MoE layer to replay routes in; set rollout.routing_replay: none")
    for i, arg in enumerate(r.server_args if r.routing_replay in ("observe", "r3") else ()):
        why = ROUTES_UNSUPPORTED_ARGS.get(arg.split("=", 1)[0])
        if why:
            raise ConfigError(f"rollout.server_args[{i}]", arg, f"rollout.routing_replay={r.routing_replay}: {why}; "
                                                                 "drop it or set rollout.routing_replay: none")


_DP_OR_REPLICAS = "rollout.dp_attention (DP attention) or rollout.num_engines (replicas)"
SGLANG_LAYOUT_KEYS = {"--ep-size": "rollout.ep", "--ep": "rollout.ep", "--expert-parallel-size": "rollout.ep",
                      "--attn-dp-size": "rollout.dp_attention",
                      "--attention-data-parallel-size": "rollout.dp_attention",
                      "--enable-dp-attention": "rollout.dp_attention",
                      "--dp-size": _DP_OR_REPLICAS, "--data-parallel-size": _DP_OR_REPLICAS,
                      "--nnodes": "rollout.nodes_per_engine", "--node-rank": "rollout.nodes_per_engine",
                      "--dist-init-addr": "rollout.nodes_per_engine",
                      "--nccl-init-addr": "rollout.nodes_per_engine"}
"""SGLang 0.5.23's spellings of an engine's inner layout, which the job's keys set (the plan and the
GPU placement read them): refused in rollout.server_args, naming the key."""
SGLANG_OWNED_FLAGS = ("--model-path", "--model", "--host", "--port", "--tp-size", "--tensor-parallel-size",
                      "--base-gpu-id", "--dtype", "--skip-tokenizer-init", "--load-format", "--config",
                      "--api-key", "--admin-api-key", "--enable-deterministic-inference",
                      "--custom-weight-loader", *SGLANG_LAYOUT_KEYS)
"""SGLang 0.5.23's spellings (aliases included) of the settings hpcrl writes itself (hpcrl/rollout/worker.py
sglang_command; the keys through its --config file); tests/conformance/test_launch_args.py checks them
against SGLang's parser."""


def check_engine_nodes(job: JobConfig) -> None:
    """rollout.nodes_per_engine: SGLang splits an engine's TP ranks evenly over its nodes (0.5.23's
    check_server_args: tp_size divisible by nnodes); the engines take the broadcast route (the shard
    loader has not run across nodes); on GPUs under Slurm every engine node is a rollout node of its
    own, which `hpcrl submit` gives each of the engine's ranks in turn."""
    from hpcrl.config.schema import rollout_ranks, weight_sync_mode

    r, res = job.rollout, job.resources
    n = r.nodes_per_engine
    if n == 1:
        return
    if r.backend == "reference" and res.device != "cpu":
        raise ConfigError("rollout.nodes_per_engine", n,
                          "the reference engine computes on its first node alone (its other nodes only take "
                          "part in start and stop, to try the launch on CPU): use 1 with resources.device="
                          f"{res.device}, or rollout.backend: sglang")
    if r.backend == "sglang" and r.tp_per_engine % n:
        raise ConfigError("rollout.nodes_per_engine", n,
                          f"SGLang splits an engine's rollout.tp_per_engine={r.tp_per_engine} GPUs evenly "
                          "over its nodes: use a divisor of tp_per_engine (e.g. tp_per_engine / GPUs per "
                          "node)")
    if r.backend == "sglang" and weight_sync_mode(job) == "shard":
        raise ConfigError("rollout.weight_sync", r.weight_sync,
                          f"rollout.nodes_per_engine={n}: hpcrl's shard loader has not been run on an engine "
                          "over several nodes; use rollout.weight_sync: broadcast")
    if res.device == "cuda" and res.gpus_per_node > 0 and res.rollout_nodes != rollout_ranks(job):
        raise ConfigError("resources.rollout_nodes", res.rollout_nodes,
                          f"an engine over rollout.nodes_per_engine={n} nodes takes whole rollout nodes, one "
                          "per rank: set rollout_nodes = num_engines x nodes_per_engine = "
                          f"{rollout_ranks(job)}")


def check_rollout_layout(job: JobConfig) -> None:
    """Where and how the engines run. With device cuda and resources.gpus_per_node set, every node's
    ranks fit its GPUs as `hpcrl submit` places them (hpcrl/rollout/placement.py; a run checks again
    at start against the GPUs it sees). `rollout.env_setup` lines are single lines. For backend
    sglang: `rollout.server_args` leaves the flags hpcrl writes alone, and `rollout.python`, when it
    is a path and no env_setup runs first, exists here and imports sglang."""
    from hpcrl.rollout.placement import PlacementError, engine_node_gpus, node_plan, slurm_node_roles

    r, res = job.rollout, job.resources
    check_engine_nodes(job)
    if res.device == "cuda" and res.gpus_per_node > 0:
        for i, (key, ranks) in enumerate(slurm_node_roles(job)):
            try:
                node_plan(ranks, engine_node_gpus(job), res.gpus_per_node, res.share_gpus,
                          where=f"node {i} ({key}, resources.gpus_per_node={res.gpus_per_node})")
            except PlacementError as exc:
                bad = ("rollout.nodes_per_engine" if "an engine runs on one node" in str(exc)
                       else "resources.gpus_per_node")
                raise ConfigError(bad, job_field(job, bad), str(exc)) from None
    for i, line in enumerate(r.env_setup):
        if "\n" in line or "\r" in line:
            raise ConfigError(f"rollout.env_setup[{i}]", line, "must be one line; give one shell line per "
                                                               "list item")
    from hpcrl.rollout.worker import FP32_LM_HEAD_FLAG

    for i, arg in enumerate(r.server_args):  # both backends take it
        if arg.split("=", 1)[0] == FP32_LM_HEAD_FLAG and not r.fp32_lm_head:
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              "computes the engines' LM head in float32 while rollout.fp32_lm_head is false, "
                              "which hpcrl's metrics and docs then misreport: set rollout.fp32_lm_head: true "
                              "(hpcrl adds the flag) and remove it from server_args")
    if r.backend != "sglang":
        return
    for i, arg in enumerate(r.server_args):
        flag = arg.split("=", 1)[0]
        if flag in SGLANG_LAYOUT_KEYS:
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              f"an engine's inner layout is the job's: set {SGLANG_LAYOUT_KEYS[flag]} (hpcrl "
                              "passes it on, and hpcrl plan and the GPU placement read it); remove it from "
                              "server_args")
        if flag in SGLANG_OWNED_FLAGS:
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              f"hpcrl sets {flag} itself (from model.path, rollout.tp_per_engine, "
                              "model.dtype, the GPU placement and the job's engine keys); remove it from "
                              "server_args")
    check_sglang_determinism(job)
    if r.weight_sync == "shard":
        _check_sglang_shard_args(job)
    if r.python is not None:
        _check_engine_python(r.python, bool(r.env_setup))


SGLANG_SHARD_LAYOUT_FLAGS = {
    "--quantization": "quantized weights",
    "--enable-eplb": "EPLB (remapped expert ids)", "--ep-num-redundant-experts": "redundant experts",
    "--moe-dp-size": "MoE data parallelism", "--moe-data-parallel-size": "MoE data parallelism",
    "--pp-size": "pipeline parallelism", "--pipeline-parallel-size": "pipeline parallelism",
}
"""SGLang 0.5.23 flags (aliases included) whose engines hold parameters in another layout or
place than hpcrl's shard loader and plan assume (docs/sglang_shard_route.md, "Limits");
tests/conformance/test_launch_args.py checks the spellings against SGLang's parser. Expert
parallelism and DP attention are the job's (SGLANG_LAYOUT_KEYS, refused in server_args for every
SGLang job; rollout.ep / rollout.dp_attention above 1 refuse the shard route in validate)."""

SGLANG_SHARD_MOE_RUNNERS = ("auto", "triton")
"""--moe-runner-backend values whose fused-MoE weights keep the default layout the loader writes
(w13 gate then up, no transposition or padding)."""


def server_arg_values(args: list[str]) -> Iterator[tuple[int, str, str, str]]:
    """(index, item, flag, value) of each item of an argv list: `--flag=value`, or `--flag` and the
    next item as its value ("" at the end)."""
    for i, arg in enumerate(args):
        flag, eq, value = arg.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        yield i, arg, flag, value


def server_arg_number(i: int, arg: str, flag: str, value: str, kind: type = int) -> int | float:
    """A numeric server argument's `value` (one of `server_arg_values`) as `kind`; a ConfigError
    naming rollout.server_args[i] when it is not one."""
    try:
        return kind(value)
    except ValueError:
        raise ConfigError(f"rollout.server_args[{i}]", arg, f"{flag} takes a number, not {value!r}") from None


def _check_sglang_shard_args(job: JobConfig) -> None:
    """rollout.server_args that change what SGLang's TP workers hold, refused for the shard route."""
    for i, arg, flag, value in server_arg_values(job.rollout.server_args):
        what = SGLANG_SHARD_LAYOUT_FLAGS.get(flag)
        if flag == "--moe-runner-backend" and value not in SGLANG_SHARD_MOE_RUNNERS:
            what = f"the {value!r} MoE runner (its w13/w2 layout)"
        if what is not None:
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              f"{what} changes the parameters hpcrl's shard loader writes into (it knows "
                              f"SGLang's default Qwen3-MoE layout with --moe-runner-backend "
                              f"{' or '.join(SGLANG_SHARD_MOE_RUNNERS)}); remove it, or use "
                              f"rollout.weight_sync: broadcast")


SGLANG_UNTIED_HEADS = {"qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
"""Model types whose SGLang 0.5.23 class never ties lm_head to the embedding (DeepSeek's does)."""

SGLANG_DETERMINISTIC_ATTENTION = ("ascend", "fa3", "fa4", "flashinfer", "intel_xpu", "triton")
"""SGLang 0.5.23's DETERMINISTIC_ATTENTION_BACKEND_CHOICES (sglang/srt/arg_groups/choices.py)."""
SGLANG_HALF_ONLY_ATTENTION = ("fa3", "fa4", "flashinfer")
"""Of those, the backends whose kernels take fp16/bf16 only (FlashAttention 3/4, FlashInfer)."""


def check_sglang_determinism(job: JobConfig) -> None:
    """hpcrl starts SGLang with --enable-deterministic-inference, without which SGLang ignores each
    request's sampling_seed (sampling_batch_info.py). In that mode SGLang samples with its pytorch
    backend, which serves temperature and top_p with a seed (layers/sampler.py), and needs a
    batch-invariant attention backend. Refuses rollout.server_args it cannot serve: another
    --sampling-backend (SGLang would replace it with pytorch, with a warning only) and an
    --attention-backend outside SGLANG_DETERMINISTIC_ATTENTION."""
    for i, arg, flag, value in server_arg_values(job.rollout.server_args):
        if flag == "--sampling-backend" and value != "pytorch":
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              "hpcrl runs SGLang with --enable-deterministic-inference (seeded, reproducible "
                              "sampling), which samples with the pytorch backend; remove --sampling-backend")
        if flag == "--attention-backend" and value in SGLANG_HALF_ONLY_ATTENTION and engine_dtype(job) == "float32":
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              f"the engines run in float32 (rollout.dtype / model.dtype), which the {value} kernels "
                              "do not take (fp16/bf16 only); use --attention-backend triton (hpcrl's choice for "
                              "float32 engines when none is given), or rollout.dtype: bfloat16")
        if flag == "--attention-backend" and value not in SGLANG_DETERMINISTIC_ATTENTION:
            raise ConfigError(f"rollout.server_args[{i}]", arg,
                              "SGLang's deterministic inference (which hpcrl enables for seeded sampling) "
                              f"needs one of {', '.join(SGLANG_DETERMINISTIC_ATTENTION)}; use one of "
                              "those or leave --attention-backend out (SGLang then picks one)")


def _check_engine_python(python: str, has_env_setup: bool) -> None:
    """rollout.python: non-empty; a path (no env_setup) must exist here and import sglang."""
    if not python.strip():
        raise ConfigError("rollout.python", python, "must be an interpreter path or name, or null for the "
                                                    "rollout rank's own")
    if has_env_setup or "/" not in python:
        return  # resolved on the engine's node, after env_setup
    if not (Path(python).is_file() and os.access(python, os.X_OK)):
        raise ConfigError("rollout.python", python, "no such interpreter (or not executable); give the "
                                                    "python of the SGLang environment "
                                                    "(docs/sglang_install.md)")
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
    try:
        out = subprocess.run([python, "-c", probe], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ConfigError("rollout.python", python, f"cannot run it ({exc})") from None
    if out.returncode:
        raise ConfigError("rollout.python", python, "this interpreter cannot import sglang; install SGLang "
                                                    "0.5.x into its environment (docs/sglang_install.md)")
