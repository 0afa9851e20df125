"""moe.layouts: Megatron and SGLang placements (rank math, boxes, replicas) and their validation."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from moe.layouts import RolloutLayout, TrainerLayout, bytes_per_rank, expert_split_problem
from moe.slices import Box
from moe.specs import Role, get_spec


@pytest.mark.parametrize("kw", [
    dict(tp=2, pp=2, ep=4, etp=1, dp=4, cp=1),
    dict(tp=2, pp=3, ep=2, etp=2, dp=2, cp=2),
    dict(tp=4, pp=2, ep=8, etp=1, dp=2, cp=1),
    dict(tp=1, pp=4, ep=2, etp=1, dp=2, cp=3),
    dict(tp=8, pp=16, ep=64, etp=1, dp=8, cp=1),
])
def test_rank_math_matches_megatron_rank_generator(kw: dict) -> None:
    from megatron.core.parallel_state import RankGenerator

    lay = TrainerLayout(**kw)
    order = "tp-cp-ep-dp-pp"  # Megatron's default in initialize_model_parallel
    dense = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=order)
    expert = RankGenerator(tp=lay.etp, ep=lay.ep, dp=lay.expert_dp, pp=lay.pp, cp=1, order=order)
    for gen, token, field in ((dense, "tp", "tp"), (dense, "cp", "cp"), (dense, "dp", "dp"), (dense, "pp", "pp"),
                              (expert, "tp", "etp"), (expert, "ep", "ep"), (expert, "dp", "edp")):
        for group in gen.get_ranks(token):
            coords = [lay.coords(r) for r in group]
            assert [c[field] for c in coords] == list(range(len(group))), (token, group)
            others = {tuple(v for k, v in c.items() if k != field and k in ("tp", "cp", "dp", "pp")
                            if gen is dense) for c in coords}
            assert len(others) == 1
    for r in range(lay.world_size):
        c = lay.coords(r)
        assert lay.rank(c["tp"], c["cp"], c["dp"], c["pp"]) == r
        assert lay.expert_rank(c["etp"], c["ep"], c["edp"], c["pp"]) == r


def _assert_partitions(spec, placement, world: int) -> None:
    """Every tensor's boxes are disjoint, cover it, and name valid, non-empty replica sets."""
    for t, pl in zip(spec.tensors, placement):
        full = Box.full(t.shape)
        assert sum(b.numel for b, _ in pl) == t.numel, t.name
        for i, (b, ranks) in enumerate(pl):
            assert full.contains(b) and ranks and all(0 <= r < world for r in ranks)
            for b2, _ in pl[i + 1:]:
                assert b.intersect(b2) is None, t.name


@pytest.mark.parametrize("name", ["qwen3_moe/debug", "mixtral/debug", "deepseek_v3/debug-mtp"])
def test_placements_partition_every_tensor(name: str) -> None:
    spec = get_spec(name)
    tl = TrainerLayout(tp=2, pp=2, ep=4, etp=2, dp=2, cp=2) if spec.dims.num_layers % 2 == 0 else \
        TrainerLayout(tp=2, pp=2, ep=4, etp=2, dp=2, cp=2, first_stage_layers=1)
    _assert_partitions(spec, tl.placement(spec), tl.world_size)
    rl = RolloutLayout(num_engines=2, tp=4, ep=2, dp_attention=2)
    _assert_partitions(spec, rl.placement(spec), rl.world_size)
    # every replica count is what the layout says: dense boxes on cp*dp ranks, expert boxes on edp
    for t, pl in zip(spec.tensors, tl.placement(spec)):
        want = {Role.EXPERT_COL: tl.expert_dp, Role.EXPERT_ROW: tl.expert_dp,
                Role.REPLICATED: tl.stage_size, Role.ROUTER: tl.stage_size}.get(t.role, tl.cp * tl.dp)
        assert {len(r) for _, r in pl} == {want}, t.name


def test_trainer_shards_of_one_rank() -> None:
    spec = get_spec("qwen3_moe/debug")  # 2 layers, 4 heads x 16, 2 KV heads, 4 experts, Ie 32, V 64
    lay = TrainerLayout(tp=2, pp=2, ep=2, etp=2, dp=2)  # 8 ranks, expert dp = 2*2 / (2*2) = 1
    # rank 7: dense (tp 1, dp 1, pp 1); experts (order etp-ep-edp-pp) etp 1, ep 1
    assert lay.coords(7) == {"tp": 1, "cp": 0, "dp": 1, "pp": 1, "etp": 1, "ep": 1, "edp": 0}
    shards = dict(lay.shards(spec, 7))
    assert shards["model.layers.1.self_attn.q_proj.weight"] == Box((32, 0), (32, 64))
    assert shards["model.layers.1.self_attn.k_proj.weight"] == Box((16, 0), (16, 64))
    assert shards["model.layers.1.self_attn.o_proj.weight"] == Box((0, 32), (64, 32))
    assert shards["model.layers.1.mlp.experts.2.up_proj.weight"] == Box((16, 0), (16, 64))
    assert shards["model.layers.1.mlp.experts.3.down_proj.weight"] == Box((0, 16), (64, 16))
    assert "model.layers.1.mlp.experts.1.up_proj.weight" not in shards  # expert 1 is on ep rank 0
    assert "model.layers.0.input_layernorm.weight" not in shards         # layer 0 is on stage 0
    assert shards["model.norm.weight"] == Box((0,), (64,))
    # Megatron pads the vocab to 128 * tp = 256 rows: tp rank 1 holds only padding, so no lm_head rows
    assert "lm_head.weight" not in shards
    assert dict(lay.shards(spec, 6))["lm_head.weight"] == Box((0, 0), (64, 64))


