"""moe.plan + moe.network: exact coverage, no duplicates, budgets, balance, determinism, scale, timing model."""

from __future__ import annotations

import random
from math import gcd

import numpy as np
import pytest

from moe.layouts import RolloutLayout, TrainerLayout
from moe.network import Topology, broadcast_baseline_seconds, estimate_seconds, lower_bound, round_seconds
from moe.plan import Plan, plan
from moe.slices import Box
from moe.specs import get_spec

FLAVORS = ["qwen3_moe/debug", "mixtral/debug", "deepseek_v3/debug", "deepseek_v3/debug-mtp"]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_trainer(rng: random.Random, spec, max_world: int = 48) -> TrainerLayout:
    d = spec.dims
    while True:
        tp = rng.choice(_divisors(gcd(d.num_heads, d.num_kv_heads)))
        ep = rng.choice(_divisors(d.num_experts))
        etp = rng.choice([x for x in _divisors(d.moe_intermediate_size) if x <= 4])
        cp, pp = rng.choice([1, 1, 2]), rng.choice([1, 1, 2, 3])
        first = last = None
        if pp > 1 and d.num_layers % pp:
            first = rng.choice([0, 1]) if pp > 2 else d.num_layers // 2
            last = None if pp > 2 else d.num_layers - first
        need = etp * ep
        dp = need // gcd(tp * cp, need) * rng.choice([1, 1, 2])
        try:
            lay = TrainerLayout(tp=tp, pp=pp, ep=ep, etp=etp, dp=dp, cp=cp, first_stage_layers=first,
                                last_stage_layers=last)
            lay.validate(spec)
        except ValueError:
            continue
        if lay.world_size <= max_world:
            return lay


def random_rollout(rng: random.Random, spec, max_world: int = 48) -> RolloutLayout:
    while True:
        tp = rng.choice([1, 2, 4, 8])
        try:
            lay = RolloutLayout(num_engines=rng.choice([1, 2, 3]), tp=tp, ep=rng.choice(_divisors(tp)),
                                dp_attention=rng.choice(_divisors(tp)))
            lay.validate(spec)
        except ValueError:
            continue
        if lay.world_size <= max_world:
            return lay


def _slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(box.offsets, box.shape))


def verify_exact(p: Plan) -> None:
    """Element-exact check: every destination element arrives exactly once, from a rank that has it."""
    spec = p.spec
    src_pl, dst_pl = p.src.placement(spec), p.dst.placement(spec)
    occupancy: dict[tuple[int, int], np.ndarray] = {}
    for ti, t in enumerate(spec.tensors):
        for box, ranks in dst_pl[ti]:
            for r in ranks:
                occ = occupancy.setdefault((r, ti), np.full(t.shape, -1, dtype=np.int8))
                occ[_slices(box)] = 0
    src_boxes = [{r: b for b, ranks in pl for r in ranks} for pl in src_pl]  # one box per rank and tensor
    arrived: dict[tuple[int, int, int], int] = {}
    names = {t.name: i for i, t in enumerate(spec.tensors)}
    for tr in p.transfers():
        ti = names[tr.tensor]
        occ = occupancy.get((tr.dst_rank, ti))
        assert occ is not None, f"{tr} goes to a rank that does not hold {tr.tensor}"
        sl = _slices(tr.box)
        assert (occ[sl] == 0).all(), f"{tr} delivers an element twice or one the rank does not hold"
        occ[sl] = 1
        assert tr.nbytes == tr.box.numel * spec.tensors[ti].itemsize
        arrived[(tr.dst_rank, ti, id(tr.box))] = tr.round
        if tr.src_side == "trainer":
            held = src_boxes[ti].get(tr.src_rank)
            assert held is not None and held.contains(tr.box), f"{tr}: the sender does not hold the box"
        else:
            got = arrived.get((tr.src_rank, ti, id(tr.box)))
            assert got is not None and got < tr.round, f"relay {tr} before its source received the box"
    for key, occ in occupancy.items():
        assert (occ == 1).sum() == (occ >= 0).sum(), f"rank/tensor {key} misses elements"
    assert not len(p) or p.staging_bytes().max() <= p.memory_budget_bytes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("flavor", FLAVORS)
def test_random_layout_pairs_exact_coverage_and_budgets(flavor: str) -> None:
    rng = random.Random(f"plan-{flavor}")
    spec = get_spec(flavor)
    for _ in range(50):
        src, dst = random_trainer(rng, spec), random_rollout(rng, spec)
        topo = Topology(gpus_per_node=rng.choice([1, 2, 4, 8]), nics_per_node=rng.choice([1, 4, 8]),
                        colocated=rng.random() < 0.3)
        p = plan(src, dst, spec, rng.choice([1 << 16, 1 << 18, 1 << 22]), topo)
        verify_exact(p)


