"""The SGLang custom weight loader of the shard route (hpcrl/rollout/sglang_shard_loader.py) on CPU.

A trainer process sends with hpcrl's runtime (`moe.runtime.reshard`, gloo) and each 'TP worker'
process receives through `load(model, named_tensors)` -- the call SGLang's weight updater makes --
into a stand-in model: an nn.Module with SGLang's Qwen3-MoE parameter names and TP/EP-sharded
shapes (qkv_proj, experts.w13_weight / w2_weight, padded vocab shards). The expected parameters are
computed here from the full tensors by SGLang's own loading rules (QKVParallelLinear kv-head
replicas, FusedMoE gate|up halves and moe_tp narrowing, vocab padded to 64), independently of
moe.layouts; they must match bit for bit, and padding rows must stay untouched. What this cannot
check without SGLang on a GPU is listed in docs/sglang_shard_route.md.
"""

from __future__ import annotations

import base64
import pickle

import pytest
import torch
import torch.multiprocessing as mp

from hpcrl.rollout.reshard_route import PlanRequest, spec_at_dtype, spec_fingerprint
from hpcrl.rollout.sglang_shard_loader import (_STATES, LOADER, load, param_views, parse_control,
                                               tensor_request_body)
from moe.layouts import RolloutLayout, TrainerLayout
from moe.network import Topology
from sglang_stand_in import GROUP, full_tensors, hf_config, sglang_params, stand_in_model
from stores import hosted_store, joined_store


def _request(tp: int, ep: int, colocated: bool = True) -> PlanRequest:
    """colocated=False: engines on their own node, so TP ranks relay replicated boxes to each other."""
    return PlanRequest(TrainerLayout(vocab_divisible_by=1), RolloutLayout(num_engines=1, tp=tp, ep=ep),
                       64 << 10, Topology(colocated=colocated))


def _process(rank: int, port: int, tp: int, ep: int, colocated: bool, out_dir: str) -> None:
    from hpcrl.rollout.weight_sender import init_custom_process_group
    from moe.runtime import reshard

    cfg = hf_config()
    spec = spec_at_dtype(cfg, "float32")
    request = _request(tp, ep, colocated)
    plan = request.build(spec)
    group = init_custom_process_group("gloo", "", 1 + tp, rank, GROUP, 60, store=joined_store(port, 1 + tp))
    full = full_tensors(spec)
    if rank == 0:  # the trainer: one rank holding every tensor whole
        shards = {n: (box, full[n]) for n, box in plan.src.shards(spec, 0)}
        for _ in range(2):  # the second sync reuses the prepared rounds on both sides
            reshard(plan, "trainer", 0, shards, group=group, deadline_s=60, verify="full")
        return
    r = rank - 1
    want = sglang_params(full, spec.dims, r, tp, ep)
    model = stand_in_model(cfg, {n: t.shape for n, t in want.items()})
    control = {**request.to_json(), "group_name": GROUP, "spec_sha256": spec_fingerprint(spec),
               "verify": "full", "deadline_s": 60}
    body = tensor_request_body(control, engine_index=0, tp=tp)
    stagings = []
    for _ in range(2):
        # what SGLang's TP worker does: its own entry, deserialized, each tensor moved to the device
        named = pickle.loads(base64.b64decode(body["serialized_named_tensors"][r]))
        load(model, [(n, t.to("cpu")) for n, t in named])
        stagings.append(_STATES[id(model)].staging)
    # the second sync reuses the plan, views and prepared rounds (a spec built per sync missed the
    # plan cache: ~3 s of planning per TP worker and sync at 235B)
    assert stagings[0] is stagings[1]
    torch.save({n: p.detach().clone() for n, p in model.named_parameters()}, f"{out_dir}/rank{r}.pt")
    torch.save(want, f"{out_dir}/want{r}.pt")


@pytest.mark.parametrize("tp,ep,colocated", [(2, 1, True), (2, 2, True), (4, 2, True), (4, 2, False)])
def test_tp_workers_receive_their_own_slices_bit_exact(tmp_path, tp, ep, colocated):
    if not colocated:  # the plan has TP workers relay to each other (sent from their parameters)
        assert _request(tp, ep, colocated).build(spec_at_dtype(hf_config(), "float32")).from_rollout.any()
    store, ctx = hosted_store(1 + tp), mp.get_context("spawn")
    procs = [ctx.Process(target=_process, args=(i, store.port, tp, ep, colocated, str(tmp_path)))
             for i in range(1 + tp)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0] * len(procs)
    for r in range(tp):
        got, want = torch.load(tmp_path / f"rank{r}.pt"), torch.load(tmp_path / f"want{r}.pt")
        assert got.keys() == want.keys()
        bad = [n for n in want if not torch.equal(got[n], want[n])]
        assert not bad, f"TP rank {r}: {bad}"


def test_request_body_has_one_payload_per_tp_rank_and_names_the_loader():
    body = tensor_request_body({"group_name": GROUP}, engine_index=3, tp=4, weight_version="7")
    assert body["load_format"] == LOADER and body["selector"] == "target" and body["weight_version"] == "7"
    ranks = [parse_control(pickle.loads(base64.b64decode(p)))["rollout_rank"]
             for p in body["serialized_named_tensors"]]
    assert ranks == [12, 13, 14, 15]


def test_other_payloads_are_refused():
    with pytest.raises(ValueError, match="expects one"):
        parse_control([("model.norm.weight", torch.zeros(2))])


def test_unsupported_moe_layout_and_wrong_shapes_are_refused_before_receiving():
    cfg = hf_config()
    spec = spec_at_dtype(cfg, "float32")
    plan = _request(2, 1).build(spec)
    want = sglang_params(full_tensors(spec), spec.dims, 0, 2, 1)
    model = stand_in_model(cfg, {n: t.shape for n, t in want.items()})
    boxes = plan.dst.shards(spec, 0)
    assert len(param_views(model, boxes)) == len(boxes)
    model.model.layers.get_submodule("0.mlp.experts").use_triton_kernels = True
    with pytest.raises(ValueError, match="use_triton_kernels"):
        param_views(model, boxes)
    model = stand_in_model(cfg, {**{n: t.shape for n, t in want.items()},
                                 "model.layers.1.self_attn.qkv_proj.weight": torch.Size([48, 64])})
    with pytest.raises(ValueError, match="qkv_proj.weight has 48 rows"):
        param_views(model, boxes)
