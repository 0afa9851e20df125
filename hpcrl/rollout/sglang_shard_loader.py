"""The shard route into real SGLang engines: a `--custom-weight-loader` that receives hpcrl's planned
slices straight into each TP worker's parameters (docs/sglang_shard_route.md has the evidence).

SGLang 0.5.23 calls `load(model, named_tensors)` inside every TP worker (scheduler thread) when
`/update_weights_from_tensor` names `load_format=LOADER` and the engine was launched with
`--custom-weight-loader hpcrl.rollout.sglang_shard_loader.load`. The request carries one payload per
TP rank (`serialized_named_tensors[tp_rank]`); hpcrl's payload is a single (control, empty tensor)
pair whose name is `CONTROL_PREFIX` + JSON: the shard route's plan request (hpcrl/rollout/
reshard_route.py) plus `rollout_rank` = engine index * tp + TP rank. No weight bytes go through
HTTP: the loader finds the process group that SGLang's `/init_weights_update_group` made under
`group_name` (rank_offset = trainer world + engine index * tp, so group rank = RankMap's global rank
of the rollout rank), computes the same `moe.plan` as the trainer, and runs `moe.runtime.reshard` as
that rollout rank with `out=` views of the model's own parameters, so every slice lands in place.

Parameter layout written (SGLang's bf16/fp32 unquantized Qwen3-MoE, default fused-MoE kernels):
q/k/v rows are sections [q | k | v] of `self_attn.qkv_proj`; dense or shared-expert gate/up are
[gate | up] of `gate_up_proj`; routed expert e is row `e - ep_rank * E_local` of `experts.w13_weight`
([E_local, 2 * Ie / moe_tp, H], gate then up) and `experts.w2_weight` ([E_local, H, Ie / moe_tp]);
vocab rows fill the first rows of the rank's padded shard; everything else has the HF name and the
box's shape. Layouts this does not cover (triton-kernel transposes, padded or up-first w13,
quantized weights) are refused with a ValueError before anything is received.
"""

from __future__ import annotations

import base64
import json
import pickle
import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.rollout.reshard_route import PlanRequest, spec_fingerprint
from moe.runtime import RankMap, Shards, Staging, reshard
from moe.slices import Box
from moe.specs import spec_at_dtype

LOADER = "hpcrl.rollout.sglang_shard_loader.load"
CONTROL_PREFIX = "hpcrl_reshard:"

_QKV = re.compile(r"^(.*\.self_attn)\.([qkv])_proj\.(weight|bias)$")
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_GATE_UP = re.compile(r"^(.*)\.(gate|up)_proj\.weight$")
_VOCAB = ("model.embed_tokens.weight", "lm_head.weight")


def encode_payload(control: dict[str, Any]) -> str:
    """One TP rank's `serialized_named_tensors` entry: base64 of a pickle SGLang's SafeUnpickler
    accepts ([(CONTROL_PREFIX + json, empty uint8 tensor)]; no storage, so no fd or CUDA IPC)."""
    pairs = [(CONTROL_PREFIX + json.dumps(control, sort_keys=True), torch.empty(0, dtype=torch.uint8))]
    return base64.b64encode(pickle.dumps(pairs, protocol=4)).decode()


def tensor_request_body(request_json: dict[str, Any], engine_index: int, tp: int,
                        weight_version: str | None = None) -> dict[str, Any]:
    """The `/update_weights_from_tensor` body for engine `engine_index` of `tp` GPUs.

    `request_json` is the shard route's request (ShardSync.request_json: layouts, budget, topology,
    group_name, spec_sha256, verify) plus "deadline_s". `selector` "target": a draft runner must not
    run a second receive.
    """
    payloads = [encode_payload({**request_json, "rollout_rank": engine_index * tp + r}) for r in range(tp)]
    body: dict[str, Any] = {"serialized_named_tensors": payloads, "load_format": LOADER, "flush_cache": True,
                            "selector": "target"}
    if weight_version is not None:
        body["weight_version"] = weight_version
    return body


