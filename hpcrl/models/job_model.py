"""A job's model as `hpcrl run` builds it: the `moe.specs` spec, the trainer and rollout layouts
and the trainer's build (parameter dtype, optimizer, reference model).

Used by `hpcrl plan` (hpcrl/plan_cmd.py), the trainer's weight syncs (hpcrl/trainer/shard_sync.py,
broadcast_sync.py) and the reference engine (through `spec_at_dtype`), so all of them describe
the same tensors and the same placement. The model config is `model.path`/config.json when
`model.path` is set, else `model.config_path` or the `model.preset` config. Problems become
`ConfigError`s naming the job key to change and, for layouts, the nearest valid values.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from hpcrl.config import ConfigError, JobConfig
from hpcrl.config.schema import critic_enabled, engine_dtype
from hpcrl.config.validate import read_model_config
from moe.layouts import RolloutLayout, TrainerLayout, expert_split_problem
from moe.specs import MoESpec, spec_at_dtype
from moe.trainer_memory import TrainerBuild, megatron_build

__all__ = ["RUN_PARAM_DTYPES", "build_layouts", "build_spec", "layout_summary", "model_config",
           "rollout_layout", "spec_at_dtype", "trainer_build"]

# Layout field -> the job key that sets it (trainer dp is derived from trainer.num_procs).
TRAINER_KEYS = {"tp": "trainer.tp", "pp": "trainer.pp", "ep": "trainer.ep", "etp": "trainer.etp",
                "cp": "trainer.cp", "dp": "trainer.num_procs",
                "first_stage_layers": "trainer.first_stage_layers",
                "last_stage_layers": "trainer.last_stage_layers"}
ROLLOUT_KEYS = {"num_engines": "rollout.num_engines", "tp": "rollout.tp_per_engine", "ep": "rollout.ep",
                "dp_attention": "rollout.dp_attention"}
RUN_PARAM_DTYPES = ("float32", "bfloat16")
"""Parameter dtypes hpcrl/trainer/policy.py builds: fp32 params with non-distributed Adam; bf16
params with fp32 main params and Adam in Megatron's distributed optimizer (`moe.trainer_memory`)."""
RUN_VOCAB_DIVISIBLE_BY = 1
"""hpcrl's Megatron model does not pad the vocab (hpcrl/trainer/model.py), so neither do its layouts."""


def model_config(job: JobConfig) -> tuple[str, Any, str, dict[str, Any]]:
    """(job key, its value, how messages name the model, the config.json dict) of the job's model:
    `hpcrl.config.validate.read_model_config` (model.path's config.json, else model.config_path or
    model.preset; a missing directory or file is a ConfigError on that key)."""
    return read_model_config(job)


def build_spec(job: JobConfig) -> MoESpec:
    """The `moe.specs` spec of the job's model, at the job's `model.dtype` (ConfigError if unsupported)."""
    key, value, source, cfg = model_config(job)
    if key == "model.preset":
        flavor = str(value)
    elif key == "model.path":
        flavor = os.path.basename(os.path.normpath(str(value)))
    else:
        flavor = os.path.basename(str(value)).removesuffix(".json")
    try:
        return spec_at_dtype(cfg, engine_dtype(job), flavor)  # syncs move the engines' dtype
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(key, value, f"{source}: {str(exc).removeprefix('config.json ')}") from None


def trainer_build(job: JobConfig) -> TrainerBuild:
    """What every trainer rank allocates for this job (`moe.trainer_memory.megatron_build`):
    `model.dtype` params, fp32 DDP grads, Adam; a frozen reference model when algorithm.kl_coef > 0;
    PPO's critic (params, grads, Adam) when the job builds one."""
    return megatron_build(job.model.dtype, reference_model=job.algorithm.kl_coef > 0, critic_model=critic_enabled(job))