def test_uneven_pipeline_stages_and_tied_embeddings() -> None:
    spec = get_spec("deepseek_v3/671B")
    lay = TrainerLayout(tp=2, pp=16, ep=64, dp=32, first_stage_layers=3, last_stage_layers=2)
    stages = lay.stage_layers(61)
    assert [len(s) for s in stages] == [3] + [4] * 14 + [2] and stages[-1] == range(59, 61)
    qcfg = dict(get_spec("qwen3_moe/debug").config, tie_word_embeddings=True)
    from moe.specs import spec_from_config
    tied = spec_from_config(qcfg)
    assert "lm_head.weight" not in {t.name for t in tied.tensors}
    pl = TrainerLayout(pp=2, dp=1).placement(tied)
    assert pl[tied.index("model.embed_tokens.weight")][0][1] == (0, 1)  # first stage + last-stage copy


def test_rollout_sglang_groups() -> None:
    spec = get_spec("qwen3_moe/235B-A22B")  # 64 heads, 4 KV heads, 128 experts
    lay = RolloutLayout(num_engines=2, tp=8, ep=4, dp_attention=1)
    assert lay.coords(13) == {"engine": 1, "tp": 5, "attn_tp": 5, "attn_dp": 0, "moe_ep": 2, "moe_tp": 1}
    s5 = dict(lay.shards(spec, 5))
    # EP axis with stride moe_tp = 2: rank 5 is EP rank 2 (experts 64..95), MoE-TP rank 1
    assert s5["model.layers.0.mlp.experts.64.gate_proj.weight"] == Box((768, 0), (768, 4096))
    assert "model.layers.0.mlp.experts.63.gate_proj.weight" not in s5
    # 4 KV heads over attention TP 8: heads replicate on ranks pairs (4,5) -> head 2
    assert s5["model.layers.0.self_attn.k_proj.weight"] == Box((256, 0), (128, 4096))
    k = "model.layers.0.self_attn.k_proj.weight"
    assert dict(lay.shards(spec, 4))[k] == s5[k]
    assert s5["model.layers.0.self_attn.q_proj.weight"] == Box((5 * 1024, 0), (1024, 4096))
    assert s5["model.embed_tokens.weight"] == Box((5 * 18992, 0), (18992, 4096))
    # DP attention: attention TP over tp/dp_attention contiguous ranks, embedding replicated
    dpa = RolloutLayout(num_engines=1, tp=8, ep=8, dp_attention=4)
    s = dict(dpa.shards(spec, 3))
    assert s["model.layers.0.self_attn.q_proj.weight"] == Box((4096, 0), (4096, 4096))  # attn_tp rank 1 of 2
    assert s["model.embed_tokens.weight"] == Box((0, 0), (151936, 4096))
    assert s["model.layers.0.mlp.experts.48.down_proj.weight"] == Box((0, 0), (4096, 1536))


def test_rollout_bytes_per_rank() -> None:
    """(A trainer rank's bytes: moe.trainer_memory, tests/unit/test_trainer_memory.py.)"""
    spec = get_spec("qwen3_moe/debug")
    rl = RolloutLayout(num_engines=3, tp=2, ep=2)
    per = bytes_per_rank(spec, rl.placement(spec), rl.world_size)
    assert per.sum() == pytest.approx(3 * spec.total_bytes, rel=0.02)  # only norms/routers replicate in-engine


def test_layouts_are_frozen_values() -> None:
    a, b = TrainerLayout(tp=2, dp=np.int64(4)), TrainerLayout(tp=2, dp=4)
    assert a == b and hash(a) == hash(b) and type(a.dp) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.tp = 4  # type: ignore[misc]


