"""Bytes a Megatron trainer rank holds for its model: parameters, gradients, optimizer, reference.

`TrainerBuild` states what the trainer allocates (the choices `hpcrl run` makes in
hpcrl/trainer/policy.py) and `trainer_memory(spec, layout, build)` turns it into per-rank bytes:

    params      the rank's shard of every tensor at the parameter dtype (`build.param_dtype`), but
                DeepSeek-V3's score-correction bias (`e_score_correction_bias`, a [E] router vector):
                Megatron's router keeps it as a frozen fp32 buffer, not a parameter, so it counts
                4 bytes an element here and has no grad and no optimizer state
    grads       Megatron DDP's contiguous grad buffer: the parameters' elements in fp32
                (grad_reduce_in_fp32), whole on every rank, also with the distributed optimizer (it
                reduce-scatters into it)
    optimizer   Adam exp_avg + exp_avg_sq in fp32, plus fp32 main params when the params are not
                fp32 (Megatron's mixed-precision optimizer); with the distributed optimizer each
                rank keeps 1/dp of them: dense tensors over the dp*cp replicas of its TP shard,
                expert tensors over the expert data-parallel group (edp)
    reference   the frozen reference model (algorithm.kl_coef > 0): the same shards as params, no
                grads, no optimizer state
    critic      PPO's value model (hpcrl/trainer/critic.py) on the same ranks with the same layout:
                params (and the fp32 bias), grads and optimizer of every tensor but lm_head, plus the
                [H] + [1] value head on the last pipeline stage's ranks

What a rank holds is what `layout.placement(spec)` gives it: the plan's spec has no DeepSeek MTP
layers (the trainer does not build them), MLA's down projections (q_a_proj, kv_a_proj_with_mqa) and
the latent norms are whole on every TP rank, the up projections split by heads (checked against
moe.hf_megatron.local_params in tests/unit/test_trainer_memory.py).

Not counted: Adam's per-tensor `step` scalars (4 bytes per tensor), the distributed optimizer's
alignment padding (each parameter starts at a multiple of 64 elements and each bucket ends at a
multiple of lcm(dp, 128): under 64 elements per parameter and lcm(dp, 128) per bucket), the router's
token-count buffer beside the bias ([E] per MoE layer at the parameter dtype), MLA's YaRN cos/sin
caches (2 x original_max_position_embeddings x qk_rope_head_dim per layer, at the parameter dtype,
rebuilt for longer sequences), activations and allocator overhead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from moe.layouts import TrainerLayout
from moe.specs import MoESpec, Role, TensorSpec

__all__ = ["TrainerBuild", "is_frozen_buffer", "megatron_build", "memory_hint", "trainer_memory"]

FP32_BYTES = 4
PARAM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_EXPERT_ROLES = (Role.EXPERT_COL, Role.EXPERT_ROW)


@dataclass(frozen=True, slots=True)
class TrainerBuild:
    """What each trainer rank allocates: a Megatron GPTModel wrapped in DDP (fp32 grads) and Adam.

    `param_dtype` is the dtype of the model's parameters; any other than float32 implies fp32 main
    params in the optimizer. `distributed_optimizer` shards the optimizer state over the DP group.
    `reference_model` adds a frozen copy of the model (algorithm.kl_coef > 0).
    """

    param_dtype: str = "float32"
    distributed_optimizer: bool = False
    reference_model: bool = False
    critic_model: bool = False

    def __post_init__(self) -> None:
        if self.param_dtype not in PARAM_BYTES:
            raise ValueError(f"TrainerBuild.param_dtype={self.param_dtype!r}; valid: {sorted(PARAM_BYTES)}")

    @property
    def main_params(self) -> bool:
        """Whether the optimizer keeps fp32 main params (params not already fp32)."""
        return self.param_dtype != "float32"

    @property
    def optimizer_bytes_per_param(self) -> int:
        """fp32 exp_avg + exp_avg_sq, plus the fp32 main param when there is one."""
        return FP32_BYTES * (3 if self.main_params else 2)

    def describe(self) -> str:
        """One line: 'bfloat16 params, fp32 grads, fp32 main params + Adam m, v sharded over DP ...'."""
        opt = ("fp32 main params + Adam m, v" if self.main_params else "Adam m, v (fp32)")
        where = ("sharded over DP (distributed optimizer)" if self.distributed_optimizer
                 else "replicated over DP")
        ref = "; frozen reference model" if self.reference_model else ""
        critic = "; critic (params, grads, Adam)" if self.critic_model else ""
        return f"{self.param_dtype} params, fp32 grads (DDP buffer), {opt} {where}{ref}{critic}"


def megatron_build(param_dtype: str, reference_model: bool = False,
                   critic_model: bool = False) -> TrainerBuild:
    """The build hpcrl's trainer uses for `param_dtype`.

    float32: fp32 params, non-distributed Adam (what `hpcrl run` builds, CPU and GPU);
    bfloat16 / float16: half-precision params, fp32 main params, Megatron's distributed optimizer
    (the CUDA build).
    """
    return TrainerBuild(param_dtype=param_dtype, distributed_optimizer=param_dtype != "float32",
                        reference_model=reference_model, critic_model=critic_model)


def is_frozen_buffer(t: TensorSpec) -> bool:
    """Whether the trainer holds `t` as a frozen fp32 buffer instead of a parameter: a [E] router
    vector (Role.ROUTER, 1-D) is DeepSeek-V3's score-correction bias, Megatron's router.expert_bias
    with update rate 0 (hpcrl/trainer/model.py keeps it fp32 in bf16 models too)."""
    return t.role is Role.ROUTER and len(t.shape) == 1


@dataclass(frozen=True)
class _Elements:
    """Per-rank element counts (arrays over trainer ranks) of the rank's placed tensors."""

    params: np.ndarray      # parameters (every tensor but the frozen buffers)
    sharded: np.ndarray     # the same, each divided over the group that shards its optimizer state
    buffers: np.ndarray     # frozen fp32 buffers (`is_frozen_buffer`)
    lm_head: np.ndarray     # lm_head's elements (the critic has none)
    lm_head_sharded: np.ndarray
    last_stage: np.ndarray  # bool: the rank is on the last pipeline stage (it holds the final norm)


