"""Unit tests of checkpoints/: round trips, reshard-on-load, commit protocol, retention, corruption.

In-process: several "ranks" are threads sharing one store (MemoryStore or a LocalFSStore on
tmp_path); the commit protocol has no collectives, so threads exercise it exactly as processes do.
Multi-process and kill -9 cases live in tests/mpi/test_checkpoint_mpi.py and test_checkpoint_crash.py.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path

import h5py
import pytest
import torch

from checkpoints import (CheckpointExistsError, CheckpointNotFoundError, CheckpointWriter, CommitError,
                         CommitTimeoutError, CorruptCheckpointError, LocalFSStore, MemoryStore, ShardStore,
                         apply_retention, discard_newer, latest_pointer, latest_step, list_checkpoints,
                         open_checkpoint, verify)
from checkpoints.manifest import Manifest
from moe.slices import Box

pytestmark = pytest.mark.timeout(60)


def bits(t: torch.Tensor) -> torch.Tensor:
    """A tensor's raw bytes, so comparisons are bit-exact for every dtype (NaN, -0.0, bf16, ...)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def save_ranks(store, step: int, world: int, parts: dict[int, list[tuple[str, torch.Tensor, Box]]],
               metadata=None, attempt: str = "att1", **kw) -> list:
    """Every rank r in parallel threads writes parts[r] (name, global tensor, box) and commits."""
    results: dict[int, object] = {}

    def rank_main(r: int) -> None:
        w = CheckpointWriter(store, step, rank=r, world_size=world, attempt_id=attempt, **kw)
        for name, g, box in parts.get(r, []):
            w.write(name, g[box.relative_to(Box.full(tuple(g.shape)))].clone(), box, tuple(g.shape))
        w.write_blob("rng", f"rank{r}".encode())
        try:
            w.commit(metadata if r == 0 else None)
            results[r] = w.wait()
        except Exception as e:  # surfaced to the test below
            results[r] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return [results[r] for r in range(world)]


@pytest.fixture(params=["memory", "localfs"])
def store(request, tmp_path):
    return MemoryStore() if request.param == "memory" else LocalFSStore(tmp_path / "ckpt")


def test_stores_implement_protocol(tmp_path):
    assert isinstance(MemoryStore(), ShardStore)
    assert isinstance(LocalFSStore(tmp_path), ShardStore)


def test_roundtrip_every_dtype_bit_exact(store):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(5, 7, generator=g),
        "f64": torch.randn(3, generator=g, dtype=torch.float64),
        "f16": torch.randn(4, 2, generator=g).half(),
        "bf16": torch.randn(6, 3, 2, generator=g).bfloat16(),
        "fp8": torch.randn(9, generator=g).to(torch.float8_e4m3fn),
        "i64": torch.randint(-2**62, 2**62, (4,), generator=g),
        "u8": torch.randint(0, 255, (2, 2), generator=g, dtype=torch.uint8),
        "bool": torch.rand(10, generator=g) > 0.5,
        "scalar_step": torch.tensor(12345, dtype=torch.int64),
        "empty": torch.empty(0, 4),
    }
    tensors["f32"][0, 0] = float("nan")
    tensors["f32"][0, 1] = -0.0
    w = CheckpointWriter(store, 1)
    for name, t in tensors.items():
        w.write(name, t)
    w.commit({"step": 1})
    r = open_checkpoint(store)
    assert r.tensor_names() == sorted(tensors)
    for name, t in tensors.items():
        got = r.read(name)
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(bits(got), bits(t)), name
    assert verify(store).slices == len(tensors)