@pytest.mark.parametrize("make, match", [
    (lambda s: TrainerLayout(ep=48, dp=48).validate(s),
     r"ep=48 does not divide num_experts=256; nearest valid ep: \[16, 32, 64\]"),
    (lambda s: TrainerLayout(tp=3).validate(s), r"tp=3 must divide num_heads=128.*nearest valid tp: \[1, 2, 4\]"),
    (lambda s: TrainerLayout(pp=16, dp=1).validate(s),
     r"61 decoder layers do not split over pp=16.*first_stage_layers"),
    (lambda s: TrainerLayout(tp=8, pp=8, ep=32, dp=4, first_stage_layers=7, last_stage_layers=6).validate(
        s, world_size=512),
     r"world size 256 != the 512 GPUs given; .* use dp=8"),
    (lambda s: TrainerLayout(tp=8, pp=8, ep=32, dp=4, first_stage_layers=7, last_stage_layers=6).validate(
        s, gpu_memory_bytes=40 * 2**30), r"needs 50.2 GiB per GPU .* > gpu memory 40.0 GiB; .*fits with"),
    (lambda s: TrainerLayout(tp=2, ep=3, dp=2), r"ep=3 with etp=1 does not divide tp\*cp\*dp=4"),
    (lambda s: TrainerLayout(tp=0), r"TrainerLayout.tp=0 must be a positive int"),
    (lambda s: RolloutLayout(tp=8, ep=3), r"RolloutLayout.ep=3 must divide tp=8"),
    (lambda s: RolloutLayout(tp=8, dp_attention=3), r"dp_attention=3 must divide tp=8"),
    (lambda s: RolloutLayout(num_engines=8, tp=16, ep=16, dp_attention=16).validate(s, gpu_memory_bytes=80 * 2**30),
     r"weights need 106.4 GiB per GPU > gpu memory 80.0 GiB; increase tp and ep"),
    (lambda s: RolloutLayout(num_engines=4, tp=32, ep=32).validate(s, world_size=100), r"tp=32 must divide it"),
    (lambda s: RolloutLayout(tp=16, ep=16, dp_attention=2).validate(get_spec("mixtral/8x7B")),
     r"RolloutLayout.ep=16 does not divide num_experts=8; nearest valid ep: \[2, 4, 8\]"),
    (lambda s: RolloutLayout(tp=64, ep=4, dp_attention=1).validate(get_spec("qwen3_moe/30B-A3B")),
     r"attention TP tp/dp_attention=64 does not divide num_heads=32; nearest valid tp/dp_attention: \[8, 16, 32\]"),
])
def test_bad_layouts_name_field_and_nearest_values(make, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make(get_spec("deepseek_v3/671B"))


def test_ep_hints_fit_both_the_ranks_and_the_experts() -> None:
    """12 dense ranks and 8 experts: an ep must divide both, so ep=8 gets 1, 2, 4 (12's own nearest
    divisors 4, 6, 12 would fail on the experts next)."""
    assert expert_split_problem(12, 8, 1, num_experts=8).endswith("nearest valid ep: [1, 2, 4]")
    assert expert_split_problem(12, 8, 1).endswith("nearest valid ep: [4, 6, 12]")  # model unknown
    assert expert_split_problem(12, 3, 1, num_experts=8) == (
        "TrainerLayout.ep=3 does not divide num_experts=8; nearest valid ep: [1, 2, 4]")
    assert expert_split_problem(12, 4, 1, num_experts=8) is None


def test_rollout_kv_heads_must_divide_or_be_divided() -> None:
    spec = get_spec("qwen3_moe/debug")  # 2 KV heads, 4 heads
    RolloutLayout(tp=4).validate(spec)  # KV heads replicate over attention TP 4
    cfg = dict(spec.config, num_key_value_heads=4, num_attention_heads=12, head_dim=16)
    from moe.specs import spec_from_config
    with pytest.raises(ValueError, match="num_kv_heads=4: one must divide the other"):
        RolloutLayout(tp=6).validate(spec_from_config(cfg))


def test_sglang_vocab_shards_where_the_padded_vocab_does_not_split_over_tp() -> None:
    """SGLang pads the vocab to 64, or to 64 * tp when that does not split evenly over tp
    (VocabParallelEmbedding): Qwen3's 151936 rows over tp 12 are 12672 per rank. Padding to 64 alone put
    rank 1's rows at 12662 (the shard route wrote every rank after 0 shifted, without a word)."""
    from moe.specs import spec_from_config

    cfg = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 48, "intermediate_size": 48,
           "moe_intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 12, "num_key_value_heads": 4,
           "head_dim": 4, "num_experts": 12, "num_experts_per_tok": 2, "rope_theta": 1e6,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16"}
    spec = spec_from_config(cfg)
    layout = RolloutLayout(num_engines=1, tp=12)
    rows = {r: dict(layout.shards(spec, r))["lm_head.weight"] for r in (0, 1, 11)}
    assert [(b.offsets[0], b.shape[0]) for b in rows.values()] == [(0, 12672), (12672, 12672), (139392, 12544)]
    # a tp that splits the padded vocab: 64 only (151936 / 4 = 37984 rows each)
    assert dict(RolloutLayout(num_engines=1, tp=4).shards(spec, 1))["lm_head.weight"].offsets[0] == 37984