def _elements(spec: MoESpec, layout: TrainerLayout) -> _Elements:
    dense_dp, expert_dp = layout.dp * layout.cp, layout.expert_dp
    world = layout.world_size
    # (group key, ranks) -> elements; summed per group first: a 671B spec has ~45k tensors
    acc: dict[tuple[str, tuple[int, ...]], float] = {}
    for t, pl in zip(spec.tensors, layout.placement(spec)):
        if is_frozen_buffer(t):
            key = "buffers"
        elif t.role is Role.LM_HEAD:
            key = "lm_head"
        else:
            key = "expert" if t.role in _EXPERT_ROLES else "dense"
        for box, ranks in pl:
            acc[key, ranks] = acc.get((key, ranks), 0.0) + box.numel
        if t.layer is None and t.role is Role.REPLICATED:  # the final norm: on the last stage's ranks
            acc["last", pl[0][1]] = 1.0
    sums = {k: np.zeros(world, dtype=np.float64) for k in ("dense", "expert", "lm_head", "buffers", "last")}
    for (key, ranks), n in acc.items():
        sums[key][list(ranks)] += n
    params = sums["dense"] + sums["expert"] + sums["lm_head"]
    sharded = (sums["dense"] + sums["lm_head"]) / dense_dp + sums["expert"] / expert_dp
    return _Elements(params, sharded, sums["buffers"], sums["lm_head"], sums["lm_head"] / dense_dp,
                     sums["last"] > 0)


def trainer_memory(spec: MoESpec, layout: TrainerLayout, build: TrainerBuild) -> dict[str, np.ndarray]:
    """Per-rank bytes (arrays over trainer ranks) of params, grads, optimizer, reference, critic and total.

    Also `adam_state_bytes` and `main_params_bytes`, the two parts of `optimizer_bytes`, and
    `buffer_bytes`, the frozen fp32 buffers' part of `params_bytes`. Params are counted at
    `build.param_dtype`, whatever the spec's dtype; the frozen buffers at fp32.
    """
    el = _elements(spec, layout)
    buffers = el.buffers * FP32_BYTES
    params = el.params * PARAM_BYTES[build.param_dtype] + buffers
    opt_numel = el.sharded if build.distributed_optimizer else el.params
    adam = opt_numel * 2 * FP32_BYTES
    main = opt_numel * FP32_BYTES if build.main_params else np.zeros_like(params)
    grads = el.params * FP32_BYTES
    reference = params.copy() if build.reference_model else np.zeros_like(params)
    optimizer = adam + main
    critic = _critic_bytes(spec, layout, build, el) if build.critic_model else np.zeros_like(params)
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer,
            "adam_state_bytes": adam, "main_params_bytes": main, "reference_bytes": reference,
            "critic_bytes": critic, "buffer_bytes": buffers,
            "total_bytes": params + grads + optimizer + reference + critic}


def _critic_bytes(spec: MoESpec, layout: TrainerLayout, build: TrainerBuild, el: _Elements) -> np.ndarray:
    """The critic's params, grads and optimizer per rank: the policy's parameters without lm_head's,
    plus the value head (H + 1, replicated over TP, sharded over dp*cp like any dense tensor) on the
    ranks of the last stage; its frozen buffers as the policy's."""
    head = np.where(el.last_stage, spec.dims.hidden_size + 1, 0).astype(np.float64)
    elements = el.params - el.lm_head + head
    if build.distributed_optimizer:
        opt_numel = el.sharded - el.lm_head_sharded + head / (layout.dp * layout.cp)
    else:
        opt_numel = elements
    per_param = PARAM_BYTES[build.param_dtype] + FP32_BYTES  # the param and its fp32 grad
    return elements * per_param + el.buffers * FP32_BYTES + opt_numel * build.optimizer_bytes_per_param


def memory_hint(spec: MoESpec, layout: TrainerLayout, build: TrainerBuild, budget_bytes: float) -> str:
    """'fits with ep=32 dp=8 or pp=12': the first larger ep (with the dp Megatron then needs) and the
    first larger pp that fit `budget_bytes`, if any."""
    d = spec.dims
    num_experts = d.num_experts or 1
    tries = []
    for axis, values in (("ep", [v for v in range(layout.ep + 1, num_experts + 1) if num_experts % v == 0]),
                         ("pp", range(layout.pp + 1, 65))):
        for v in values:
            change = {axis: v}
            dense = layout.tp * layout.cp * layout.dp
            if axis == "ep" and dense % (layout.etp * v):  # more data-parallel replicas for the wider EP axis
                change["dp"] = layout.dp * layout.etp * v // math.gcd(dense, layout.etp * v)
            try:
                cand = replace(layout, **change)
                cand.dims_check(spec)
                cand.stage_layers(d.num_layers)
            except ValueError:
                continue
            if trainer_memory(spec, cand, build)["total_bytes"].max() <= budget_bytes:
                tries.append(" ".join(f"{k}={x}" for k, x in change.items()))
                break
    return "fits with " + " or ".join(tries) if tries else "no single pp/ep increase fits"