def make_sharded_state(world: int) -> tuple[dict[str, torch.Tensor], dict[int, list]]:
    """TP (axis 1), EP (axis 0 of stacked experts) and fully replicated tensors over `world` ranks."""
    g = torch.Generator().manual_seed(1)
    state = {
        "attn.qkv": torch.randn(12, 8 * world, generator=g),
        "experts.w1": torch.randn(2 * world, 6, 5, generator=g).bfloat16(),
        "exp_avg.experts.w1": torch.randn(2 * world, 6, 5, generator=g),
        "norm": torch.randn(16, generator=g),
        "adam.step": torch.tensor(7, dtype=torch.int64),
    }
    parts: dict[int, list] = {r: [] for r in range(world)}
    for r in range(world):
        parts[r].append(("attn.qkv", state["attn.qkv"], Box.full((12, 8 * world)).split(1, world, r)))
        for n in ("experts.w1", "exp_avg.experts.w1"):
            parts[r].append((n, state[n], Box.full(tuple(state[n].shape)).split(0, world, r)))
        parts[r].append(("norm", state["norm"], Box.full((16,))))  # replicated on every rank
    parts[0].append(("adam.step", state["adam.step"], Box((), ())))
    return state, parts


def test_reshard_on_load_reads_only_overlapping_shards():
    store = MemoryStore()
    state, parts = make_sharded_state(4)
    results = save_ranks(store, 10, 4, parts, metadata={"layout": {"tp": 4}}, block_bytes=64)
    assert all(not isinstance(x, Exception) for x in results), results
    assert results[0].committed and not results[1].committed
    # A 2-rank layout that splits experts along axis 1 instead: every (rank, tensor) is bit-exact.
    for new_rank in range(2):
        r = open_checkpoint(store, 10)
        store.opened.clear()
        for name in ("experts.w1", "exp_avg.experts.w1"):
            box = Box.full(tuple(state[name].shape)).split(1, 2, new_rank)
            assert torch.equal(bits(r.read(name, box)), bits(state[name][box.relative_to(Box.full(box.end))]))
        assert len(set(store.opened)) == 4  # experts span all old ranks
        r.close()
    # A box inside old rank 2's TP columns touches only rank 2's file, and opens it once.
    r = open_checkpoint(store, 10)
    store.opened.clear()
    box = Box((3, 17), (5, 6))
    for _ in range(3):
        assert torch.equal(r.read("attn.qkv", box), state["attn.qkv"][3:8, 17:23])
    assert store.opened == [(10, "rank00002.h5")]
    assert torch.equal(r.read("norm"), state["norm"])
    assert r.read("adam.step").item() == 7
    assert [r.blob("rng", k) for k in r.blob_ranks("rng")] == [f"rank{k}".encode() for k in range(4)]
    assert r.metadata == {"layout": {"tp": 4}}
    # One rank reads everything (world size 1).
    for name, t in state.items():
        assert torch.equal(bits(r.read(name)), bits(t)), name


@pytest.mark.parametrize("verify_reads", [True, False])
def test_partial_reads_across_checksum_blocks(tmp_path, verify_reads):
    g = torch.randn(37, 11, 3, generator=torch.Generator().manual_seed(2))
    w = CheckpointWriter(tmp_path, 0, block_bytes=5 * 11 * 3 * 4)  # 5 rows per block
    w.write("x", g[:20].clone(), Box((0, 0, 0), (20, 11, 3)), (37, 11, 3))
    w.write("x", g[20:].clone(), Box((20, 0, 0), (17, 11, 3)), (37, 11, 3))
    w.commit()
    r = open_checkpoint(tmp_path, verify=verify_reads)
    for box in [Box((0, 0, 0), (37, 11, 3)), Box((4, 0, 0), (13, 11, 3)), Box((5, 0, 0), (10, 11, 3)),
                Box((18, 2, 1), (5, 7, 2)), Box((36, 10, 2), (1, 1, 1)), Box((0, 0, 0), (0, 11, 3))]:
        sl = box.relative_to(Box.full((37, 11, 3)))
        assert torch.equal(r.read("x", box), g[sl]), box