def test_tiny_budget_cuts_rows_along_the_next_dim() -> None:
    spec = get_spec("qwen3_moe/debug")  # float32, rows of 64 elements = 256 bytes
    p = plan(TrainerLayout(tp=2), RolloutLayout(num_engines=2), spec, 2048)
    assert max(b.numel for b in p.box_table) * 4 <= 2048 // 16
    assert any(b.shape[0] == 1 and b.shape[1] < 64 for b in p.box_table if len(b.shape) == 2)
    verify_exact(p)


def test_plans_are_deterministic() -> None:
    spec = get_spec("deepseek_v3/debug")
    args = (TrainerLayout(tp=2, pp=3, ep=4, etp=1, dp=2), RolloutLayout(num_engines=3, tp=4, ep=2, dp_attention=2),
            spec, 65536, Topology(gpus_per_node=4))
    a, b = plan(*args), plan(*args)
    for col in ("src_rank", "from_rollout", "dst_rank", "tensor", "box_index", "nbytes", "round", "intra_node"):
        assert np.array_equal(getattr(a, col), getattr(b, col)), col
    assert a.box_table == b.box_table and list(a.transfers()) == list(b.transfers())


def test_thousand_rank_layouts_exact() -> None:
    """1,152 trainer ranks -> 512 rollout ranks of the DeepSeek-V3 debug model, checked element by element."""
    spec = get_spec("deepseek_v3/debug")
    src = TrainerLayout(tp=2, pp=3, ep=8, etp=1, dp=192)
    dst = RolloutLayout(num_engines=64, tp=8, ep=8, dp_attention=8)
    p = plan(src, dst, spec, 1 << 20)
    assert src.world_size == 1152 and dst.world_size == 512
    verify_exact(p)
    sent = p.sent_bytes()
    assert (sent > 0).mean() > 0.9  # the replicas share the work: nearly every trainer rank sends


@pytest.mark.timeout(240)
def test_thousand_rank_full_size_model_accounting() -> None:
    """Qwen3-30B-A3B 1,024 -> 64 ranks: bytes per destination == bytes it holds, boxes contained, no repeats."""
    spec = get_spec("qwen3_moe/30B-A3B")
    src = TrainerLayout(tp=4, pp=4, ep=32, etp=1, dp=64)
    dst = RolloutLayout(num_engines=8, tp=8, ep=8, dp_attention=2)
    p = plan(src, dst, spec, 1 << 28)
    assert src.world_size == 1024
    from moe.layouts import bytes_per_rank

    held = bytes_per_rank(spec, dst.placement(spec), dst.world_size)
    assert np.array_equal(p.received_bytes(), held)
    keys = np.stack([p.dst_rank.astype(np.int64), p.tensor.astype(np.int64), p.box_index.astype(np.int64)])
    assert np.unique(keys, axis=1).shape[1] == len(p)  # no (destination, tensor, box) twice
    assert p.staging_bytes().max() <= p.memory_budget_bytes
    # every box lies inside a box its destination holds (sampled: one per distinct (tensor, box))
    dst_pl = dst.placement(spec)
    _, first = np.unique(keys[1:], axis=1, return_index=True)
    for i in first.tolist():
        ti, r, box = int(p.tensor[i]), int(p.dst_rank[i]), p.box(i)
        assert any(r in ranks and b.contains(box) for b, ranks in dst_pl[ti])


def test_senders_balanced_across_replicas() -> None:
    spec = get_spec("qwen3_moe/30B-A3B")
    # 8 trainer ranks, experts forced (edp = 1), every dense tensor has 8 replicas
    p = plan(TrainerLayout(ep=8, dp=8), RolloutLayout(num_engines=4, tp=8, ep=8), spec, 1 << 30)
    sent = p.sent_bytes()
    assert sent.max() / sent.min() < 1.02, sent


def test_one_nic_crossing_per_node_then_nvlink_relays() -> None:
    spec = get_spec("deepseek_v3/debug")
    src, dst, topo = TrainerLayout(ep=8, dp=8), RolloutLayout(num_engines=2, tp=8, ep=8, dp_attention=8), Topology()
    p = plan(src, dst, spec, 1 << 20, topo)
    lb = lower_bound(spec, src.placement(spec), dst.placement(spec), src.world_size, dst.world_size, topo)
    nic = ~p.intra_node
    assert p.nbytes[nic].sum() == lb["cross_node_bytes"]  # every distinct box crosses a node's NICs once
    assert p.from_rollout.any() and (p.intra_node == p.from_rollout).all()
    assert p.nbytes[p.from_rollout].sum() > 0


def test_colocated_copies_stay_on_the_node() -> None:
    spec = get_spec("deepseek_v3/debug")
    # 2 nodes of 8: each trainer node holds a full replica (tp 8 x ep 8 per node), rollout engines likewise
    src, dst = TrainerLayout(tp=4, ep=8, etp=1, dp=4), RolloutLayout(num_engines=2, tp=8, ep=8, dp_attention=2)
    p = plan(src, dst, spec, 1 << 20, Topology(colocated=True))
    assert p.intra_node.all() and not p.from_rollout.any()
    verify_exact(p)
    q = plan(src, dst, spec, 1 << 20, Topology(colocated=False))
    assert not q.intra_node[~q.from_rollout].any()


