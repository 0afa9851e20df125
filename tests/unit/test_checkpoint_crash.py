"""Crash safety of checkpoints/: kill -9 writer processes at random points of a save, many times.

Two writer processes (ranks 0 and 1 of a world of 2, forked from the test so they start in
milliseconds) save step after step into a LocalFSStore; the test SIGKILLs them at a random moment
(sometimes one rank first), then checks the invariants a resume relies on: the `latest` file
always parses and names a complete checkpoint, the newest complete checkpoint loads with
bit-exact contents and verifies, incomplete directories are ignored, and the next attempt can save
again over the debris. Then a truncated and a bit-flipped shard are detected with the file and
step in the message, and the previous checkpoint still loads (the `--resume-from` path).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from checkpoints import (CheckpointWriter, CorruptCheckpointError, LocalFSStore, latest_pointer,
                         latest_step, list_checkpoints, open_checkpoint, verify)
from moe.slices import Box

pytestmark = pytest.mark.timeout(120)

WORLD = 2
SHAPES = {"policy.w": ((256, 1024), torch.float32), "adam.exp_avg.w": ((256, 1024), torch.float32),
          "policy.emb": ((128, 512), torch.bfloat16)}
KEEP_LAST = 3


def expected(name: str, step: int) -> torch.Tensor:
    """The global value of tensor `name` at `step` (different for every step and tensor)."""
    shape, dtype = SHAPES[name]
    g = torch.Generator().manual_seed(step * 1000 + sorted(SHAPES).index(name))
    return torch.randn(shape, generator=g).to(dtype)


def rank_box(name: str, rank: int) -> Box:
    return Box.full(SHAPES[name][0]).split(0, WORLD, rank)


def writer_loop(root: str, attempt: str, first_step: int, rank: int) -> None:
    """A trainer rank that checkpoints every step, forever (until it is killed)."""
    torch.set_num_threads(1)
    step = first_step
    while True:
        w = CheckpointWriter(root, step, rank=rank, world_size=WORLD, attempt_id=attempt,
                             keep_last=KEEP_LAST, commit_timeout_s=30, block_bytes=256 << 10)
        for name in SHAPES:
            box = rank_box(name, rank)
            w.write(name, expected(name, step)[box.relative_to(Box.full(SHAPES[name][0]))].clone(),
                    box, SHAPES[name][0])
        w.write("adam.step", torch.tensor(step, dtype=torch.int64)) if rank == 0 else None
        w.write_blob("rng", f"rank{rank}-step{step}".encode())
        w.commit({"step": step, "attempt": attempt} if rank == 0 else None)
        w.wait(for_commit=True)  # lockstep, like a training loop
        step += 1


def phase(root: Path, step: int) -> str:
    """What a kill left in a step directory: how far the save had got."""
    d = root / f"step_{step:06d}"
    names = os.listdir(d) if d.exists() else []
    if "manifest.json" in names:
        return "committed"
    if any(n.endswith(".done") for n in names):
        return "markers"
    if any(n.endswith(".h5") for n in names):
        return "shards"
    if any(".tmp-" in n for n in names):
        return "tmp-files"
    return "not-started"


def check_resumable(root: Path) -> int:
    """The invariants after a crash; returns the step to resume from."""
    steps = list_checkpoints(root)
    assert steps, "no complete checkpoint at all"
    pointer = latest_pointer(root)
    # The pointer parses and names a complete checkpoint; it lags the newest manifest only when
    # the kill fell between a manifest rename and the pointer update (absent before the first).
    if pointer is None:
        assert len(steps) == 1, steps
    else:
        assert pointer in steps and steps[-1] - pointer in (0, 1), (pointer, steps)
    step = latest_step(root)
    with open_checkpoint(root) as r:
        assert r.step == step == steps[-1] and r.metadata["step"] == step
        for name in SHAPES:
            assert torch.equal(r.read(name), expected(name, step)), name
        assert r.read("adam.step").item() == step
        blobs = [r.blob("rng", k) for k in range(WORLD)]
        assert blobs == [f"rank{k}-step{step}".encode() for k in range(WORLD)]
    verify(root, step)
    return step


def start_ranks(root: Path, attempt: str, first_step: int) -> list[mp.Process]:
    ctx = mp.get_context("fork")  # the test process has torch imported already: forking is instant
    procs = [ctx.Process(target=writer_loop, args=(str(root), attempt, first_step, r), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    return procs


def kill_all(procs: list[mp.Process]) -> None:
    for p in procs:
        if p.pid is not None and p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join(10)
        assert not p.is_alive()


def test_kill_minus_9_during_saves_never_corrupts_latest(tmp_path):
    root = tmp_path / "ckpt"
    rng = random.Random(1234)
    phases: Counter[str] = Counter()
    # First get one complete checkpoint (a run always has one before it can be resumed).
    procs = start_ranks(root, "attempt0", 1)
    try:
        deadline = time.monotonic() + 60
        while not list_checkpoints(root):
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "first save failed"
            time.sleep(0.01)
    finally:
        kill_all(procs)
    step = check_resumable(root)
    saved = {step}
    for attempt in range(1, 26):
        procs = start_ranks(root, f"attempt{attempt}", step + 1)
        try:
            time.sleep(rng.uniform(0.0, 0.4))
            if rng.random() < 0.3:  # one rank dies first, the other a moment later
                victim = procs[rng.randrange(WORLD)]
                os.kill(victim.pid, signal.SIGKILL)
                time.sleep(rng.uniform(0.0, 0.1))
        finally:
            kill_all(procs)
        phases[phase(root, max(root_steps(root), default=step))] += 1
        step = check_resumable(root)
        saved.add(step)
        # Retention never leaves more than KEEP_LAST complete checkpoints plus one crash's worth.
        assert len(list_checkpoints(root)) <= KEEP_LAST + 1
    print(f"kill points: {dict(phases)}; checkpoints reached: {len(saved)}, last step {step}")
    assert len(saved) > 5  # saves kept completing between the kills
    assert sum(n for p, n in phases.items() if p != "committed") > 0  # some kills landed mid-save


def root_steps(root: Path) -> list[int]:
    return LocalFSStore(root).list_steps()


def test_damaged_shards_are_named_and_older_checkpoint_still_loads(tmp_path):
    root = tmp_path / "ckpt"
    procs = start_ranks(root, "a", 1)
    try:
        deadline = time.monotonic() + 60
        while len(list_checkpoints(root)) < 2:
            assert time.monotonic() < deadline and all(p.is_alive() for p in procs), "saves failed"
            time.sleep(0.01)
    finally:
        kill_all(procs)
    newest, older = list_checkpoints(root)[-1], list_checkpoints(root)[-2]
    shard = root / f"step_{newest:06d}" / "rank00001.h5"
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) * 2 // 3])  # truncated (e.g. a full disk or a lost write)
    with pytest.raises(CorruptCheckpointError) as e:
        verify(root)
    assert str(shard) in str(e.value) and f"step {newest}" in str(e.value)
    flipped = bytearray(raw)
    flipped[len(raw) // 2] ^= 0x01  # one bit flipped inside the data
    shard.write_bytes(bytes(flipped))
    with pytest.raises(CorruptCheckpointError) as e:
        with open_checkpoint(root) as r:
            for name in SHAPES:
                r.read(name)
    message = str(e.value)
    assert str(shard) in message and f"step {newest}" in message and "checksum mismatch" in message
    # The user picks the older checkpoint (--resume-from): it is intact.
    with open_checkpoint(root, older) as r:
        for name in SHAPES:
            assert torch.equal(r.read(name), expected(name, older))