def test_commit_rejects_gaps_overlaps_and_disagreement():
    g = torch.zeros(8, 4)
    cases = [
        ({0: [("w", g, Box((0, 0), (4, 4)))], 1: [("w", g, Box((0, 0), (4, 4)))]}, "cover 16 of 32"),
        ({0: [("w", g, Box((0, 0), (5, 4)))], 1: [("w", g, Box((4, 0), (4, 4)))]}, "partially overlaps"),
    ]
    for i, (parts, message) in enumerate(cases):
        store = MemoryStore()
        results = save_ranks(store, i, 2, parts, commit_timeout_s=5)
        assert isinstance(results[0], CommitError) and message in str(results[0]), results[0]
        assert "'w'" in str(results[0])
        with pytest.raises(CheckpointNotFoundError):
            open_checkpoint(store)
    store = MemoryStore()
    parts = {0: [("w", g, Box((0, 0), (4, 4)))], 1: [("w", torch.zeros(8, 5), Box((4, 0), (4, 4)))]}
    results = save_ranks(store, 0, 2, parts, commit_timeout_s=5)
    assert isinstance(results[0], CommitError)
    assert "[8, 4] float32 on rank 0 but [8, 5] float32 on rank 1" in str(results[0])


def test_commit_timeout_names_missing_ranks_and_stale_markers_are_ignored(tmp_path):
    state, parts = make_sharded_state(3)
    # A crashed attempt left rank 1's and rank 2's shards and markers in step 5's directory.
    for r in (1, 2):
        w = CheckpointWriter(tmp_path, 5, rank=r, world_size=3, attempt_id="crashed")
        for name, g, box in parts[r]:
            w.write(name, torch.full(box.shape, 99.0, dtype=g.dtype), box, tuple(g.shape))
        w.commit()
    w0 = CheckpointWriter(tmp_path, 5, rank=0, world_size=3, attempt_id="retry", commit_timeout_s=0.3)
    for name, g, box in parts[0]:
        w0.write(name, g[box.relative_to(Box.full(tuple(g.shape)))].clone(), box, tuple(g.shape))
    with pytest.raises(CommitTimeoutError, match=r"ranks \[1, 2\] did not finish") as e:
        w0.commit()
    assert e.value.missing_ranks == [1, 2] and e.value.step == 5
    assert list_checkpoints(tmp_path) == [] and latest_step(tmp_path) is None
    # The retry of all three ranks commits and reads the retry's data, not the crashed attempt's.
    results = save_ranks(LocalFSStore(tmp_path), 5, 3, parts, attempt="retry2", commit_timeout_s=10)
    assert all(not isinstance(x, Exception) for x in results), results
    r = open_checkpoint(tmp_path)
    assert r.step == 5 and r.manifest.attempt_id == "retry2"
    for name, t in state.items():
        assert torch.equal(bits(r.read(name)), bits(t)), name
    names = LocalFSStore(tmp_path).list_names(5)
    assert names == ["manifest.json", "rank00000.h5", "rank00001.h5", "rank00002.h5"], names


def test_async_save_snapshots_and_reports_errors(tmp_path):
    t = torch.arange(1000, dtype=torch.float32)
    w = CheckpointWriter(tmp_path, 1, async_save=True)
    w.write("t", t)
    t.add_(1)  # the training step continues while the save runs
    w.commit({"step": 1})
    res = w.wait(30)
    assert w.done() and res.committed and res.nbytes == 4000 and res.blocked_s <= res.total_s
    assert torch.equal(open_checkpoint(tmp_path).read("t"), torch.arange(1000, dtype=torch.float32))
    # An error of the background thread surfaces in wait().
    w = CheckpointWriter(tmp_path, 2, world_size=2, attempt_id="a", async_save=True, commit_timeout_s=0.2)
    w.write("t", t)
    w.commit()
    with pytest.raises(CommitTimeoutError, match=r"ranks \[1\]"):
        w.wait(30)


