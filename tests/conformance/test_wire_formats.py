"""hpcrl's wire formats checked against SGLang 0.5.23's own code: the /generate body hpcrl sends
(SGLang's request schema, which rejects unknown sampling keys), the flattened buckets of both weight
paths (FlattenedTensorBucket's receive side), and the weight-update group handshake with an engine of
TP 2 (SGLang's init_custom_process_group in two engine processes, hpcrl's as rank 0, over gloo)."""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from hpcrl.config import JobConfig
from hpcrl.controller.groups import RolloutGroup
from hpcrl.controller.routes import RouteFormat
from hpcrl.controller.session import Session
from hpcrl.rollout.weight_sender import _buckets, dtype_name, flatten_bucket, parse_dtype
from moe.runtime import gather_buckets, source_buckets
from moe.slices import Box
from moe.specs import FAMILIES, get_spec
from stores import hosted_store, init_method

PROBE = Path(__file__).parent / "_sglang_probe.py"


def _generate_bodies(num_engines: int, routes: bool = False) -> tuple[list[dict], list[list[int]]]:
    """The /generate bodies of step 3 as hpcrl's controller builds them (Session._request and
    RolloutGroup.prepare, the code a run executes), for a job with every sampling knob set (and
    with rollout.routing_replay's request for the routed experts when `routes`)."""
    job = JobConfig()
    job.rollout.temperature, job.rollout.top_p, job.rollout.max_new_tokens = 0.7, 0.9, 17
    job.rollout.ignore_eos = True
    job.algorithm.group_size = 3
    examples = [SimpleNamespace(prompt_ids=(5, 6, 7)), SimpleNamespace(prompt_ids=(8, 9))]
    group = RolloutGroup.__new__(RolloutGroup)
    group.engines = [None] * num_engines
    group.routes = RouteFormat(2, (0, 1), 2, 4) if routes else None
    session = SimpleNamespace(job=job, rollouts=group, tokenizer=SimpleNamespace(stop_token_ids=(1, 2)),
                              sampler=SimpleNamespace(batch=lambda step: examples, dropped=lambda step: []))
    request = Session._request(session, 3)
    bodies = [json.loads(b) for b in request.bodies if b is not None]
    return bodies, [list(p) for p in request.prompt_ids]


@pytest.mark.parametrize(("num_engines", "routes"), [(1, False), (4, False), (2, True)])
def test_generate_body_passes_sglang_schema(api_types, num_engines, routes):
    bodies, prompts = _generate_bodies(num_engines, routes)
    assert all(("return_routed_experts" in b) == routes for b in bodies)
    assert sum(len(b["input_ids"]) for b in bodies) == len(prompts) == 6
    got = []
    for body in bodies:
        req = api_types.GenerateRequest.from_json_value(body)  # raises JsonContractError on a violation
        assert req.return_logprob is True
        assert len(req.sampling_params) == len(req.input_ids)
        for ids, sp in zip(req.input_ids, req.sampling_params):
            assert (sp.temperature, sp.top_p, sp.max_new_tokens, sp.ignore_eos) == (0.7, 0.9, 17, True)
            assert list(sp.stop_token_ids) == [1, 2] and isinstance(sp.sampling_seed, int)
            got.append(list(ids))
    assert got == prompts


def test_sglang_schema_rejects_what_it_should(api_types):
    """The schema is strict where the notes say so: an unknown sampling key is an error (HTTP 400),
    so the body test above would catch a key hpcrl invents."""
    body, _ = _generate_bodies(1)
    body[0]["sampling_params"][0]["seed"] = 1
    with pytest.raises(api_types.JsonContractError):
        api_types.GenerateRequest.from_json_value(body[0])


def _named(spec, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [(t.name, torch.randn(t.shape, generator=gen).to(parse_dtype(t.dtype))) for t in spec.tensors]


def _check_bucket(tb, names, tensors, flat: torch.Tensor) -> None:
    """SGLang receives `flat` (hpcrl's bytes) into FlattenedTensorBucket.empty and reconstructs: every
    tensor comes back bit-exact, and hpcrl's bytes equal SGLang's own flattening of the tensors."""
    dtypes, shapes = [dtype_name(t.dtype) for t in tensors], [list(t.shape) for t in tensors]
    recv = tb.FlattenedTensorBucket.empty(names, dtypes, shapes, "cpu")  # raises if misaligned
    recv.get_flattened_tensor().copy_(flat)
    for (name, got), want, n in zip(recv.reconstruct_tensors(), tensors, names):
        assert name == n and got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.view(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)), name
    ref = tb.FlattenedTensorBucket(named_tensors=list(zip(names, tensors))).get_flattened_tensor()
    assert torch.equal(ref, flat)


