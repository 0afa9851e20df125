"""The multi-source broadcast sync (hpcrl/trainer/broadcast_sync.py): its turn schedule, and two
real trainer processes (gloo, TP 2: every source gathers pieces from the other) pushing into three
real reference servers over SGLang's weight-update protocol -- bit-exact, and a refused update
named on every trainer rank, and the next sync after connect() re-forms the groups it dropped."""

from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest
import torch
import torch.multiprocessing as mp

from hpcrl.models.presets import CONFIG_DIR, load_hf_config
from hpcrl.rollout.client import EngineClient, launch_reference_server
from hpcrl.rollout.reshard_route import spec_at_dtype
from hpcrl.trainer.broadcast_sync import engine_blocks, placement_from_shards, turn_block
from moe.slices import Box
from stores import hosted_store, joined_store

CONFIG_PATH = CONFIG_DIR / "tiny-qwen3-moe.json"
NUM_ENGINES, NUM_TRAINERS = 3, 2


@pytest.mark.parametrize("sources", range(1, 9))
@pytest.mark.parametrize("engines", range(1, 9))
def test_turns_reach_every_engine_once_and_never_share_a_multi_engine_block(sources, engines):
    blocks = engine_blocks(sources, engines)
    assert sorted(e for b in blocks for e in b) == list(range(engines))
    for i in range(sources):
        reached = [e for k in range(len(blocks)) for e in blocks[turn_block(i, k, len(blocks))]]
        assert sorted(reached) == list(range(engines))  # every engine exactly once per source
    for k in range(len(blocks)):
        senders: dict[int, int] = {}
        for i in range(sources):
            j = turn_block(i, k, len(blocks))
            senders[j] = senders.get(j, 0) + 1
        # two sources may share a block in one turn only if it is a single engine (no cross-wait)
        assert all(n == 1 or len(blocks[j]) == 1 for j, n in senders.items()), (k, senders)
    assert len(blocks) == min(sources, engines)


def test_placement_from_shards_refuses_shards_that_do_not_tile():
    spec = spec_at_dtype(load_hf_config("tiny-qwen3-moe", None), "float32")
    t = spec.tensors[0]
    half = Box.full(t.shape).split(0, 2, 0)
    whole = {x.name: Box.full(x.shape) for x in spec.tensors}
    placement = placement_from_shards(spec, [whole, whole])
    assert placement[0] == [(Box.full(t.shape), (0, 1))]
    with pytest.raises(RuntimeError, match=f"shards of {t.name} .* do not tile its shape"):
        placement_from_shards(spec, [{**whole, t.name: half}, {**whole, t.name: half}])


def test_sources_are_capped_and_still_cover_every_tensor():
    from moe.layouts import TrainerLayout
    from moe.runtime import source_buckets

    spec = spec_at_dtype(load_hf_config("tiny-qwen3-moe", None), "float32")
    placement = TrainerLayout(tp=2, ep=2, vocab_divisible_by=1).placement(spec)
    for cap, sources in ((None, [0, 1]), (1, [0]), (2, [0, 1])):
        buckets = source_buckets(spec, placement, 16 << 10, max_sources=cap)
        assert [s for s, b in enumerate(buckets) if b] == sources
        sent = sorted(ti for bs in buckets for b in bs for ti in b.tensors)
        assert sent == list(range(len(spec.tensors)))  # every tensor exactly once
        for bs in buckets:
            for b in bs:  # packed back to back, each offset aligned to its tensor's item size
                sizes = [spec.tensors[ti].nbytes for ti in b.tensors]
                assert b.offsets == [sum(sizes[:i]) for i in range(len(sizes))] and b.nbytes == sum(sizes)
                assert all(o % spec.tensors[ti].itemsize == 0 for ti, o in zip(b.tensors, b.offsets))


def global_tensors(spec, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) for t in spec.tensors}


