"""Subprocess side of test_shard_loader_mixed_torch.py: the shard route across torch versions.

    python _shard_loader_worker.py trainer INIT WORLD TP EP
    python _shard_loader_worker.py engine ROOT BODY_JSON INIT WORLD TP EP TP_RANK OUT

trainer (hpcrl's venv): group rank 0 of hpcrl's `init_custom_process_group`, sends the tiny
Qwen3-MoE (vocab 100) with `moe.runtime.reshard`, twice. engine (SGLang's torch): one TP worker as
SGLang runs it -- SGLang's `init_custom_process_group` from the wheel (group rank 1 + TP_RANK),
its own entry of the request body decoded by SGLang's deserializer, then hpcrl's loader into the
stand-in model (tests/sglang_stand_in.py), twice; writes {"torch", "bad": [params that differ from
SGLang's loading rules]} to OUT.
"""

from __future__ import annotations

import base64
import datetime
import json
import sys
import types
from pathlib import Path

HERE = Path(__file__).parent
sys.path[:0] = [str(HERE), str(HERE.parent), str(HERE.parent.parent)]

from sglang_stand_in import GROUP, full_tensors, hf_config, sglang_params, stand_in_model  # noqa: E402


def _request(tp: int, ep: int):
    from hpcrl.rollout.reshard_route import PlanRequest
    from moe.layouts import RolloutLayout, TrainerLayout
    from moe.network import Topology

    return PlanRequest(TrainerLayout(vocab_divisible_by=1), RolloutLayout(num_engines=1, tp=tp, ep=ep),
                       64 << 10, Topology(colocated=True))


def trainer(init: str, world: int, tp: int, ep: int) -> None:
    from hpcrl.rollout.reshard_route import spec_at_dtype
    from hpcrl.rollout.weight_sender import init_custom_process_group
    from moe.runtime import reshard

    spec = spec_at_dtype(hf_config(), "float32")
    plan = _request(tp, ep).build(spec)
    from hpcrl.dist import joined_store

    # the test process hosts the store (tests/stores.py): no port to race for
    group = init_custom_process_group("gloo", init, world, 0, GROUP, 120, store=joined_store(init, world, 120))
    full = full_tensors(spec)
    shards = {n: (box, full[n]) for n, box in plan.src.shards(spec, 0)}
    for _ in range(2):
        reshard(plan, "trainer", 0, shards, group=group, deadline_s=120, verify="full")


def engine(root: str, body_file: str, init: str, world: int, tp: int, ep: int, tp_rank: int,
           out: str) -> None:
    from _sglang_import import install

    install(Path(root))
    sys.modules["pybase64"] = base64  # not installed here; the same functions with SIMD
    try:
        import yaml  # noqa: F401  (hpcrl.config imports it; SGLang's env has it through transformers)
    except ImportError:
        sys.modules["yaml"] = types.ModuleType("yaml")
    import torch
    from sglang.srt.utils.common import (MultiprocessingSerializer, init_custom_process_group,
                                         normalize_serialized_named_tensor_payloads)

    from hpcrl.rollout.reshard_route import spec_at_dtype
    from hpcrl.rollout.sglang_shard_loader import load

    init_custom_process_group(backend="gloo", init_method=init, world_size=world, rank=1 + tp_rank,
                              group_name=GROUP, timeout=datetime.timedelta(seconds=120))
    cfg = hf_config()
    spec = spec_at_dtype(cfg, "float32")
    want = sglang_params(full_tensors(spec), spec.dims, tp_rank, tp, ep)
    model = stand_in_model(cfg, {n: t.shape for n, t in want.items()})
    body = json.loads(Path(body_file).read_text())
    for _ in range(2):
        payload = normalize_serialized_named_tensor_payloads(body["serialized_named_tensors"])[tp_rank]
        named = MultiprocessingSerializer.deserialize(payload)
        load(model, [(n, t.to("cpu")) for n, t in named])
    got = dict(model.named_parameters())
    bad = [n for n in want if not torch.equal(got[n].detach(), want[n])]
    Path(out).write_text(json.dumps({"torch": torch.__version__, "bad": bad}))


if __name__ == "__main__":
    cmd, *a = sys.argv[1:]
    if cmd == "trainer":
        trainer(a[0], int(a[1]), int(a[2]), int(a[3]))
    else:
        engine(a[0], a[1], a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6]), a[7])