def test_estimate_near_line_rate_and_far_below_broadcast() -> None:
    spec = get_spec("qwen3_moe/30B-A3B")
    src = TrainerLayout(tp=4, pp=4, ep=16, dp=4, first_stage_layers=11, last_stage_layers=11)
    dst = RolloutLayout(num_engines=4, tp=8, ep=8)
    topo = Topology()
    p = plan(src, dst, spec, 1 << 30, topo)
    est = estimate_seconds(p)
    lb = lower_bound(spec, src.placement(spec), dst.placement(spec), src.world_size, dst.world_size, topo)
    assert lb["lower_bound_s"] <= est <= 1.15 * lb["lower_bound_s"], (est, lb)
    assert broadcast_baseline_seconds(spec, src, topo)["baseline_broadcast_s"] > 5 * est


def test_relay_heavy_rollouts_overlap_nvlink_with_nics() -> None:
    """Single-GPU engines: 7/8 of every node's bytes are NVLink relays; NIC pacing keeps the plan near the bound."""
    spec = get_spec("qwen3_moe/30B-A3B")
    src, dst, topo = TrainerLayout(tp=4, ep=8, dp=2), RolloutLayout(num_engines=16, tp=1), Topology()
    p = plan(src, dst, spec, 1 << 30, topo)
    lb = lower_bound(spec, src.placement(spec), dst.placement(spec), src.world_size, dst.world_size, topo)
    assert p.nbytes[p.from_rollout].sum() > 6 * p.nbytes[~p.intra_node].sum()
    assert estimate_seconds(p) <= 1.25 * lb["lower_bound_s"]


def test_time_model_by_hand() -> None:
    topo = Topology(gpus_per_node=8, nics_per_node=8, nic_gbit_per_s=400.0, nvlink_gbyte_per_s=450.0)
    assert topo.gpu_nic_bytes_per_s == 50e9 and topo.node_nic_bytes_per_s == 400e9
    spec = get_spec("mixtral/debug")
    p = plan(TrainerLayout(), RolloutLayout(), spec, 1 << 20, topo)  # 1 GPU -> 1 GPU on another node
    assert p.num_rounds == 1 and not p.intra_node.any()
    assert estimate_seconds(p) == pytest.approx(spec.total_bytes / 50e9)
    assert round_seconds(p).shape == (1,)
    lb = lower_bound(spec, TrainerLayout().placement(spec), RolloutLayout().placement(spec), 1, 1, topo)
    # one GPU on each node: only its own NIC share counts (rail-optimised NICs), so the bound equals the plan
    assert lb["lower_bound_s"] == pytest.approx(spec.total_bytes / 50e9)
    full = lower_bound(spec, TrainerLayout(dp=8).placement(spec), RolloutLayout(num_engines=8).placement(spec),
                       8, 8, topo)
    # a full node of 8 single-GPU engines: one copy crosses the node's 8 NICs (400 GB/s), NVLink does the rest
    assert full["dst_node_in_s"] == pytest.approx(spec.total_bytes / 400e9)
    base = broadcast_baseline_seconds(spec, TrainerLayout(), topo)
    assert base["gather_s"] == 0 and base["baseline_broadcast_s"] == pytest.approx(spec.total_bytes / 50e9)


def test_bad_inputs() -> None:
    spec = get_spec("qwen3_moe/debug")
    with pytest.raises(ValueError, match="memory_budget_bytes=16 must be an int >= 64"):
        plan(TrainerLayout(), RolloutLayout(), spec, 16)
    with pytest.raises(ValueError, match="ep=3 does not divide num_experts=4"):
        plan(TrainerLayout(ep=3, dp=3), RolloutLayout(), spec, 1 << 20)
    with pytest.raises(ValueError, match="Topology.gpus_per_node=0"):
        Topology(gpus_per_node=0)


def test_plan_report_keys_and_text() -> None:
    import json

    from moe.report import plan_report, render_text

    spec = get_spec("deepseek_v3/debug")
    r = plan_report(spec, TrainerLayout(tp=2, pp=3, ep=4, dp=2), RolloutLayout(num_engines=2, tp=4, ep=4, dp_attention=2),
                    gpu_memory_bytes=1 << 20)
    for key in ("total_params", "lower_bound_s", "estimate_s", "baseline_broadcast_s", "max_recv_bytes_per_gpu",
                "must_hold_bytes_per_gpu"):
        assert key in r, key
    assert r["total_params"] == spec.total_params and r["estimate_s"] >= r["lower_bound_s"] > 0
    assert r["max_recv_bytes_per_gpu"] == r["must_hold_bytes_per_gpu"]  # every held byte arrives exactly once
    assert r["trainer"]["fits"] is True and r["rollout"]["fits"] is True
    json.dumps(r)
    text = render_text(r)
    assert "deepseek_v3/debug" in text and "line-rate lower bound" in text and "broadcast baseline" in text
