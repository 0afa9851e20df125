"""moe.trainer_memory: the bytes each trainer rank holds for the builds hpcrl's trainer makes.

float32: fp32 params, fp32 DDP grads, Adam m and v replicated over DP. bfloat16: bf16 params, fp32
grads, fp32 main params + m + v sharded over DP by the distributed optimizer (dense tensors over the
dp*cp replicas of their TP shard, experts over edp). A reference model adds the params once more.
(That the float32 figures equal a real MegatronPolicy's is tests/megatron/test_plan_memory.py.)"""

from __future__ import annotations

import numpy as np
import pytest

from moe.layouts import TrainerLayout, bytes_per_rank
from moe.specs import Role, get_spec
from moe.trainer_memory import TrainerBuild, megatron_build, memory_hint, trainer_memory

SPEC = get_spec("qwen3_moe/debug")  # 82,816 params, 4 experts, 2 KV heads
LAYOUTS = [TrainerLayout(), TrainerLayout(dp=2, ep=2), TrainerLayout(tp=2, pp=2, dp=2, ep=4),
           TrainerLayout(pp=2, dp=4, ep=2, cp=1)]


def numel(layout: TrainerLayout) -> np.ndarray:
    return bytes_per_rank(SPEC, layout.placement(SPEC), layout.world_size, bytes_per_param=1)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_float32_build_holds_params_grads_and_replicated_adam(layout: TrainerLayout) -> None:
    build = megatron_build("float32")
    assert build == TrainerBuild() and not build.main_params and not build.distributed_optimizer
    m, n = trainer_memory(SPEC, layout, build), numel(layout)
    assert np.array_equal(m["params_bytes"], 4 * n) and np.array_equal(m["grads_bytes"], 4 * n)
    assert np.array_equal(m["optimizer_bytes"], 8 * n) and np.array_equal(m["adam_state_bytes"], 8 * n)
    assert not m["main_params_bytes"].any() and not m["reference_bytes"].any()
    assert np.array_equal(m["total_bytes"], 16 * n)
    with_ref = trainer_memory(SPEC, layout, megatron_build("float32", reference_model=True))
    assert np.array_equal(with_ref["reference_bytes"], 4 * n)
    assert np.array_equal(with_ref["total_bytes"], 20 * n)


@pytest.mark.parametrize("layout", LAYOUTS, ids=str)
def test_bfloat16_build_shards_main_params_and_adam_over_data_parallel(layout: TrainerLayout) -> None:
    build = megatron_build("bfloat16", reference_model=True)
    assert build.main_params and build.distributed_optimizer and build.optimizer_bytes_per_param == 12
    m, n = trainer_memory(SPEC, layout, build), numel(layout)
    assert np.array_equal(m["params_bytes"], 2 * n) and np.array_equal(m["grads_bytes"], 4 * n)
    assert np.array_equal(m["reference_bytes"], 2 * n)
    assert np.allclose(m["adam_state_bytes"], 2 * m["main_params_bytes"])
    # Every replica group shards its elements once: summed over ranks, the state holds each TP
    # shard's elements once -- the whole model, plus one more copy of every tensor replicated over TP
    # (norms, routers: each TP rank's copy is sharded over its own DP group, not over TP).
    tp_copies = sum(t.numel for t in SPEC.tensors if t.role in (Role.REPLICATED, Role.ROUTER))
    want = 4 * (SPEC.total_params + (layout.tp - 1) * tp_copies)
    assert m["main_params_bytes"].sum() == pytest.approx(want)
    assert np.allclose(m["optimizer_bytes"], 3 * m["main_params_bytes"])
    if layout.dp == 1 and layout.expert_dp == 1:
        assert np.allclose(m["main_params_bytes"], 4 * n)  # nothing to shard over


def test_memory_hint_names_a_larger_ep_or_pp_that_fits() -> None:
    layout, build = TrainerLayout(dp=4), megatron_build("float32")
    need = trainer_memory(SPEC, layout, build)["total_bytes"].max()
    assert memory_hint(SPEC, layout, build, need * 0.7).startswith("fits with ep=")
    assert memory_hint(SPEC, layout, build, 1.0) == "no single pp/ep increase fits"
    with pytest.raises(ValueError, match="TrainerBuild.param_dtype='int8'"):
        TrainerBuild(param_dtype="int8")
