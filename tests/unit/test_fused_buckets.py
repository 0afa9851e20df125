"""Tensors SGLang fuses on load (moe.fused: DeepSeek's q_a_proj + kv_a_proj_with_mqa) travel in one
bucket of one source on every broadcast path: the multi-source packing (moe.sources, used by
hpcrl/trainer/broadcast_sync.py, moe/_broadcast_sync.py and the plan) over the 671B spec in every
layer, and the single-sender WeightSender's buckets."""

from __future__ import annotations

import pytest
import torch

from hpcrl.rollout.weight_sender import _buckets
from moe.fused import fused_groups
from moe.layouts import TrainerLayout
from moe.sources import assign_sources, source_cap
from moe.specs import deepseek_v3, qwen3_moe


@pytest.fixture(scope="module")
def spec_671b():
    return deepseek_v3.SPECS["671B"]


def _where(buckets) -> dict[int, tuple[int, int]]:
    return {ti: (s, k) for s, bs in enumerate(buckets) for k, b in enumerate(bs) for ti in b.tensors}


def test_groups_are_every_layers_mla_down_projections(spec_671b):
    names = [t.name for t in spec_671b.tensors]
    groups = fused_groups(names)
    assert len(groups) == 61
    for layer, g in enumerate(groups):
        assert [names[i] for i in g] == [f"model.layers.{layer}.self_attn.q_a_proj.weight",
                                         f"model.layers.{layer}.self_attn.kv_a_proj_with_mqa.weight"]
    assert fused_groups([t.name for t in qwen3_moe.SPECS["30B-A3B"].tensors]) == []


@pytest.mark.parametrize("layout", [TrainerLayout(), TrainerLayout(tp=8, ep=8, pp=8, first_stage_layers=7,
                                                                   last_stage_layers=6)],
                         ids=["1 rank", "tp8 ep8 pp8"])
@pytest.mark.parametrize("packed", [True, False], ids=["sglang packed", "padded"])
def test_671b_fused_pairs_share_a_bucket_in_every_layer(spec_671b, layout, packed):
    placement = layout.placement(spec_671b)
    bucket_bytes = 64 << 20  # rollout.bucket_mb's default: q_b_proj (72 MiB) alone used to split them
    buckets = assign_sources(spec_671b, placement, bucket_bytes, packed=packed,
                             max_sources=source_cap(spec_671b, bucket_bytes))
    where = _where(buckets)
    assert sorted(where) == list(range(len(spec_671b.tensors)))  # every tensor exactly once
    groups = fused_groups([t.name for t in spec_671b.tensors])
    split = [spec_671b.tensors[g[0]].name for g in groups if len({where[i] for i in g}) != 1]
    assert not split, f"{len(split)} of {len(groups)} fused pairs split across buckets, e.g. {split[:3]}"
    for bs in buckets:  # packing invariants still hold
        for b in bs:
            sizes = [spec_671b.tensors[ti].nbytes for ti in b.tensors]
            if packed:
                assert b.offsets == [sum(sizes[:i]) for i in range(len(sizes))]
            assert all(o % spec_671b.tensors[ti].itemsize == 0 for ti, o in zip(b.tensors, b.offsets))
            # over the size only alone: one tensor, or one fused group
            assert b.nbytes <= bucket_bytes or len(b.tensors) == 1 or sorted(b.tensors) in groups


def test_weight_sender_buckets_keep_a_fused_pair_together():
    t = torch.zeros(1024)  # 4 KiB each
    named = [("model.layers.0.self_attn.q_a_proj.weight", t), ("model.layers.0.self_attn.q_b_proj.weight", t),
             ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", t), ("model.norm.weight", t)]
    buckets = _buckets(named, 4096)
    assert [[n.split(".")[-2] for n, _ in b] for b in buckets] == [
        ["q_a_proj", "kv_a_proj_with_mqa"], ["q_b_proj"], ["norm"]]
    assert sum(len(b) for b in buckets) == len(named)