def parse_control(named_tensors: list[tuple[str, Any]]) -> dict[str, Any]:
    """The control dict of a payload; ValueError if it is not exactly one hpcrl control pair."""
    if len(named_tensors) != 1 or not str(named_tensors[0][0]).startswith(CONTROL_PREFIX):
        names = [str(n)[:40] for n, _ in named_tensors[:3]]
        raise ValueError(f"{LOADER} expects one ({CONTROL_PREFIX}<json>, tensor) pair, got "
                         f"{len(named_tensors)} tensors {names}; send it with tensor_request_body()")
    return json.loads(named_tensors[0][0][len(CONTROL_PREFIX):])


def find_group(group_name: str) -> dist.ProcessGroup:
    """The process group SGLang's `/init_weights_update_group` made under `group_name` in this process.

    SGLang keeps it in its model runner's WeightUpdater, which the loader is not given; torch records
    every named group in `distributed_c10d._world.pg_names` (private, stable since torch 2.0)."""
    from torch.distributed.distributed_c10d import _world

    for pg, name in _world.pg_names.items():
        if name == group_name:
            return pg
    raise ValueError(f"no process group {group_name!r} in this TP worker (groups: "
                     f"{sorted(_world.pg_names.values())}); call /init_weights_update_group first")


def _check_moe_layout(model: torch.nn.Module, module_name: str) -> None:
    """Refuse fused-MoE layouts other than w13 [E_local, 2*Ie_tp, H] (gate first), w2 [E_local, H, Ie_tp]."""
    mod = model.get_submodule(module_name)
    method = getattr(mod, "weight_load_method", None) or getattr(mod, "quant_method", None)
    flags = (("use_triton_kernels (transposed w13/w2)", getattr(mod, "use_triton_kernels", False)),
             ("use_padded_loading", getattr(mod, "use_padded_loading", False)),
             ("load_up_proj_weight_first", getattr(method, "load_up_proj_weight_first", False)))
    why = [flag for flag, on in flags if on]
    if why:
        raise ValueError(f"{module_name}: SGLang's fused-MoE layout uses {', '.join(why)}; {LOADER} writes "
                         "the default layout only; use rollout.weight_sync: broadcast with this MoE backend")


def param_views(model: torch.nn.Module, boxes: list[tuple[str, Box]]) -> Shards:
    """{HF name: (box, view of the SGLang parameter the box lands in)} for one TP rank's boxes.

    ValueError names the HF tensor and the parameter when a parameter is missing or its shape is not
    the one SGLang's loaders give this rank's slices."""
    params = dict(model.named_parameters())
    rows = {n: b.shape[0] for n, b in boxes}
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    out: Shards = {}
    checked: set[str] = set()

    def param(name: str, hf: str) -> torch.Tensor:
        if name not in params:
            raise ValueError(f"{hf}: the model has no parameter {name!r} (not SGLang's Qwen3-MoE layout?)")
        return params[name].data

    for hf, box in boxes:
        if m := _QKV.match(hf):
            base, which, kind = m.groups()
            q, k = rows[f"{base}.q_proj.{kind}"], rows[f"{base}.k_proj.{kind}"]
            p = param(f"{base}.qkv_proj.{kind}", hf)
            if p.shape[0] != q + 2 * k:
                raise ValueError(f"{hf}: {base}.qkv_proj.{kind} has {p.shape[0]} rows, this rank's q/k/v "
                                 f"slices need {q} + 2 * {k}")
            view = p.narrow(0, {"q": 0, "k": q, "v": q + k}[which], box.shape[0])
        elif m := _EXPERT.match(hf):
            base, e, which = m.group(1), int(m.group(2)), m.group(3)
            if base not in checked:
                _check_moe_layout(model, base)
                checked.add(base)
            p = param(f"{base}.{'w2' if which == 'down' else 'w13'}_weight", hf)
            local = e % p.shape[0]  # EP ranks hold contiguous expert ranges (no EPLB remapping)
            start = 0 if which == "gate" else box.shape[0]
            view = p[local] if which == "down" else p[local].narrow(0, start, box.shape[0])
            if which != "down" and p.shape[1] != 2 * box.shape[0]:
                raise ValueError(f"{hf}: {base}.w13_weight rows {p.shape[1]} != 2 * {box.shape[0]} "
                                 "(gate | up)")
        elif (m := _GATE_UP.match(hf)) and ".experts." not in hf:
            p = param(f"{m.group(1)}.gate_up_proj.weight", hf)
            view = p.narrow(0, 0 if m.group(2) == "gate" else box.shape[0], box.shape[0])
        elif hf in _VOCAB:
            p = param(hf, hf)
            ends = vocab is None or box.offsets[0] + box.shape[0] == vocab
            if box.shape[0] != p.shape[0] and not ends:  # only the last shards stop short (padding rows)
                raise ValueError(f"{hf}: the plan gives this rank {box.shape[0]} vocab rows from row "
                                 f"{box.offsets[0]}, SGLang's shard has {p.shape[0]}: the two pad the vocab "
                                 "differently")
            view = p.narrow(0, 0, box.shape[0])  # the rank's padded vocab shard starts at its box
        else:
            view = param(hf, hf)
        if tuple(view.shape) != box.shape:
            raise ValueError(f"{hf}: box {box.shape} does not fit SGLang's parameter slice "
                             f"{tuple(view.shape)}")
        out[hf] = (box, view)
    return out