def test_non_zero_rank_can_wait_for_commit():
    store = MemoryStore()
    w1 = CheckpointWriter(store, 3, rank=1, world_size=2, attempt_id="a", async_save=True)
    w1.write("x", torch.ones(2), Box((2,), (2,)), (4,))
    w1.commit()
    out = {}
    waiter = threading.Thread(target=lambda: out.setdefault("r", w1.wait(20, for_commit=True)))
    waiter.start()
    w0 = CheckpointWriter(store, 3, rank=0, world_size=2, attempt_id="a")
    w0.write("x", torch.zeros(2), Box((0,), (2,)), (4,))
    w0.commit()
    waiter.join(20)
    assert out["r"].committed
    assert torch.equal(open_checkpoint(store).read("x"), torch.tensor([0.0, 0, 1, 1]))
    w = CheckpointWriter(store, 4, rank=1, world_size=2, attempt_id="a", commit_timeout_s=0.2)
    w.commit()
    with pytest.raises(CommitTimeoutError, match="rank 0 did not commit"):
        w.wait(for_commit=True)


def save_simple(store, step: int, keep_last: int | None = None, value: float | None = None) -> None:
    w = CheckpointWriter(store, step, keep_last=keep_last)
    w.write("w", torch.full((3,), float(step if value is None else value)))
    w.commit({"step": step})


def test_retention_latest_and_discard(store):
    for step in (10, 20, 30):
        save_simple(store, step)
    incomplete = CheckpointWriter(store, 25, rank=1, world_size=2, attempt_id="x")
    incomplete.commit()  # rank 1's shard and marker only: step 25 never becomes visible
    assert list_checkpoints(store) == [10, 20, 30] and latest_step(store) == 30
    save_simple(store, 40, keep_last=2)
    assert list_checkpoints(store) == [30, 40] and store.list_steps() == [30, 40]
    assert discard_newer(store, 30) == [40]
    assert latest_step(store) == 30 and open_checkpoint(store).read("w")[0].item() == 30
    save_simple(store, 31, keep_last=1)  # latest is always kept: 31 survives, 30 goes
    assert list_checkpoints(store) == [31] and latest_step(store) == 31
    with pytest.raises(CheckpointExistsError, match="step 31 is already committed"):
        CheckpointWriter(store, 31)
    with pytest.raises(ValueError, match="keep_last must be an int >= 1"):
        apply_retention(store, 0)
    with pytest.raises(ValueError, match="step 7 is not a complete checkpoint"):
        discard_newer(store, 7)


def test_saves_killed_after_their_commit_never_pile_up(store, monkeypatch):
    """A kill between the commit and the cleanup after it leaves one checkpoint too many; the next
    save's retention before its own commit takes it away, so consecutive such kills cannot add up."""
    real = CheckpointWriter._retain
    monkeypatch.setattr(CheckpointWriter, "_retain",
                        lambda self, when: None if when == "after commit" else real(self, when))
    for step in range(1, 8):
        save_simple(store, step, keep_last=3)
        assert len(list_checkpoints(store)) == min(step, 4)
    monkeypatch.setattr(CheckpointWriter, "_retain", real)
    save_simple(store, 8, keep_last=3)
    assert list_checkpoints(store) == [6, 7, 8]


def test_latest_pointer_and_incomplete_steps(tmp_path):
    for step in (1, 2):
        save_simple(tmp_path, step)
    assert latest_pointer(tmp_path) == 2 and (tmp_path / "latest").read_text() == "2\n"
    (tmp_path / "step_000003").mkdir()  # an interrupted save: no manifest
    assert open_checkpoint(tmp_path).step == 2
    # A crash between step 2's manifest rename and the pointer update: the manifest wins.
    (tmp_path / "latest").write_text("1\n")
    assert latest_step(tmp_path) == 2 and open_checkpoint(tmp_path).step == 2
    (tmp_path / "latest").unlink()
    assert latest_pointer(tmp_path) is None and open_checkpoint(tmp_path).step == 2
    (tmp_path / "latest").write_text("garbage")
    with pytest.raises(ValueError, match="holds 'garbage', not a step number"):
        latest_pointer(tmp_path)
    with pytest.raises(CheckpointNotFoundError, match=r"step 3 is not committed.*complete steps: \[1, 2\]"):
        open_checkpoint(tmp_path, 3)
    with pytest.raises(CheckpointNotFoundError, match="no complete checkpoint"):
        open_checkpoint(tmp_path / "empty")


