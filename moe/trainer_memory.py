"""Bytes a Megatron trainer rank holds for its model: parameters, gradients, optimizer, reference.

`TrainerBuild` states what the trainer allocates (the choices `hpcrl run` makes in
hpcrl/trainer/policy.py) and `trainer_memory(spec, layout, build)` turns it into per-rank bytes:

    params      the rank's shard of every tensor at the parameter dtype (`build.param_dtype`)
    grads       Megatron DDP's contiguous grad buffer: the same elements in fp32 (grad_reduce_in_fp32),
                whole on every rank, also with the distributed optimizer (it reduce-scatters into it)
    optimizer   Adam exp_avg + exp_avg_sq in fp32, plus fp32 main params when the params are not
                fp32 (Megatron's mixed-precision optimizer); with the distributed optimizer each
                rank keeps 1/dp of them: dense tensors over the dp*cp replicas of its TP shard,
                expert tensors over the expert data-parallel group (edp)
    reference   the frozen reference model (algorithm.kl_coef > 0): the same shards at the
                parameter dtype, no grads, no optimizer state
    critic      PPO's value model (hpcrl/trainer/critic.py) on the same ranks with the same layout:
                params, grads and optimizer of every tensor but lm_head, plus the [H] + [1] value
                head on the last pipeline stage's ranks

Not counted: Adam's per-tensor `step` scalars (4 bytes per tensor), the distributed optimizer's
alignment padding (at most 64 elements per tensor and lcm(dp, 128) per bucket), activations,
buffers such as DeepSeek-V3's expert score bias, and allocator overhead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from moe.layouts import TrainerLayout, bytes_per_rank
from moe.specs import MoESpec, Role

__all__ = ["TrainerBuild", "megatron_build", "memory_hint", "trainer_memory"]

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


def megatron_build(param_dtype: str, reference_model: bool = False, critic_model: bool = False) -> TrainerBuild:
    """The build hpcrl's trainer uses for `param_dtype`.

    float32: fp32 params, non-distributed Adam (what `hpcrl run` builds, CPU and GPU);
    bfloat16 / float16: half-precision params, fp32 main params, Megatron's distributed optimizer
    (the CUDA build).
    """
    return TrainerBuild(param_dtype=param_dtype, distributed_optimizer=param_dtype != "float32",
                        reference_model=reference_model, critic_model=critic_model)


def _numel_per_rank(spec: MoESpec, layout: TrainerLayout, *, sharded: bool) -> np.ndarray:
    """Elements each rank holds; with `sharded`, each divided over the group that shards its optimizer."""
    dense_dp, expert_dp = layout.dp * layout.cp, layout.expert_dp
    acc: dict[tuple[tuple[int, ...], int], float] = {}
    for t, pl in zip(spec.tensors, layout.placement(spec)):
        div = (expert_dp if t.role in _EXPERT_ROLES else dense_dp) if sharded else 1
        for box, ranks in pl:
            acc[ranks, div] = acc.get((ranks, div), 0.0) + box.numel
    out = np.zeros(layout.world_size, dtype=np.float64)
    for (ranks, div), n in acc.items():
        out[list(ranks)] += n / div
    return out


def trainer_memory(spec: MoESpec, layout: TrainerLayout, build: TrainerBuild) -> dict[str, np.ndarray]:
    """Per-rank bytes (arrays over trainer ranks) of params, grads, optimizer, reference and total.

    Also `adam_state_bytes` and `main_params_bytes`, the two parts of `optimizer_bytes`. Params
    are counted at `build.param_dtype`, whatever the spec's dtype.
    """
    placement = layout.placement(spec)
    numel = bytes_per_rank(spec, placement, layout.world_size, bytes_per_param=1)
    params = numel * PARAM_BYTES[build.param_dtype]
    opt_numel = _numel_per_rank(spec, layout, sharded=True) if build.distributed_optimizer else numel
    adam = opt_numel * 2 * FP32_BYTES
    main = opt_numel * FP32_BYTES if build.main_params else np.zeros_like(numel)
    grads = numel * FP32_BYTES
    reference = params.copy() if build.reference_model else np.zeros_like(numel)
    optimizer = adam + main
    critic = _critic_bytes(spec, layout, build, numel, opt_numel) if build.critic_model else np.zeros_like(numel)
    return {"params_bytes": params, "grads_bytes": grads, "optimizer_bytes": optimizer,
            "adam_state_bytes": adam, "main_params_bytes": main, "reference_bytes": reference,
            "critic_bytes": critic, "total_bytes": params + grads + optimizer + reference + critic}


def _critic_bytes(spec: MoESpec, layout: TrainerLayout, build: TrainerBuild, numel: np.ndarray,
                  opt_numel: np.ndarray) -> np.ndarray:
    """The critic's params, grads and optimizer per rank: the policy's elements without lm_head's, plus
    the value head (H + 1, replicated) on the ranks of the last stage (those holding the final norm)."""
    placement = layout.placement(spec)
    lm_head = np.zeros_like(numel)
    last_stage: set[int] = set()
    for t, pl in zip(spec.tensors, placement):
        for box, ranks in pl:
            if t.role == Role.LM_HEAD:
                lm_head[list(ranks)] += box.numel
            elif t.layer is None and t.role == Role.REPLICATED:  # the final norm
                last_stage.update(ranks)
    head = np.zeros_like(numel)
    head[sorted(last_stage)] = spec.dims.hidden_size + 1
    body_share = np.divide(opt_numel, numel, out=np.ones_like(numel), where=numel > 0)
    elements = numel - lm_head + head
    per_param = PARAM_BYTES[build.param_dtype] + FP32_BYTES  # the param and its fp32 grad
    return elements * per_param + elements * body_share * build.optimizer_bytes_per_param


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