@dataclass
class _State:
    """Kept per model across syncs: the receive views and the staging (prepared rounds, buckets)."""

    key: tuple | None = None
    out: Shards | None = None
    staging: Staging | None = None
    spec: Any = None  # the model's spec, built once: the plan cache keys on its identity


_STATES: dict[int, _State] = {}


def model_spec(model: torch.nn.Module):
    """The moe spec of the engine's model at its parameters' dtype (as the reference engine builds it)."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise ValueError(f"{LOADER}: the model has no HF `config` to plan with")
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return spec_at_dtype(config.to_dict(), dtype)


def load(model: torch.nn.Module, named_tensors: list[tuple[str, Any]]) -> None:
    """SGLang's custom-loader entry (`custom_loader(model, named_tensors)`, weight_updater.py).

    Collective with the trainer ranks and every other rollout rank of the plan. Raises ValueError for
    a bad request (nothing received) and moe.runtime.ReshardError for a failed transfer (some
    parameters may hold new bytes: SGLang then reports the update as failed)."""
    control = parse_control(named_tensors)
    state = _STATES.setdefault(id(model), _State())
    if state.spec is None:  # a new spec each sync missed the plan cache: ~3 s of planning at 235B
        state.spec = model_spec(model)
    spec = state.spec
    if spec_fingerprint(spec) != control.get("spec_sha256"):
        raise ValueError(f"{LOADER}: spec_sha256 {control.get('spec_sha256')!r} is not this engine's model "
                         f"({spec_fingerprint(spec)}): trainer and engine would plan different models")
    plan = PlanRequest.from_json(control).build(spec)
    rank = control["rollout_rank"]
    if not isinstance(rank, int) or not 0 <= rank < plan.dst.world_size:
        raise ValueError(f"rollout_rank={rank!r} outside the rollout layout's [0, {plan.dst.world_size})")
    group = find_group(control["group_name"])
    want = RankMap(plan.src.world_size, plan.dst.world_size).global_rank("rollout", rank)
    if group.rank() != want:
        raise ValueError(f"this TP worker is rank {group.rank()} of {control['group_name']!r}, the plan "
                         f"needs {want} for rollout rank {rank}: join with rank_offset = trainer world + "
                         f"engine index * tp")
    key = (id(plan), rank, tuple((n, p.data_ptr()) for n, p in model.named_parameters()))
    if state.key != key:
        state.out, state.staging, state.key = param_views(model, plan.dst.shards(spec, rank)), Staging(), key
    reshard(plan, "rollout", rank, group=group, deadline_s=float(control["deadline_s"]),
            verify=control.get("verify", "sampled"), out=state.out, staging=state.staging)