def _trainer(rank: int, port: int, urls: list[str], out_dir: str) -> None:
    """One trainer rank: connect, push v1, a push engine 1 refuses (v2), then v3 after it resumes
    and the dropped groups are connected again."""
    import torch.distributed as dist

    from hpcrl.trainer.broadcast_sync import BroadcastSync
    from moe.layouts import TrainerLayout

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=joined_store(port, NUM_TRAINERS), rank=rank, world_size=NUM_TRAINERS)
    spec = spec_at_dtype(load_hf_config("tiny-qwen3-moe", None), "float32")
    layout = TrainerLayout(tp=NUM_TRAINERS, vocab_divisible_by=1)
    current: dict = {}

    def hold(seed: int) -> None:
        full = global_tensors(spec, seed)
        current.clear()
        current.update({n: (b, full[n][b.index].clone()) for n, b in layout.shards(spec, rank)})

    hold(1)
    sync = BroadcastSync(spec, lambda: current, urls, bucket_bytes=16 << 10, timeout_s=60)
    sync.connect()
    report: dict = {"describe": sync.describe(), "v1": sync.push("v1")}
    engine1 = EngineClient(urls[1], timeout_s=60)
    dist.barrier()
    if rank == 0:
        engine1.release_memory_occupation(["weights"])
    dist.barrier()
    try:
        sync.push("v2")
        report["v2"] = None
    except RuntimeError as exc:
        report["v2"] = str(exc)
    if rank == 0:
        engine1.resume_memory_occupation(["weights"])
        report["sessions_open"] = [EngineClient(u, timeout_s=60).server_info()["internal_states"][0]
                                   ["weight_update_session"] for u in urls]
    dist.barrier()
    sync.connect()  # re-forms the groups the refusal dropped (SGLang refuses before receiving)
    hold(2)
    report["v3"] = sync.push("v3")
    with open(os.path.join(out_dir, f"trainer{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    logs = tmp_path_factory.mktemp("engines")
    started = []  # one after another: a server dies with the thread that launched it (PDEATHSIG)
    try:
        for i in range(NUM_ENGINES):
            started.append(launch_reference_server(str(CONFIG_PATH), "cpu", i, str(logs / f"engine{i}.log"),
                                                   threads=1))
        yield [url for _, url in started]
    finally:
        for proc, _ in started:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in started:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.mark.timeout(240)
def test_two_sources_three_engines_bit_exact_and_a_refusal_is_named(engines, tmp_path):
    ctx = mp.get_context("spawn")
    store = hosted_store(NUM_TRAINERS)
    procs = [ctx.Process(target=_trainer, args=(r, store.port, engines, str(tmp_path)))
             for r in range(NUM_TRAINERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    reports = [json.loads((tmp_path / f"trainer{r}.json").read_text()) for r in range(NUM_TRAINERS)]

    spec = spec_at_dtype(load_hf_config("tiny-qwen3-moe", None), "float32")
    model_bytes = sum(t.nbytes for t in spec.tensors)
    assert reports[0]["describe"].startswith("sources [0, 1] into 3 engine(s) in 2 turn(s)")
    for version in ("v1", "v3"):
        assert reports[0][version]["bytes"] == NUM_ENGINES * model_bytes and reports[1][version] is None
    # the refusal: every trainer rank raises the same message, naming the engine and its reason
    assert reports[0]["v2"] == reports[1]["v2"] and reports[0]["v2"] is not None
    assert f"engine 1 ({engines[1]})" in reports[0]["v2"] and "weights are released" in reports[0]["v2"]
    assert "broadcast weight sync failed in turn" in reports[0]["v2"]
    assert "refused before receiving" in reports[0]["v2"]
    assert reports[0]["sessions_open"] == [False] * NUM_ENGINES  # the failed push closed every session

    want = global_tensors(spec, 2)  # v3, pushed after the refused v2: every engine holds it exactly
    for url in engines:
        client = EngineClient(url, timeout_s=60)
        assert client.server_info()["weight_version"] == "v3"
        for t in spec.tensors:
            got = torch.tensor(client.get_weights_by_name(t.name, truncate_size=t.shape[0]), dtype=torch.float32)
            assert torch.equal(got, want[t.name]), (url, t.name)
        groups = client.server_info()["internal_states"][0]["weight_update_groups"]
        assert len(groups) == 2 and all(g.startswith("hpcrl_bcast_src") for g in groups), groups