def test_odd_mixed_dtype_bucket(tensor_bucket):
    """Odd sizes, mixed dtypes: SGLang refuses a tensor at a byte offset its dtype cannot view, so a
    bucket must put larger item sizes first; in that order hpcrl's bytes reconstruct bit-exact."""
    tensors = [torch.randn(7, 3), torch.randn(5).bfloat16(), torch.randn(2, 2).bfloat16(), torch.randn(3)]
    names = [f"t{i}" for i in range(len(tensors))]
    with pytest.raises(ValueError, match="Unaligned"):
        _check_bucket(tensor_bucket, names, tensors, flatten_bucket(tensors))
    order = sorted(range(len(tensors)), key=lambda i: -tensors[i].element_size())
    tensors, names = [tensors[i] for i in order], [names[i] for i in order]
    _check_bucket(tensor_bucket, names, tensors, flatten_bucket(tensors))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_weight_sender_buckets(tensor_bucket, family):
    """WeightSender.push's buckets (weight_sender._buckets) of every debug spec, small buckets so
    that many are cut, reconstructed by SGLang bit-exact."""
    named = _named(get_spec(family, "debug"))
    buckets = _buckets(named, 1 << 14)
    assert len(buckets) > 3
    for bucket in buckets:
        names, tensors = [n for n, _ in bucket], [t for _, t in bucket]
        _check_bucket(tensor_bucket, names, tensors, flatten_bucket(tensors))


@pytest.fixture
def one_rank_world():
    """A one-rank gloo default group (gather_buckets is collective), torn down after the test; an
    earlier test's one-rank group is reused as it is."""
    if dist.is_initialized():
        assert dist.get_world_size() == 1, "a multi-rank default process group is left from another test"
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_broadcast_sync_buckets(tensor_bucket, one_rank_world, family):
    """The production broadcast path's buffers (moe.runtime.source_buckets + gather_buckets, as
    hpcrl/trainer/broadcast_sync.py sends them), reconstructed by SGLang bit-exact."""
    from hpcrl.trainer.broadcast_sync import placement_from_shards

    spec = get_spec(family, "debug")
    named = dict(_named(spec, seed=1))
    shards = {n: (Box.full(tuple(t.shape)), t) for n, t in named.items()}
    placement = placement_from_shards(spec, [{n: b for n, (b, _) in shards.items()}])
    buckets = source_buckets(spec, placement, 1 << 14)
    bufs = gather_buckets(spec, placement, buckets, 0, shards)
    assert len(bufs) == len(buckets[0]) > 3
    for bucket, flat in zip(buckets[0], bufs):
        names = [spec.tensors[i].name for i in bucket.tensors]
        _check_bucket(tensor_bucket, names, [named[n] for n in names], flat[:bucket.nbytes])


def _plan(spec_name: str, bucket_bytes: int) -> list[list[list]]:
    spec = get_spec(spec_name)
    named = [(t.name, torch.empty(t.shape, dtype=parse_dtype(t.dtype))) for t in spec.tensors]
    return [[[n, dtype_name(t.dtype), list(t.shape)] for n, t in b] for b in _buckets(named, bucket_bytes)]


def run_handshake(tmp_path: Path, root: Path, engine_python: str, tp: int = 2) -> tuple[dict, list[dict]]:
    """Trainer (this venv, hpcrl's code) + `tp` engine ranks (`engine_python`, SGLang's code) in one
    weight-update group of world size 1 + tp (rank_offset 1, engine rank = 1 + tp_rank, as SGLang's
    init_weights_update_group computes it); returns the trainer's and the engines' JSON reports."""
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps(_plan("deepseek_v3/debug", 1 << 15)))
    world = 1 + tp
    store = hosted_store(world)
    init = init_method(store)
    procs = [subprocess.Popen([sys.executable, str(PROBE), "trainer", str(plan), init, str(world),
                               str(tmp_path / "trainer.json"), "7"], stderr=subprocess.PIPE, text=True)]
    procs += [subprocess.Popen([engine_python, str(PROBE), "engine", str(root), str(plan), init,
                                str(1 + r), str(world), str(tmp_path / f"engine{r}.json")],
                               stderr=subprocess.PIPE, text=True) for r in range(tp)]
    errors = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        if p.returncode:
            errors.append(f"{' '.join(p.args[:3])} exit {p.returncode}: {err[-3000:]}")
    assert not errors, "\n".join(errors)
    trainer = json.loads((tmp_path / "trainer.json").read_text())
    return trainer, [json.loads((tmp_path / f"engine{r}.json").read_text()) for r in range(tp)]


def test_handshake_tp2_bit_exact(tmp_path, sglang_root):
    trainer, engines = run_handshake(tmp_path, sglang_root, sys.executable)
    assert len(trainer["digests"]) == len(get_spec("deepseek_v3/debug").tensors)
    for engine in engines:
        assert engine["digests"] == trainer["digests"]
    assert hashlib.sha256(json.dumps(trainer["digests"]).encode()).hexdigest()  # non-empty, JSON-able