def dataset_offset(path: Path, dataset: str) -> int:
    with h5py.File(path, "r") as f:
        return f[dataset].id.get_offset()


def test_corruption_detected_with_file_and_step(tmp_path):
    state, parts = make_sharded_state(2)
    results = save_ranks(LocalFSStore(tmp_path), 7, 2, parts, block_bytes=64)
    assert all(not isinstance(x, Exception) for x in results), results
    shard1 = tmp_path / "step_000007" / "rank00001.h5"
    with h5py.File(shard1, "r") as f:
        ds_name = next(n for n in f if f[n].attrs.get("name") == "attn.qkv")
    off = dataset_offset(shard1, ds_name) + 8 * 4 + 2  # inside row 1 of rank 1's TP slice
    raw = bytearray(shard1.read_bytes())
    raw[off] ^= 0x40
    shard1.write_bytes(bytes(raw))
    r = open_checkpoint(tmp_path)
    assert torch.equal(r.read("attn.qkv", Box((0, 0), (12, 8))), state["attn.qkv"][:, :8])  # rank 0 only
    assert torch.equal(r.read("attn.qkv", Box((4, 8), (8, 8))), state["attn.qkv"][4:, 8:])  # other blocks
    with pytest.raises(CorruptCheckpointError) as e:
        r.read("attn.qkv")
    assert str(shard1) in str(e.value) and "step 7" in str(e.value) and "'attn.qkv'" in str(e.value)
    assert e.value.step == 7 and e.value.location == str(shard1)
    with pytest.raises(CorruptCheckpointError, match="rank00001.h5"):
        verify(tmp_path, 7)
    # Without verification the flipped bit comes back unnoticed: the checksum is what catches it.
    with open_checkpoint(tmp_path, verify=False) as unverified:
        assert not torch.equal(unverified.read("attn.qkv"), state["attn.qkv"])
    r.close()  # HDF5 shares an open file by inode: close it before truncating that inode
    # Truncated shard (the flipped byte restored), missing shard, edited manifest.
    raw[off] ^= 0x40
    shard1.write_bytes(bytes(raw[: len(raw) - 100]))
    with pytest.raises(CorruptCheckpointError, match=r"step 7: .*rank00001.h5: .*truncated"):
        open_checkpoint(tmp_path).read("attn.qkv")
    shard1.unlink()
    with pytest.raises(CorruptCheckpointError, match=r"rank00001.h5: shard file is missing"):
        open_checkpoint(tmp_path).read("attn.qkv")
    manifest = tmp_path / "step_000007" / "manifest.json"
    manifest.write_text(manifest.read_text().replace('"step": 7', '"step": 8', 1))
    with pytest.raises(CorruptCheckpointError, match=r"manifest.json: manifest checksum mismatch"):
        open_checkpoint(tmp_path, 7)


def test_corrupt_blob_and_memory_store_corruption():
    store = MemoryStore()
    w = CheckpointWriter(store, 1)
    w.write_blob("rng", b"x" * 4096)
    w.write("w", torch.arange(4096, dtype=torch.int32))
    w.commit()
    data = store._files[(1, "rank00000.h5")]
    store.corrupt(1, "rank00000.h5", data.index(b"x" * 4096) + 100)
    r = open_checkpoint(store)
    assert torch.equal(r.read("w"), torch.arange(4096, dtype=torch.int32))
    with pytest.raises(CorruptCheckpointError,
                       match=r"memory://step_000001/rank00000.h5: checksum mismatch in blob 'rng'"):
        r.blob("rng")


