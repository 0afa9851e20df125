"""Semantic checks of a typed `JobConfig`: field ranges and choices, then cross-field constraints.

`validate(job)` raises the first problem as a `ConfigError` naming the YAML key to change, the bad
value and the valid values (for parallel sizes: the nearest sizes that fit the model). It reads the
model's HF config.json, the data file and the reward import path, but needs no GPU and no process
group: hardware availability is checked when the run starts. Model configs are parsed by
`moe.hf_megatron.HFModelDims`, the parser the trainer and weight sync use; layout facts are from
megatron-core 0.16.1 (transformer_config.py, attention.py) and notes/python_stack.md.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpcrl.algorithms import KL_ESTIMATORS, LOSS_AGGS, MIS_LEVELS
from hpcrl.config.errors import ConfigError, did_you_mean, job_field
from hpcrl.config.schema import (AlgorithmConfig, CriticConfig, JobConfig, RolloutConfig, critic_enabled,
                                 data_parallel_size, engine_dtype, rollout_correction,
                                 splits_into_mini_batches, weight_sync_mode)
from hpcrl.config.validate_data import (  # noqa: F401 (read_model_config, prompt_limit: re-exported)
    CONTEXT_RESERVE, check_data_and_reward, job_tokenizer, prompt_limit, read_model_config, task_draws)
from hpcrl.config.validate_rollout import (SGLANG_SHARD_MODEL_TYPES, SGLANG_UNTIED_HEADS, SHARD_ROUTE_REFUSALS,
                                           check_rollout_layout, check_routing_replay)
from hpcrl.dataflows._declared import PER_ALGORITHM_KEYS, declared
from hpcrl.tasks import TASKS
from moe.activation_memory import RECOMPUTE_GRANULARITIES, RECOMPUTE_METHODS
from moe.hf_megatron import HFModelDims, stage_ranges, transformers_model_type

HF_INIT_MAX_PARAMS = 1_000_000_000
"""`model.random_init: hf` (and auto's choice of it) up to this many parameters: transformers' init
draws the whole model on one trainer rank (hpcrl/trainer/weight_init.py)."""

ALGORITHMS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo", "ppo", "sft")  # hpcrl.controller.api.BUILTIN_ALGORITHMS
DTYPES = ("float32", "bfloat16")
LR_SCHEDULES = ("constant", "linear", "cosine")  # Megatron-core's lr_decay_style names
RANDOM_INITS = ("auto", "hf", "sharded")
OVERLONG_PROMPTS = ("error", "drop")
DEVICES = ("cpu", "cuda")
CPU_BINDS = ("none", "auto", "apart")
DISPATCHERS = ("alltoall", "allgather")
BACKENDS = ("reference", "sglang")
WEIGHT_SYNCS = ("auto", "shard", "broadcast")
ROUTING_REPLAYS = ("none", "observe", "r3", "r2")
RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe", "shared_experts", "mlp", "mla_up_proj")
"""Megatron-core 0.16's recompute_modules that the trainer's build can take; its "moe_act" needs
grouped GEMM experts, which the trainer does not build (moe_grouped_gemm off)."""
SYNC_CHECKSUMS = ("sampled", "full", "off")  # moe._reshard_runtime.VERIFY_MODES (torch-free here)
MAX_TIMEOUT_S = 7 * 24 * 3600
"""The longest timeout a job may set: socket, queue and faulthandler timeouts overflow near 1e9 s."""
_TIMEOUT = (lambda v: 0 < v <= MAX_TIMEOUT_S, f"in (0, {MAX_TIMEOUT_S}] seconds (a week at most)")
SGLANG_GREEDY_BELOW = 1e-6  # hpcrl.rollout.engine.SAMPLING_EPS (torch-free here)
"""SGLang 0.5.23 samples a temperature in [0, 1e-6) greedily, at temperature 1 (SamplingParams'
_SAMPLING_EPS, sampling/sampling_params.py); so does the reference engine."""


_RULES: list[tuple[str, Callable[[Any], bool], str]] = [
    ("name", lambda v: re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", v) is not None,
     "letters, digits, '.', '_' and '-' only, starting with a letter or digit (it names the run "
     "directory and the Slurm job)"),
    ("data.prompt_key", bool, "a non-empty column name"),
    ("data.answer_key", bool, "a non-empty column name"),
    ("data.num_prompts_per_step", lambda v: v >= 1, ">= 1"),
    ("data.max_prompt_tokens", lambda v: v >= 0, ">= 0 (0: only the model's context limits prompts)"),
    ("model.path", lambda v: v is None or v != "", "a model directory, or null for preset/config_path"),
    ("data.val_path", lambda v: v is None or v != "", "a .jsonl/.parquet file, or null"),
    ("reward.num_workers", lambda v: v >= 1, ">= 1 (reward worker processes)"),
    ("reward.timeout_s", *_TIMEOUT),
    ("reward.max_failed_steps", lambda v: v >= 0, ">= 0 (0: never stop on failing rewards)"),
    ("eval.interval_steps", lambda v: v >= 0, ">= 0 (0 disables evaluation)"),
    ("eval.num_samples", lambda v: v >= 1, ">= 1"),
    ("eval.temperature", lambda v: v == 0 or v >= SGLANG_GREEDY_BELOW,
     f"0 (greedy) or >= {SGLANG_GREEDY_BELOW:g} (below it SGLang decodes greedily anyway)"),
    ("eval.max_prompts", lambda v: v >= 0, ">= 0 (0: every row)"),
    ("data.seed", lambda v: 0 <= v < 2**63, "in [0, 2**63) (numpy seeds cannot be negative)"),
    ("algorithm.group_size", lambda v: v >= 2, ">= 2: advantages compare the completions of a group"),
    ("algorithm.clip_eps", lambda v: v is None or 0 < v < 1,
     "in (0, 1), e.g. 0.2, or null (the algorithm's)"),
    ("algorithm.clip_eps_high", lambda v: v is None or v >= 0,
     ">= 0 (0 means algorithm.clip_eps), e.g. 0.28, or null (the algorithm's)"),
    ("algorithm.clip_ratio_c", lambda v: v is None or v > 1,
     "> 1, e.g. 3.0 (verl's dual clip), or null (off)"),
    ("algorithm.kl_coef", lambda v: v >= 0, ">= 0 (0 disables the KL penalty)"),
    ("algorithm.loss_agg_norm", lambda v: v >= 0, ">= 0 (0 means rollout.max_new_tokens)"),
    ("algorithm.ppo_epochs", lambda v: v >= 1, ">= 1"),
    ("algorithm.tis_cap", lambda v: v > 0, "> 0, e.g. 2.0"),
    ("algorithm.mis_low", lambda v: 0 < v <= 1, "in (0, 1], e.g. 0.5"),
    ("algorithm.mis_high", lambda v: v >= 1, ">= 1, e.g. 2.0"),
    ("algorithm.max_generation_rounds", lambda v: v >= 1, ">= 1"),
    ("algorithm.overlong_buffer_len", lambda v: v >= 0, ">= 0 (0 disables the overlong penalty)"),
    ("algorithm.overlong_penalty_factor", lambda v: v >= 0, ">= 0"),
    ("algorithm.mini_batch_size", lambda v: v >= 0, ">= 0 (0: the whole batch)"),
    ("algorithm.lr", lambda v: v > 0, "> 0, e.g. 1e-6 for large models, 1e-3 for the tiny preset"),
    ("algorithm.lr_warmup_steps", lambda v: v >= 0, ">= 0 (0: no warmup)"),
    ("algorithm.min_lr_ratio", lambda v: 0 <= v <= 1, "in [0, 1], e.g. 0.1"),
    ("algorithm.weight_decay", lambda v: v >= 0, ">= 0"),
    ("algorithm.adam_beta1", lambda v: 0 <= v < 1, "in [0, 1), e.g. 0.9"),
    ("algorithm.adam_beta2", lambda v: 0 <= v < 1, "in [0, 1), e.g. 0.999"),
    ("algorithm.adam_eps", lambda v: v > 0, "> 0, e.g. 1e-8"),
    ("algorithm.grad_clip", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("algorithm.entropy_coef", lambda v: v >= 0, ">= 0 (0 disables the entropy bonus), e.g. 0.01"),
    ("algorithm.aux_loss_coef", lambda v: v is None or v >= 0,
     ">= 0 (0 turns the load-balancing loss off), or null (the model's config.json)"),
    ("algorithm.num_steps", lambda v: v >= 1, ">= 1"),
    ("algorithm.gamma", lambda v: 0 <= v <= 1, "in [0, 1], e.g. 1.0"),
    ("algorithm.lam", lambda v: 0 <= v <= 1, "in [0, 1], e.g. 0.95 or 1.0"),
    ("algorithm.kl_target", lambda v: v >= 0, ">= 0 (0 keeps algorithm.kl_coef fixed), e.g. 6.0"),
    ("algorithm.kl_horizon", lambda v: v > 0, "> 0 samples, e.g. 10000"),
    ("critic.lr", lambda v: v >= 0, ">= 0 (0 means algorithm.lr), e.g. 1e-5"),
    ("critic.weight_decay", lambda v: v >= 0, ">= 0"),
    ("critic.grad_clip", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("critic.value_clip", lambda v: v >= 0, ">= 0 (0 disables value clipping), e.g. 0.2"),
    ("critic.warmup_steps", lambda v: v >= 0, ">= 0"),
    ("trainer.tp", lambda v: v >= 1, ">= 1"),
    ("trainer.pp", lambda v: v >= 1, ">= 1"),
    ("trainer.ep", lambda v: v >= 1, ">= 1"),
    ("trainer.etp", lambda v: v >= 1, ">= 1"),
    ("trainer.cp", lambda v: v >= 1, ">= 1"),
    ("trainer.first_stage_layers", lambda v: v >= 0, ">= 0 (0 splits the layers evenly)"),
    ("trainer.last_stage_layers", lambda v: v >= 0, ">= 0 (0 splits the layers evenly)"),
    ("trainer.num_procs", lambda v: v >= 1, ">= 1"),
    ("trainer.micro_batch_size", lambda v: v >= 1, ">= 1"),
    ("trainer.logprob_micro_batch_size", lambda v: v >= 0, ">= 0 (0: trainer.micro_batch_size)"),
    ("trainer.recompute_num_layers", lambda v: v >= 1, ">= 1"),
    ("trainer.max_tokens_per_micro_batch", lambda v: v >= 0,
     ">= 0 (0: micro-batches of trainer.micro_batch_size sequences)"),
    ("trainer.seed", lambda v: 0 <= v < 2**63, "in [0, 2**63)"),
    ("rollout.num_engines", lambda v: v >= 1, ">= 1"),
    ("rollout.tp_per_engine", lambda v: v >= 1, ">= 1"),
    ("rollout.nodes_per_engine", lambda v: v >= 1, ">= 1 (1: an engine on one node)"),
    ("rollout.ep", lambda v: v >= 1, ">= 1"),
    ("rollout.dp_attention", lambda v: v >= 1, ">= 1"),
    ("rollout.temperature", lambda v: v >= SGLANG_GREEDY_BELOW,
     f">= {SGLANG_GREEDY_BELOW:g} (1.0 samples the policy as is; below it SGLang samples greedily and returns "
     "log-probs at temperature 1, which the trainer's would not match)"),
    ("rollout.top_p", lambda v: 0 < v <= 1, "in (0, 1]; 1.0 disables nucleus sampling"),
    ("rollout.max_new_tokens", lambda v: v >= 1, ">= 1"),
    ("rollout.logprob_tolerance", lambda v: v > 0, "> 0, e.g. 1e-4 (float32) or 1.0 (bfloat16 engines)"),
    ("rollout.logprob_mean_tolerance", lambda v: v >= 0, ">= 0 (0 disables it), e.g. 2e-2 for bfloat16 engines"),
    ("rollout.bucket_mb", lambda v: v >= 1, ">= 1 (MB)"),
    ("rollout.max_staleness", lambda v: v >= 0, ">= 0 (0: synchronous; k >= 1 samples the next k batches "
                                                "while the trainer trains)"),
    ("checkpoint.dir", lambda v: v is None or v != "" and not Path(v).is_file(),
     "a directory path (not an existing file), or null for RUN_DIR/checkpoints"),
    ("checkpoint.interval_steps", lambda v: v >= 0, ">= 0 (0 saves only at the end and on preemption)"),
    ("checkpoint.keep", lambda v: v >= 1, ">= 1 (the latest checkpoint is always kept)"),
    ("checkpoint.grace_s", lambda v: v > 0, "> 0 seconds"),
    ("resources.nodes", lambda v: v >= 1, ">= 1"),
    ("resources.rollout_nodes", lambda v: v >= 0, ">= 0 (0 colocates rollout with the trainer)"),
    ("resources.gpus_per_node", lambda v: v >= 0, ">= 0"),
    ("resources.cpus_per_rank", lambda v: v >= 1, ">= 1"),
    ("resources.timeout_s", *_TIMEOUT),
    ("resources.startup_timeout_s", *_TIMEOUT),
    ("network.gpus_per_node", lambda v: v >= 1, ">= 1"),
    ("network.nics_per_node", lambda v: v >= 1, ">= 1"),
    ("network.nic_gbit_per_s", lambda v: 0 < v <= 1e5, "in (0, 1e5] Gbit/s, e.g. 400 (NDR)"),
    ("network.nvlink_gbyte_per_s", lambda v: 0 < v <= 1e5, "in (0, 1e5] GB/s, e.g. 450 (H100 SXM)"),
    ("network.gpu_memory_gb", lambda v: 0 < v <= 4096, "in (0, 4096] GiB, e.g. 80 (H100)"),
    ("network.memory_budget_gb", lambda v: 1 / 16 <= v <= 4096,
     "in [0.0625, 4096] GiB, e.g. 1.0 (the shard route's staging per GPU and round: a smaller one cuts the "
     "sync into rounds by the million)"),
    ("logging.run_dir", lambda v: v is None or v != "" and not Path(v).is_file(),
     "a directory path (not an existing file), or null for runs/<name>-<time>"),
    ("logging.rollout_samples", lambda v: v >= -1, ">= -1 (the first N completions of each step; -1: all; 0: none)"),
    ("logging.wandb_project", lambda v: v is None or v.strip() != "" and len(v) <= 128 and not set(v) & set("/\\#?%:"),
     "a W&B project name (at most 128 characters, none of / \\ # ? % :), or null for no W&B"),
    ("logging.wandb_name", lambda v: v is None or v.strip() != "", "a W&B run name, or null for the run dir's name"),
]

_CHOICES: list[tuple[str, tuple[str, ...]]] = [
    ("model.dtype", DTYPES),
    ("rollout.dtype", ("auto", *DTYPES)),
    ("algorithm.rollout_correction", ("none", "tis", "mis")),
    ("algorithm.lr_schedule", LR_SCHEDULES),
    ("model.random_init", RANDOM_INITS),
    ("data.overlong_prompts", OVERLONG_PROMPTS),
    ("algorithm.kl_estimator", KL_ESTIMATORS),
    ("algorithm.loss_agg", LOSS_AGGS),
    ("algorithm.mis_level", MIS_LEVELS),
    ("trainer.dispatcher", DISPATCHERS),
    ("trainer.recompute_granularity", RECOMPUTE_GRANULARITIES),
    ("trainer.recompute_method", RECOMPUTE_METHODS),
    ("rollout.backend", BACKENDS),
    ("rollout.weight_sync", WEIGHT_SYNCS),
    ("rollout.routing_replay", ROUTING_REPLAYS),
    ("rollout.sync_checksum", SYNC_CHECKSUMS),
    ("resources.device", DEVICES),
    ("resources.cpu_bind", CPU_BINDS),
]


def _check_fields(job: JobConfig) -> None:
    for path, choices in _CHOICES:
        value = job_field(job, path)
        if value is None and path.removeprefix("algorithm.") in PER_ALGORITHM_KEYS:
            continue  # a key the algorithm does not read (_check_algorithm)
        if value not in choices:
            raise ConfigError(path, value, f"must be one of: {', '.join(choices)}"
                                           f"{did_you_mean(value, choices)}")
    for path, ok, requirement in _RULES:
        value = job_field(job, path)
        if not ok(value):
            raise ConfigError(path, value, f"must be {requirement}")


@dataclass(frozen=True)
class ModelDims:
    """The sizes of the policy model that parallel layouts must divide (from its HF config)."""

    source: str
    """How messages name the model: "preset 'tiny-qwen3-moe'" or "config.json /path"."""
    path: str
    """The YAML key that chose the model: model.preset or model.config_path."""
    num_experts: int
    num_attention_heads: int
    num_key_value_heads: int
    num_hidden_layers: int
    vocab_size: int
    expert_ffn_size: int
    max_position_embeddings: int
    tied_embeddings: bool
    model_type: str
    num_moe_layers: int = 0
    mla: bool = False
    shared_experts: bool = False


def _read_model(job: JobConfig) -> ModelDims:
    key, value, source, hf = read_model_config(job)
    try:
        # The parser the trainer and the weight sync use, so validation accepts exactly their models.
        dims = HFModelDims.from_hf_config(hf)
    except KeyError as exc:
        raise ConfigError(key, value, f"{source} lacks the key {exc.args[0]!r} (model_type "
                                      f"{hf.get('model_type')!r})") from None
    except (ValueError, TypeError) as exc:
        raise ConfigError(key, value, f"{source}: {str(exc).removeprefix('config.json ')}") from None
    if job.model.path is not None:
        _check_weights(job, dims, "model.path", job.model.path)
    elif job.model.random_init == "hf" and dims.num_params() > HF_INIT_MAX_PARAMS:
        raise ConfigError("model.random_init", "hf", f"transformers' init draws the whole model "
                                                     f"({dims.num_params():,} parameters) on trainer rank 0 and "
                                                     f"sends every tensor whole: debug sizes only, up to "
                                                     f"{HF_INIT_MAX_PARAMS:,}; use sharded (or auto)")
    if job.critic.path and critic_enabled(job):  # otherwise _check_critic refuses the key
        _check_weights(job, dims, "critic.path", job.critic.path)
    return ModelDims(source=source, path=key, num_experts=dims.num_experts,
                     num_attention_heads=dims.num_heads, num_key_value_heads=dims.num_kv_heads,
                     num_hidden_layers=dims.num_layers, vocab_size=dims.vocab_size,
                     expert_ffn_size=dims.moe_ffn_size, max_position_embeddings=dims.max_position_embeddings,
                     tied_embeddings=dims.tied_embeddings, model_type=str(hf.get("model_type")),
                     num_moe_layers=len(dims.moe_layers), mla=dims.mla is not None,
                     shared_experts=bool(dims.shared_ffn_size))


def _check_weights(job: JobConfig, dims: HFModelDims, key: str, path: str) -> None:
    """The safetensors of `path` (model.path, or critic.path: a directory of the policy's
    architecture, or a one-label reward model of it) match the model's config: every tensor there,
    none unexpected, every shape right (reads the files' headers only)."""
    from moe.hf_checkpoint import CheckpointFormatError, HFCheckpoint

    try:
        HFCheckpoint(Path(job.base_dir, path), dims, score_head=key == "critic.path").close()
    except CheckpointFormatError as exc:
        raise ConfigError(key, path, str(exc)) from None


def rows_per_prompt(job: JobConfig) -> int:
    """A step's batch rows per prompt: sft trains one demonstration of each, the RL algorithms
    algorithm.group_size completions."""
    return 1 if job.algorithm.name == "sft" else job.algorithm.group_size


def _check_algorithm_models(a: AlgorithmConfig) -> None:
    """What decides the models a job builds (hpcrl plan sizes them too): algorithm.name a built-in or
    the import path of a module with a `step` function (imported); a KL coefficient (the reference
    model) only for an algorithm with a KL term."""
    if a.name not in ALGORITHMS:
        from hpcrl.controller.api import load_algorithm

        try:
            load_algorithm(a.name)
        except ValueError as exc:
            raise ConfigError("algorithm.name", a.name, f"{exc}{did_you_mean(a.name, ALGORITHMS)}") from None
    if a.name in ("gspo", "dapo", "sft") and a.kl_coef > 0:
        raise ConfigError("algorithm.kl_coef", a.kl_coef, f"{a.name}'s loss has no KL term; set it to 0 (or "
                                                         "use grpo / reinforce_pp for a KL penalty)")


def _check_algorithm(job: JobConfig) -> None:
    """algorithm.name: a built-in, or the import path of a module with a `step` function (imported
    here, as reward.fn is); no key the algorithm would silently ignore; mini-batches that split the
    batch evenly over the data-parallel ranks; an lr schedule that fits in the run."""
    a = job.algorithm
    batch = job.data.num_prompts_per_step * rows_per_prompt(job)
    batch_rows = ("demonstrations (data.num_prompts_per_step)" if a.name == "sft" else
                  "completions (data.num_prompts_per_step * algorithm.group_size)")
    dp = data_parallel_size(job)
    if not splits_into_mini_batches(batch, a.mini_batch_size, dp):
        raise ConfigError("algorithm.mini_batch_size", a.mini_batch_size,
                          f"must divide the batch of {batch} {batch_rows} and be a multiple of the "
                          f"data-parallel size {dp}; e.g. "
                          f"{', '.join(str(m) for m in range(dp, batch + 1, dp) if batch % m == 0)[:60]}")
    _check_algorithm_models(a)
    if a.name == "sft" and a.entropy_coef > 0:
        raise ConfigError("algorithm.entropy_coef", a.entropy_coef,
                          "an entropy bonus applies to the RL algorithms; sft fits the data's answers. "
                          "Remove it")
    _check_per_algorithm_keys(a)
    _check_rollout_correction(a, rollout_correction(job))
    _check_async(job)
    if a.loss_agg_norm and a.loss_agg != "seq-mean-token-sum-norm":
        raise ConfigError("algorithm.loss_agg_norm", a.loss_agg_norm,
                          f"is the constant of loss_agg seq-mean-token-sum-norm, and {a.name} aggregates "
                          f"with {a.loss_agg}; remove it (or set algorithm.loss_agg: "
                          "seq-mean-token-sum-norm)")
    if a.name != "dapo":
        for key, default in (("max_generation_rounds", 3), ("overlong_buffer_len", 0),
                             ("overlong_penalty_factor", 1.0)):
            if getattr(a, key) != default:
                raise ConfigError(f"algorithm.{key}", getattr(a, key), f"applies to algorithm.name: dapo only "
                                                                       f"(this job runs {a.name}); remove it")
    if a.overlong_buffer_len > job.rollout.max_new_tokens:
        raise ConfigError("algorithm.overlong_buffer_len", a.overlong_buffer_len,
                          f"must be at most rollout.max_new_tokens={job.rollout.max_new_tokens}")
    if a.lr_warmup_steps and a.lr_warmup_steps >= a.num_steps:
        raise ConfigError("algorithm.lr_warmup_steps", a.lr_warmup_steps,
                          f"must be below algorithm.num_steps={a.num_steps} (the schedule's length)")
    if a.lr_schedule == "constant" and a.min_lr_ratio != AlgorithmConfig().min_lr_ratio:
        raise ConfigError("algorithm.min_lr_ratio", a.min_lr_ratio,
                          "applies to a decaying algorithm.lr_schedule (linear or cosine); "
                          "set one, or remove it")
    _check_critic(job)
    if a.clip_ratio_c is not None and a.name in ("gspo", "sft"):
        why = "clips one ratio per sequence, which dual clip does not bound" if a.name == "gspo" else \
            "has no importance ratio"
        raise ConfigError("algorithm.clip_ratio_c", a.clip_ratio_c, f"{a.name} {why}; remove the key")
    if a.name in ("rloo", "reinforce_pp", "dr_grpo", "ppo", "sft") and not a.norm_adv_by_std:
        why = "has no advantages" if a.name == "sft" else "computes its own advantages"
        raise ConfigError("algorithm.norm_adv_by_std", a.norm_adv_by_std, f"{a.name} {why} and ignores it; "
                                                                          "remove the key")


_NOT_READ = {"clip_eps": "has no importance ratio to clip",
             "clip_eps_high": "has no importance ratio to clip",
             "kl_estimator": "has no KL term", "loss_agg": "has no loss to aggregate"}


def _check_per_algorithm_keys(a: AlgorithmConfig) -> None:
    """The keys whose default is the algorithm's (hpcrl/dataflows/_declared.py): set only where the
    algorithm reads them, and a key it fixes only to its value. Unset keys were resolved when the
    config was built, so a value here that the algorithm does not read was set by the job."""
    defaults, fixed = declared(a.name)
    for key in PER_ALGORITHM_KEYS:
        value = getattr(a, key)
        reads = key in defaults or (key == "clip_eps_high" and "clip_eps" in defaults)
        if value is not None and not reads:
            raise ConfigError(f"algorithm.{key}", value, f"{a.name} {_NOT_READ[key]}, so it never reads this "
                                                         "key; remove it")
        if key in fixed and value != defaults[key]:
            raise ConfigError(f"algorithm.{key}", value, f"{a.name} always uses {defaults[key]} (it is "
                                                         "what makes the algorithm); remove the key")


def _check_rollout_correction(a: AlgorithmConfig, effective: str) -> None:
    """A correction needs engine samples (sft has none); a method's keys only with that method
    (`effective`: the correction the loss applies, schema.rollout_correction)."""
    if a.name == "sft" and a.rollout_correction != "none":
        raise ConfigError("algorithm.rollout_correction", a.rollout_correction,
                          "sft trains on the data's answers, which no engine sampled; set it to none")
    for key, method in (("tis_cap", "tis"), ("mis_low", "mis"), ("mis_high", "mis"), ("mis_level", "mis")):
        if effective != method and getattr(a, key) != getattr(AlgorithmConfig(), key):
            raise ConfigError(f"algorithm.{key}", getattr(a, key),
                              f"applies to algorithm.rollout_correction: {method} (this job has "
                              f"{effective}); remove it, or set the correction")


def _check_async(job: JobConfig) -> None:
    """rollout.max_staleness needs engine samples; rollout.partial needs max_staleness."""
    r, a = job.rollout, job.algorithm
    if r.max_staleness and a.name == "sft":
        raise ConfigError("rollout.max_staleness", r.max_staleness,
                          "sft trains on the data's answers and generates nothing to overlap; set it to 0")
    if r.max_staleness and r.temperature != 1.0:
        raise ConfigError("rollout.max_staleness", r.max_staleness,
                          f"with rollout.temperature={r.temperature:g}: the sync check scores the trained batch "
                          "again on the engines, whose input-token log-probs SGLang 0.5.23 does not scale by "
                          "the temperature (docs/async.md); set rollout.temperature: 1.0 or max_staleness: 0")
    if r.rescore_per_group != RolloutConfig().rescore_per_group and not r.max_staleness:
        raise ConfigError("rollout.rescore_per_group", r.rescore_per_group,
                          "applies to asynchronous runs (rollout.max_staleness >= 1), whose sync check scores "
                          "the trained batch again; a synchronous run checks every completion: remove it")
    if not 1 <= r.rescore_per_group <= a.group_size:
        raise ConfigError("rollout.rescore_per_group", r.rescore_per_group,
                          f"must be in [1, algorithm.group_size={a.group_size}]")
    if r.max_staleness and r.routing_replay == "r3":
        raise ConfigError("rollout.routing_replay", r.routing_replay,
                          f"with rollout.max_staleness={r.max_staleness}: the trainer would replay the routes of the "
                          "version that sampled the batch, while the sync check scores it again on the engines, "
                          "which route with the new version: they differ wherever a router moved, and the check "
                          "fails. Use r3 with max_staleness: 0, or observe (it measures) / r2 here")
    if r.max_staleness and critic_enabled(job) and job.critic.warmup_steps:
        raise ConfigError("critic.warmup_steps", job.critic.warmup_steps,
                          f"with rollout.max_staleness={r.max_staleness}: warmup steps train only the critic and push "
                          "no weights, and an asynchronous run needs a new policy version every step; set "
                          "critic.warmup_steps: 0 or rollout.max_staleness: 0")
    if r.partial and r.max_staleness < 2:  # docs/async.md, "Partial rollouts"
        raise ConfigError("rollout.partial", r.partial,
                          f"with rollout.max_staleness={r.max_staleness}: a partial rollout is sampled by the "
                          "versions pushed while it waits, and only max_staleness >= 2 leaves it more than one; "
                          "set rollout.max_staleness: 2 (or more), or remove rollout.partial")


def _check_critic(job: JobConfig) -> None:
    """critic.* and ppo's own algorithm keys only where a critic is built; the KL controller's
    target needs a KL penalty to adapt."""
    a, c = job.algorithm, job.critic
    if not critic_enabled(job):
        for key, value in dataclasses.asdict(c).items():
            if value != getattr(CriticConfig(), key):
                raise ConfigError(f"critic.{key}", value, f"applies when a critic is built: algorithm.name: ppo "
                                                          f"(this job runs {a.name}) or critic.enabled: true; "
                                                          "remove it")
    if a.name != "ppo":
        for key in ("gamma", "lam", "kl_target", "kl_horizon"):
            if getattr(a, key) != getattr(AlgorithmConfig(), key):
                raise ConfigError(f"algorithm.{key}", getattr(a, key), f"applies to algorithm.name: ppo only "
                                                                       f"(this job runs {a.name}); remove it")
    if a.kl_target > 0 and a.kl_coef == 0:
        raise ConfigError("algorithm.kl_target", a.kl_target, "the adaptive KL controller adapts "
                                                              "algorithm.kl_coef: set it > 0 (its start value, "
                                                              "e.g. 0.05), or algorithm.kl_target: 0")
    if c.warmup_steps >= a.num_steps and critic_enabled(job):
        raise ConfigError("critic.warmup_steps", c.warmup_steps, f"must be below algorithm.num_steps="
                                                                 f"{a.num_steps}, or the policy never trains")


def _check_engine_dtype(job: JobConfig) -> None:
    """bfloat16 on either side of the sync check needs the bf16 check (docs/config.md): engine and
    trainer round differently, so single tokens' log-probs move though the weights are the same."""
    r = job.rollout
    if "bfloat16" not in (engine_dtype(job), job.model.dtype) or (
            r.logprob_tolerance >= 0.1 and r.logprob_mean_tolerance > 0):
        return
    if job.model.dtype == "bfloat16":
        key, value, what = "model.dtype", job.model.dtype, "bfloat16 training (engines and trainer round apart)"
    else:
        key, value, what = "rollout.dtype", r.dtype, "a bfloat16 engine against the float32 trainer"
    raise ConfigError(key, value,
                      f"{what} moves single tokens' log-probs by up to ~0.5, so "
                      f"rollout.logprob_tolerance={r.logprob_tolerance:g} would stop the run while the mean "
                      "check is off; set rollout.logprob_tolerance: 1.0 and rollout.logprob_mean_tolerance: "
                      "0.02 (a wrong weight moves every token: benchmarks/RESULTS.md, bf16_sync_check)")


def _check_wandb(job: JobConfig) -> None:
    """logging.wandb_project needs the wandb package where the controller runs (this environment)."""
    import importlib.util

    if job.logging.wandb_project is not None and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb_project", job.logging.wandb_project,
                          "W&B logging needs the wandb package in hpcrl's environment: `bash install.sh "
                          "--wandb` (or pip install wandb), or logging.wandb_project: null")


def _check_profile_steps(job: JobConfig) -> None:
    """logging.profile_steps: steps the run has, each once."""
    steps, n = job.logging.profile_steps, job.algorithm.num_steps
    for i, step in enumerate(steps):
        if not 0 <= step < n:
            raise ConfigError(f"logging.profile_steps[{i}]", step, f"a step of the run, in [0, algorithm.num_steps="
                                                                   f"{n}): the first step is 0")
        if step in steps[:i]:
            raise ConfigError(f"logging.profile_steps[{i}]", step, "each step once: remove the repeat")


def _check_eval(job: JobConfig) -> None:
    """Evaluation (at intervals or before training) needs held-out prompts, and several samples per
    prompt need sampling."""
    ev = job.eval
    if ev.interval_steps > 0 and not job.data.val_path:
        raise ConfigError("eval.interval_steps", ev.interval_steps, "evaluation needs held-out prompts: "
                                                                   "set data.val_path, or eval.interval_steps: 0")
    if ev.before_train and not job.data.val_path:
        raise ConfigError("eval.before_train", ev.before_train, "evaluation needs held-out prompts: "
                                                               "set data.val_path, or eval.before_train: false")
    if ev.num_samples > 1 and ev.temperature == 0:
        raise ConfigError("eval.num_samples", ev.num_samples, "greedy samples (eval.temperature: 0) are all "
                                                             "the same: set eval.temperature > 0 (e.g. 1.0) "
                                                             "or eval.num_samples: 1")


def _nearest(candidates: Iterable[int], bad: int, k: int = 4) -> str:
    """The k candidates closest to `bad`, ascending, as 'a, b, c'."""
    best = sorted(set(candidates), key=lambda v: (abs(v - bad), v))[:k]
    return ", ".join(str(v) for v in sorted(best))


def _divisors(n: int) -> list[int]:
    return [v for v in range(1, n + 1) if n % v == 0]


def _check_parallel(job: JobConfig, m: ModelDims) -> None:
    """Megatron layout constraints: each parallel size divides the model dimension it splits."""
    t = job.trainer
    src = m.source

    def tp_fits(tp: int) -> bool:
        # Megatron 0.16.1 also accepts tp a multiple of the KV heads (it replicates them), but
        # moe/hf_megatron.py maps only whole KV groups per TP rank, so weight sync needs kv % tp == 0.
        return not (m.num_attention_heads % tp or m.num_key_value_heads % tp or m.vocab_size % tp)

    valid_tp = f"valid tp for this model: {_nearest(filter(tp_fits, _divisors(m.num_attention_heads)), t.tp)}"
    if m.num_attention_heads % t.tp:
        raise ConfigError("trainer.tp", t.tp, f"num_attention_heads={m.num_attention_heads} of {src} "
                                              f"is not divisible by tp={t.tp}; {valid_tp}")
    if m.num_key_value_heads % t.tp:
        raise ConfigError("trainer.tp", t.tp, f"num_key_value_heads={m.num_key_value_heads} of {src} is "
                                              f"not divisible by tp={t.tp} (each TP rank holds whole KV "
                                              f"groups); {valid_tp}")
    if m.vocab_size % t.tp:
        raise ConfigError("trainer.tp", t.tp, f"vocab_size={m.vocab_size} of {src} is not divisible by "
                                              f"tp={t.tp} (vocab-parallel embedding); {valid_tp}")
    try:
        stage_ranges(m.num_hidden_layers, t.pp, t.first_stage_layers, t.last_stage_layers)
    except ValueError as exc:
        raise ConfigError("trainer.pp", t.pp, f"{exc} (of {src}); valid pp with even stages: "
                                              f"{_nearest(_divisors(m.num_hidden_layers), t.pp)}") from None
    for key, dim_name, dim in (("trainer.ep", "num_experts", m.num_experts),
                               ("trainer.etp", "expert FFN size", m.expert_ffn_size)):
        size = job_field(job, key)
        if dim % size:
            leaf = key.split(".")[1]
            raise ConfigError(key, size, f"{dim_name}={dim} of {src} is not divisible by {leaf}={size}; "
                                         f"valid {leaf}: {_nearest(_divisors(dim), size)}")
    dense, expert = t.tp * t.pp, t.ep * t.etp * t.pp
    step = math.lcm(dense, expert)
    if t.num_procs % step:
        valid = [step * k for k in range(max(1, t.num_procs // step - 1), t.num_procs // step + 3)]
        raise ConfigError("trainer.num_procs", t.num_procs,
                          f"ranks do not add up: num_procs must be a multiple of tp*pp={dense} (dense "
                          f"layers: dp = num_procs/(tp*pp)) and of ep*etp*pp={expert} (experts: expert "
                          f"dp = num_procs/(ep*etp*pp)); valid num_procs: {_nearest(valid, t.num_procs)}")
    if m.tied_embeddings and t.pp > 1 and job.resources.device == "cpu":
        # Megatron moves the last stage's copy of a shared embedding with Tensor.cuda()
        raise ConfigError("trainer.pp", t.pp, f"{src} ties its input and output embeddings "
                                              f"(tie_word_embeddings), which Megatron cannot split over "
                                              f"pipeline stages on CPU; set trainer.pp=1")
    if t.ep == 1 and t.etp != t.tp:
        # Megatron then treats expert weights as dense and reduces their grads over the dense DP group
        raise ConfigError("trainer.etp", t.etp, f"with trainer.ep=1 the experts are split like dense "
                                                f"layers, so etp must equal tp={t.tp}; set "
                                                f"trainer.etp={t.tp}, or ep > 1")
    if job.resources.device == "cpu" and t.dispatcher == "alltoall" and t.etp > 1:
        raise ConfigError("trainer.etp", t.etp, "the alltoall dispatcher with etp > 1 needs an uneven "
                                                "all_gather that gloo (device cpu) cannot do; set "
                                                "trainer.etp=1 or trainer.dispatcher=allgather")
    dp = t.num_procs // dense
    group = rows_per_prompt(job)
    n = job.data.num_prompts_per_step
    if (n * group) % dp:
        valid = [p for p in range(1, n + 2 * dp + 1) if (p * group) % dp == 0]
        rows = f"{n}*group_size={n * group} sequences" if group > 1 else f"{n} demonstrations (sft)"
        raise ConfigError("data.num_prompts_per_step", n,
                          f"a step's {rows} do not split evenly over the "
                          f"dp={dp} data-parallel trainer ranks (num_procs/(tp*pp)); valid "
                          f"num_prompts_per_step: {_nearest(valid, n)}")


def _check_micro_batch_tokens(job: JobConfig, prompt_len: int | None) -> None:
    """trainer.max_tokens_per_micro_batch holds the longest sequence a step can have (prompt + response,
    padded to a multiple of tp): a longer one would train alone in a micro-batch over the budget."""
    t, n = job.trainer, job.trainer.max_tokens_per_micro_batch
    if not n:
        return
    if t.dispatcher == "allgather" and (t.ep > 1 or t.pp > 1):
        # DP ranks' micro-batches differ in shape: EP ranks exchange tokens and PP stages shapes
        raise ConfigError("trainer.max_tokens_per_micro_batch", n,
                          "micro-batches by tokens differ in shape from one data-parallel rank to the next "
                          "and from one micro-batch to the next: Megatron's allgather dispatcher cannot gather "
                          "tokens over expert-parallel ranks (ep > 1), and refuses the shapes pipeline stages "
                          "then exchange (pp > 1, variable_seq_lengths); set trainer.dispatcher: alltoall, or 0")
    prompt = prompt_len or job.data.max_prompt_tokens
    if job.algorithm.name != "sft":
        response, responses = job.rollout.max_new_tokens, f"rollout.max_new_tokens={job.rollout.max_new_tokens}"
    else:  # the responses are the data's answers (and the answer end)
        response = demonstration_len(job)
        responses = f"{response}-token answers" if response else "answers of at least 1 token"
    longest = math.ceil(((prompt or 1) + (response or 1)) / t.tp) * t.tp
    if n < longest:
        prompts = (f"data.task={job.data.task}'s {prompt_len}-token prompts" if prompt_len else
                   f"data.max_prompt_tokens={prompt}" if prompt else "a prompt of at least 1 token")
        raise ConfigError("trainer.max_tokens_per_micro_batch", n,
                          f"{prompts} + {responses}"
                          + (f", padded to a multiple of trainer.tp={t.tp}," if t.tp > 1 else "")
                          + f" make sequences of up to {longest} tokens; use at least {longest}, or 0 for "
                          "micro-batches of trainer.micro_batch_size sequences")


def demonstration_len(job: JobConfig) -> int | None:
    """sft's longest response on a synthetic task: the answer's tokens and the answer end (as
    hpcrl/controller/session.py `demonstrations` builds them); None for a data file (unknown here)."""
    if job.data.path is not None:
        return None
    tok = job_tokenizer(job)
    end = 0 if tok.answer_end_id is None else 1
    return max(len(tok.encode_completion(answer)) + end for _, answer in task_draws(job.data.task))


def _check_recompute(job: JobConfig, m: ModelDims) -> None:
    """trainer.recompute_*: what Megatron would take for this model and layout (it raises deep inside,
    or indexes past a stage's last layer, for the rest), and no module that would recompute nothing."""
    t = job.trainer
    for key, value, default, applies in (("recompute_method", t.recompute_method, "uniform", "full"),
                                         ("recompute_num_layers", t.recompute_num_layers, 1, "full"),
                                         ("recompute_modules", t.recompute_modules, ["core_attn"], "selective")):
        if value != default and t.recompute_granularity != applies:
            raise ConfigError(f"trainer.{key}", value,
                              f"applies with trainer.recompute_granularity: {applies} only (it is "
                              f"{t.recompute_granularity}): set that, or drop {key}")
    if t.recompute_granularity == "full":
        stages = [len(r) for r in stage_ranges(m.num_hidden_layers, t.pp, t.first_stage_layers,
                                               t.last_stage_layers)]
        n = t.recompute_num_layers
        if t.recompute_method == "uniform" and any(s % n for s in stages):
            raise ConfigError("trainer.recompute_num_layers", n,
                              f"recompute_method uniform recomputes each pipeline stage's layers {stages} in "
                              "chunks of recompute_num_layers, which must divide each: use one of "
                              f"{_divisors(math.gcd(*stages))}, or recompute_method: block")
        if t.recompute_method == "block" and n > max(stages):
            raise ConfigError("trainer.recompute_num_layers", n,
                              f"recompute_method block recomputes that many layers of each pipeline stage; the "
                              f"stages have {stages} layers: use 1..{max(stages)}")
    if t.recompute_granularity != "selective":
        return
    if not t.recompute_modules:
        raise ConfigError("trainer.recompute_modules", t.recompute_modules,
                          "recompute_granularity selective recomputes these modules: name at least one of "
                          f"{', '.join(RECOMPUTE_MODULES)}, or set recompute_granularity: none")
    has = {"mla_up_proj": (m.mla, "has no multi-latent attention (MLA)"),
           "shared_experts": (m.shared_experts, "has no shared experts"),
           "mlp": (m.num_moe_layers < m.num_hidden_layers,
                   "has no dense MLP layer (every layer is MoE: use moe)"),
           "moe": (m.num_moe_layers > 0, "has no MoE layer")}
    for i, module in enumerate(t.recompute_modules):
        key = f"trainer.recompute_modules[{i}]"
        if module == "moe_act":
            raise ConfigError(key, module, "Megatron recomputes moe_act with grouped-GEMM experts only, which the "
                                           "trainer does not build; use moe (the whole MoE layer)")
        if module not in RECOMPUTE_MODULES:
            raise ConfigError(key, module, f"must be one of: {', '.join(RECOMPUTE_MODULES)}"
                                           f"{did_you_mean(module, RECOMPUTE_MODULES)}")
        if module in t.recompute_modules[:i]:
            raise ConfigError(key, module, "each module once: remove the repeat")
        if module == "shared_experts" and "moe" in t.recompute_modules:
            # and Megatron's inner checkpoint would end the outer one's recompute flag before the router
            # runs: routing replay would then replay another micro-batch's routes under PP
            raise ConfigError(key, module, "moe recomputes the whole MoE layer, its shared experts included; "
                                           "list one of them")
        present, why = has.get(module, (True, ""))
        if not present:
            raise ConfigError(key, module, f"{m.source} {why}, so it would recompute nothing; remove it")


def _check_devices(job: JobConfig, m: ModelDims) -> None:
    """dtype/backend/device consistency and GPU counts; nothing here touches the hardware."""
    r, res = job.rollout, job.resources
    if r.backend == "reference" and r.tp_per_engine != 1:
        raise ConfigError("rollout.tp_per_engine", r.tp_per_engine,
                          "the reference engine runs one process per engine: use tp_per_engine=1, "
                          "or rollout.backend=sglang on GPUs")
    if r.weight_sync == "shard" and r.backend == "reference" and res.device != "cpu":
        raise ConfigError("rollout.weight_sync", r.weight_sync,
                          f"the reference engine's shard route runs over gloo on CPU tensors; with "
                          f"resources.device={res.device!r} use broadcast or auto (SGLang engines take "
                          "the shard route on GPUs)")
    if r.backend == "sglang" and r.weight_sync == "shard" and m.model_type not in SGLANG_SHARD_MODEL_TYPES:
        why = SHARD_ROUTE_REFUSALS.get(transformers_model_type(m.model_type),
                                       f"hpcrl's loader writes {'/'.join(SGLANG_SHARD_MODEL_TYPES)} parameters only")
        raise ConfigError("rollout.weight_sync", r.weight_sync,
                          f"SGLang engines take the shard route through hpcrl's loader; {m.source} is model_type "
                          f"{m.model_type!r}: {why}. Use rollout.weight_sync: broadcast or auto")
    if r.backend == "sglang" and m.tied_embeddings and transformers_model_type(m.model_type) in SGLANG_UNTIED_HEADS:
        raise ConfigError(m.path, job_field(job, m.path),
                          f"{m.source} has tie_word_embeddings: true, and SGLang 0.5.23's "
                          f"{SGLANG_UNTIED_HEADS[transformers_model_type(m.model_type)]} always builds an lm_head "
                          "of its own (models/qwen3_moe.py, mixtral.py tie nothing): hpcrl's syncs send the "
                          "embedding once, so the engines' head would keep its initial weights; use a model with "
                          "untied embeddings, or rollout.backend: reference")
    if r.backend == "sglang":
        if res.device != "cuda":
            raise ConfigError("rollout.backend", r.backend, f"SGLang needs GPUs: set resources.device=cuda "
                                                            f"(device is {res.device!r}), or use backend "
                                                            "reference on CPU")
        t = r.tp_per_engine  # under DP attention: tp / dp_attention, in _check_engine_parallel
        if r.dp_attention == 1 and (m.num_attention_heads % t or (m.num_key_value_heads % t and
                                                                  t % m.num_key_value_heads)):
            ok = [v for v in _divisors(m.num_attention_heads)
                  if m.num_key_value_heads % v == 0 or v % m.num_key_value_heads == 0]
            raise ConfigError("rollout.tp_per_engine", t,
                              f"num_attention_heads={m.num_attention_heads} / num_key_value_heads="
                              f"{m.num_key_value_heads} of {m.source} do not split over {t} GPUs; "
                              f"valid tp_per_engine: {_nearest(ok, t)}")
    _check_engine_parallel(job)
    if res.device == "cpu" and res.gpus_per_node:
        raise ConfigError("resources.gpus_per_node", res.gpus_per_node,
                          "must be 0 with resources.device=cpu (the GPUs would sit idle); "
                          "set resources.device=cuda to use them")
    if res.device == "cuda" and res.gpus_per_node:
        gpus = res.nodes * res.gpus_per_node
        if job.trainer.num_procs > gpus:
            raise ConfigError("trainer.num_procs", job.trainer.num_procs,
                              f"each trainer rank needs a GPU, and resources.nodes*gpus_per_node={gpus}; "
                              f"use num_procs <= {gpus} or more nodes")
        rollout_gpus = res.rollout_nodes * res.gpus_per_node
        if res.rollout_nodes and r.num_engines * r.tp_per_engine > rollout_gpus:
            raise ConfigError("rollout.num_engines", r.num_engines,
                              f"num_engines*tp_per_engine={r.num_engines * r.tp_per_engine} GPUs exceed "
                              f"resources.rollout_nodes*gpus_per_node={rollout_gpus}; use num_engines <= "
                              f"{rollout_gpus // r.tp_per_engine} or more rollout_nodes")


def _check_engine_parallel(job: JobConfig) -> None:
    """rollout.ep and rollout.dp_attention (SGLang's --ep-size and --attn-dp-size, inside an engine's
    TP group): SGLang engines only, on the broadcast route (hpcrl's shard loader writes SGLang's
    default layout), and a layout that splits the model as `hpcrl plan` checks it."""
    r = job.rollout
    named = [(k, v) for k, v in (("rollout.ep", r.ep), ("rollout.dp_attention", r.dp_attention)) if v > 1]
    if not named:
        return
    key, value = named[0]
    if r.backend != "sglang":
        raise ConfigError(key, value, "expert parallelism and DP attention split an SGLang engine's TP "
                                      "group; the reference engine runs one GPU per engine: set it to 1, or "
                                      "rollout.backend: sglang")
    if weight_sync_mode(job) == "shard":
        raise ConfigError(key, value, "hpcrl's shard loader writes SGLang's default layout (no EP, no DP "
                                      "attention); use rollout.weight_sync: broadcast or auto, or set it "
                                      "to 1")
    from hpcrl.models.job_model import build_spec, rollout_layout

    rollout_layout(job, build_spec(job))


def _check_context(job: JobConfig, m: ModelDims, prompt_len: int | None) -> None:
    """The tokenizer fits the embedding; synthetic prompts + completion fit the context (file prompts
    are checked against `prompt_limit` row by row in hpcrl/config/validate_data.py)."""
    tok = job_tokenizer(job)
    if tok.vocab_size > m.vocab_size:
        what = "data.task uses" if job.data.path is None else "the data's prompts go through"
        fix = ("use the tokenizer that belongs to the model (its vocabulary must fit the embedding)"
               if job.model.path else f"use a model with vocab_size >= {tok.vocab_size}")
        raise ConfigError(m.path, job_field(job, m.path),
                          f"vocab_size={m.vocab_size} of {m.source} is smaller than the {tok.vocab_size} ids "
                          f"of {tok.name}, which {what}; {fix}")
    if prompt_len is None:
        return
    limit = m.max_position_embeddings
    room = limit - CONTEXT_RESERVE - prompt_len  # what SGLang would refuse or cut (validate_data.py)
    if room < 1:
        raise ConfigError("data.task", job.data.task,
                          f"prompts are {prompt_len} tokens, which leaves no room under "
                          f"max_position_embeddings={limit} of {m.source}")
    if job.rollout.max_new_tokens > room:
        raise ConfigError("rollout.max_new_tokens", job.rollout.max_new_tokens,
                          f"prompt ({prompt_len} tokens with <bos>, data.task={job.data.task}) + "
                          f"max_new_tokens + {CONTEXT_RESERVE} exceeds max_position_embeddings={limit} of "
                          f"{m.source} (SGLang refuses inputs of context - 6 tokens or more); "
                          f"use max_new_tokens <= {room} (the task's answers are "
                          f"{TASKS[job.data.task].answer_len} tokens)")

_PLAN_ONLY = (("trainer.cp", 1, "context parallelism"),)
"""Keys that describe full-scale layouts for `hpcrl plan`; the run path does not pass them on yet."""

PURPOSES = ("run", "plan")


def _check_plan_only(job: JobConfig) -> None:
    for path, default, what in _PLAN_ONLY:
        value = job_field(job, path)
        if value != default:
            raise ConfigError(path, value, f"{what} is modelled by `hpcrl plan` only; hpcrl run/submit do "
                                           f"not pass it to the trainer or engines yet: set {path}={default}")


def validate(job: JobConfig, purpose: str = "run") -> None:
    """Raise ConfigError for the first invalid value or inconsistent combination in `job`.

    purpose "run" (hpcrl validate/run/render/submit): single-field ranges and choices, the
    plan-only keys at their defaults, the model config (preset or config.json, parsed as the
    trainer parses it: Qwen3-MoE or Mixtral), data and reward, dtype/backend/device, Megatron
    layout divisibility and rank counts, context length, the slurm section (without a cluster;
    `hpcrl submit` checks the cluster). Reads files and imports the reward module.
    purpose "plan" (hpcrl plan): single-field ranges and choices, algorithm.name and kl_coef, the
    model config file (any JSON object; `hpcrl.plan_cmd` parses it with moe.specs and checks the
    layouts), the slurm section.
    Needs no GPU. Does not modify `job`.
    """
    from hpcrl.slurm_section import check_slurm  # needs launch, which importing hpcrl.config must not load

    if purpose not in PURPOSES:
        raise ValueError(f"validate(purpose={purpose!r}): must be one of {PURPOSES}")
    _check_fields(job)
    if purpose == "plan":
        _check_algorithm_models(job.algorithm)  # plan sizes ppo's critic and the reference model
        read_model_config(job)
        check_slurm(job)
        return
    _check_plan_only(job)
    dims = _read_model(job)
    prompt_len = check_data_and_reward(job)
    _check_devices(job, dims)
    check_routing_replay(job, dims)
    _check_parallel(job, dims)
    _check_recompute(job, dims)
    _check_micro_batch_tokens(job, prompt_len)
    _check_context(job, dims, prompt_len)
    _check_eval(job)
    _check_wandb(job)
    _check_profile_steps(job)
    _check_engine_dtype(job)
    _check_algorithm(job)
    check_slurm(job)
    check_rollout_layout(job)
