"""moe.trainer_memory: the bytes each trainer rank holds for the builds hpcrl's trainer makes.

float32: fp32 params, fp32 DDP grads, Adam m and v replicated over DP. bfloat16: bf16 params, fp32
grads, fp32 main params + m + v sharded over DP by the distributed optimizer (dense tensors over the
dp*cp replicas of their TP shard, experts over edp). A reference model adds the params once more.
DeepSeek-V3: TrainerLayout places on each rank the HF boxes its Megatron state dict holds
(moe.hf_megatron.local_params), counted by hand for the tiny preset, the expert bias as an fp32 buffer.
(That the figures equal a real MegatronPolicy's is tests/megatron/test_plan_memory.py, one rank, and
tests/megatron/test_load_memory.py, 4 ranks in several layouts.)"""

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


def deepseek_spec(q_lora: bool = True):  # -> MoESpec
    """The spec `hpcrl plan` builds for the tiny-deepseek-v3 preset (with q_lora: q_a/q_b; without it:
    DeepSeek-V2-Lite's plain q_proj). 3 layers (1 dense), 8 routed + 1 shared expert, no MTP."""
    from moe.specs import load_config, spec_at_dtype
    from moe.specs._types import HPCRL_CONFIG_DIR

    cfg = load_config(HPCRL_CONFIG_DIR / "tiny-deepseek-v3.json")
    return spec_at_dtype(cfg if q_lora else {**cfg, "q_lora_rank": None}, "float32")


DS_LAYOUTS = [TrainerLayout(), TrainerLayout(tp=2), TrainerLayout(tp=2, ep=2),
              TrainerLayout(tp=4, dp=2, ep=8), TrainerLayout(tp=2, ep=4, etp=2, dp=4),
              TrainerLayout(pp=2, dp=2, ep=2, last_stage_layers=1),
              TrainerLayout(tp=2, pp=2, ep=2, first_stage_layers=2, last_stage_layers=1),
              TrainerLayout(tp=2, pp=3, dp=2, ep=4)]


@pytest.mark.parametrize("q_lora", [True, False], ids=["q_lora", "no_q_lora"])
@pytest.mark.parametrize("layout", DS_LAYOUTS, ids=str)
def test_deepseek_placement_is_what_each_megatron_rank_holds(layout: TrainerLayout, q_lora: bool) -> None:
    """TrainerLayout gives every rank exactly the HF boxes its Megatron state dict holds
    (moe.hf_megatron.local_params, from which the trainer loads, syncs and exports): MLA's up
    projections and o_proj split by heads, the down projections and latent norms whole on every TP
    rank, dense and shared-expert MLPs TP-split, the router and its bias whole, uneven stages. The
    trainer does not pad the vocab (hpcrl.models.job_model.RUN_VOCAB_DIVISIBLE_BY)."""
    import dataclasses

    from moe.hf_megatron import HFModelDims, RankCoords, local_params

    spec = deepseek_spec(q_lora)
    dims = HFModelDims.from_hf_config(spec.config)
    layout = dataclasses.replace(layout, vocab_divisible_by=1)
    for rank in range(layout.world_size):
        c = layout.coords(rank)
        coords = RankCoords(tp_rank=c["tp"], tp=layout.tp, pp_rank=c["pp"], pp=layout.pp, ep_rank=c["ep"],
                            ep=layout.ep, etp_rank=c["etp"], etp=layout.etp,
                            first_stage_layers=layout.first_stage_layers or 0,
                            last_stage_layers=layout.last_stage_layers or 0)
        held = sorted((pc.hf_name, pc.hf_box.offsets, pc.hf_box.shape)
                      for p in local_params(dims, coords) for pc in p.pieces)
        planned = sorted((name, box.offsets, box.shape) for name, box in layout.shards(spec, rank))
        assert planned == held, (rank, sorted(set(planned) ^ set(held))[:4])


def test_deepseek_counts_mla_by_hand_and_the_expert_bias_as_an_fp32_buffer() -> None:
    """Per-rank elements of tiny-deepseek-v3 counted from its config (V = H = 64, nq 4, Rq 48, Rkv 32,
    dn 16, dr 8, dv 16, I 96, Ie 32, E 8, 1 shared expert, layers: 1 dense + 2 MoE):
      whole on every TP rank, per layer: q_a 48*64 + q_a_norm 48 + kv_a (32+8)*64 + kv_norm 32 + 2 norms
      64 = 5840; split over TP: q_b 4*24*48 + kv_b 4*32*32 + o_proj 64*64 = 12800; dense MLP 3*96*64
      = 18432 over TP; per MoE layer router 8*64 = 512 whole, experts 8*3*32*64 = 49152 over EP, shared
      3*32*64 = 6144 over TP; embedding and lm_head 2*64*64 over TP, final norm 64.
    The score-correction bias (8 per MoE layer) is a frozen fp32 buffer: 4 bytes in params, no grads,
    no optimizer state, in the fp32 and the bf16 build."""
    spec = deepseek_spec()

    def numel(tp: int, ep: int) -> int:
        return 3 * (5840 + 12800 // tp) + 18432 // tp + 2 * (512 + 49152 // ep + 6144 // tp) + 8192 // tp + 64

    assert numel(1, 1) == spec.total_params - 16
    bias = 4 * 16
    for (tp, dp, ep), n in (((1, 1, 1), numel(1, 1)), ((2, 1, 2), numel(2, 2)), ((2, 2, 4), numel(2, 4))):
        layout = TrainerLayout(tp=tp, dp=dp, ep=ep, vocab_divisible_by=1)
        fp32 = trainer_memory(spec, layout, megatron_build("float32", reference_model=True))
        assert set(fp32["params_bytes"]) == {4 * n + bias} and set(fp32["buffer_bytes"]) == {bias}
        assert set(fp32["grads_bytes"]) == {4 * n} and set(fp32["optimizer_bytes"]) == {8 * n}
        assert set(fp32["reference_bytes"]) == {4 * n + bias}
        bf16 = trainer_memory(spec, layout, megatron_build("bfloat16"))
        assert set(bf16["params_bytes"]) == {2 * n + bias} and set(bf16["grads_bytes"]) == {4 * n}
        # summed over ranks, each TP shard's elements once in the sharded main params: the whole
        # model plus (tp - 1) more copies of what every TP rank holds whole
        whole = 3 * 5840 + 2 * 512 + 64
        want = 4 * (spec.total_params - 16 + (tp - 1) * whole)
        assert bf16["main_params_bytes"].sum() == pytest.approx(want)