def test_manifest_versions():
    store = MemoryStore()
    save_simple(store, 1)
    doc = json.loads(store.get_text(1, "manifest.json"))
    assert doc["format_version"] == 1 and doc["body"]["tensors"]["w"]["dtype"] == "float32"
    doc["format_version"] = 99
    with pytest.raises(ValueError, match="format_version 99 is not supported.*upgrade hpcrl"):
        Manifest.from_text(json.dumps(doc))
    with pytest.raises(ValueError, match="not valid JSON"):
        Manifest.from_text("{")


@pytest.mark.parametrize("call, message", [
    (lambda w: w.write("x", torch.zeros(2, 3), Box((0, 0), (3, 2)), (4, 4)),
     "tensor shape [2, 3] != box shape [3, 2]"),
    (lambda w: w.write("x", torch.zeros(2, 3), Box((3, 0), (2, 3)), (4, 4)),
     "does not lie inside global_shape [4, 4]"),
    (lambda w: w.write("x", torch.zeros(2, 3), Box((0, 0), (2, 3))), "global_shape is required"),
    (lambda w: w.write("", torch.zeros(2)), "name must be a non-empty str"),
    (lambda w: w.write("x", [1, 2]), "tensor must be a torch.Tensor, got list"),
    (lambda w: w.write("x", torch.zeros(2, dtype=torch.complex64)),
     "dtype torch.complex64 cannot be checkpointed"),
    (lambda w: (w.write("x", torch.zeros(2), Box((0,), (2,)), (4,)),
                w.write("x", torch.zeros(2), Box((1,), (2,)), (4,))), "overlaps"),
    (lambda w: (w.write_blob("b", b"1"), w.write_blob("b", b"2")), "already wrote a blob"),
    (lambda w: w.write_blob("b", "text"), "data must be bytes, got str"),
    (lambda w: w.commit({"cfg": object()}), "metadata['cfg'] is not JSON-serializable"),
    (lambda w: (w.commit(), w.write("x", torch.zeros(1))), "write() after commit()"),
])
def test_bad_writer_calls(call, message):
    w = CheckpointWriter(MemoryStore(), 0)
    with pytest.raises((ValueError, RuntimeError)) as e:
        call(w)
    assert message in str(e.value)


@pytest.mark.parametrize("kwargs, message", [
    ({"step": -1}, "step must be an int >= 0"),
    ({"step": 0, "rank": 2, "world_size": 2, "attempt_id": "a"}, "rank must be an int in [0, 2)"),
    ({"step": 0, "rank": 0, "world_size": 2}, "attempt_id is required when world_size > 1"),
    ({"step": 0, "attempt_id": "has space"}, "attempt_id must match"),
    ({"step": 0, "keep_last": 0}, "keep_last must be None or an int >= 1"),
    ({"step": 0, "commit_timeout_s": 0}, "commit_timeout_s must be > 0"),
])
def test_bad_writer_arguments(kwargs, message):
    with pytest.raises(ValueError) as e:
        CheckpointWriter(MemoryStore(), **kwargs)
    assert message in str(e.value)


def test_bad_reader_calls():
    store = MemoryStore()
    w = CheckpointWriter(store, 0, rank=1, world_size=2, attempt_id="a")
    with pytest.raises(ValueError, match="commit\\(metadata=...\\) is for rank 0 only"):
        w.commit({"k": 1})
    save_simple(store, 1)
    r = open_checkpoint(store)
    with pytest.raises(ValueError, match=r"no tensor 'ww' .*did you mean \['w'\]"):
        r.read("ww")
    with pytest.raises(ValueError, match=r"does not lie inside the global shape \[3\]"):
        r.read("w", Box((2,), (2,)))
    with pytest.raises(ValueError, match="no blob 'rng' from rank 0"):
        r.blob("rng")
    with pytest.raises(ValueError, match="store must be a directory path or a ShardStore"):
        open_checkpoint(42)