def _layout_error(exc: ValueError, side: str, job: JobConfig) -> ConfigError:
    """A layout ValueError from moe.layouts as a ConfigError on the job key that sets the bad field."""
    msg = str(exc)
    keys = TRAINER_KEYS if side == "trainer" else ROLLOUT_KEYS
    cls = "TrainerLayout" if side == "trainer" else "RolloutLayout"
    m = re.match(rf"{cls}\.(\w+)=", msg)
    if m and m.group(1) in keys:
        path = keys[m.group(1)]
    elif side == "trainer" and "decoder layers do not split" in msg:
        path = "trainer.pp"
    elif side == "rollout" and "tp/ep" in msg:
        path = "rollout.ep"
    elif side == "rollout" and ("attention TP" in msg or "tp/dp_attention" in msg):
        # attention TP = tp_per_engine / dp_attention: the key the job set away from 1
        path = "rollout.dp_attention" if job.rollout.dp_attention > 1 else "rollout.tp_per_engine"
    else:
        path = side
    hint = re.sub(rf"^{cls}[.:]? ?", "", msg)
    if side == "trainer":
        hint = hint.replace("_stage_layers=None", "_stage_layers=0")
    else:  # the engine's TP size is rollout.tp_per_engine in the job file
        hint = re.sub(r"\btp=", "tp_per_engine=", hint)
    if "." in path:
        return ConfigError(path, getattr(getattr(job, side), path.split(".", 1)[1]), hint)
    return ConfigError(path, layout_summary(job, side), hint)


def layout_summary(job: JobConfig, side: str) -> str:
    """'tp=1 pp=16 ...': the job keys of one side's layout, for messages about the whole layout."""
    keys = TRAINER_KEYS if side == "trainer" else ROLLOUT_KEYS
    section = getattr(job, side)
    return " ".join(f"{leaf}={getattr(section, leaf)}" for leaf in dict.fromkeys(k.split(".")[1]
                                                                                  for k in keys.values()))


def build_layouts(job: JobConfig, spec: MoESpec) -> tuple[TrainerLayout, RolloutLayout]:
    """The trainer and rollout layouts of `job`, checked against `spec` (not yet against memory).

    The trainer layout is Megatron's as hpcrl builds it: vocab not padded (`RUN_VOCAB_DIVISIBLE_BY`).
    """
    t = job.trainer
    first, last = t.first_stage_layers or None, t.last_stage_layers or None
    try:  # the model-parallel sizes against the model first: they, not num_procs, are then at fault
        probe = TrainerLayout(tp=t.tp, pp=t.pp, etp=t.etp, dp=t.etp, cp=t.cp, first_stage_layers=first,
                              last_stage_layers=last)
        probe.dims_check(spec)
        probe.stage_layers(spec.dims.num_layers)
    except ValueError as exc:
        raise _layout_error(exc, "trainer", job) from None
    model_parallel = t.tp * t.cp * t.pp
    if t.num_procs % model_parallel:
        k = max(1, t.num_procs // model_parallel)
        valid = ", ".join(str(model_parallel * i) for i in (k, k + 1))
        raise ConfigError("trainer.num_procs", t.num_procs,
                          f"must be a multiple of tp*cp*pp={model_parallel} (dp = num_procs/(tp*cp*pp)); "
                          f"nearest valid: {valid}")
    problem = expert_split_problem(t.tp * t.cp * (t.num_procs // model_parallel), t.ep, t.etp,
                                   spec.dims.num_experts)
    if problem:  # the ep values it suggests fit both the ranks and the model's experts
        raise _layout_error(ValueError(problem), "trainer", job)
    try:
        trainer = TrainerLayout(tp=t.tp, pp=t.pp, ep=t.ep, etp=t.etp, dp=t.num_procs // model_parallel,
                                cp=t.cp, first_stage_layers=first, last_stage_layers=last,
                                vocab_divisible_by=RUN_VOCAB_DIVISIBLE_BY)
        trainer.validate(spec)
    except ValueError as exc:
        raise _layout_error(exc, "trainer", job) from None
    return trainer, rollout_layout(job, spec)


def rollout_layout(job: JobConfig, spec: MoESpec) -> RolloutLayout:
    """The engines' layout of `job` (SGLang's: engines x TP, with EP and DP attention inside),
    checked against `spec`; ConfigError naming the rollout key and the nearest valid values."""
    r = job.rollout
    try:
        rollout = RolloutLayout(num_engines=r.num_engines, tp=r.tp_per_engine, ep=r.ep,
                                dp_attention=r.dp_attention)
        rollout.validate(spec)
    except ValueError as exc:
        raise _layout_error(exc, "rollout", job) from None
    return rollout
