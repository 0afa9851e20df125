"""checkpoints/ under real MPI: 4 ranks save TP/EP-sharded state, then 2 ranks and 1 rank load it.

The 4 writer ranks (TP=2 x EP=2, Megatron-style: column- and row-parallel weights, experts split
over EP and ETP, replicated norms, Adam moments, an int64 step, per-rank RNG blobs) agree on an
attempt id with one MPI broadcast at start-up and then commit with no collective. The loaders use
other layouts (2 ranks splitting along other axes; 1 rank reading everything) and compare every
element bit for bit with the same deterministically generated global tensors, and check that each
loader rank opened only the shard files overlapping its slices. Run as a script, this file is the
MPI program: `mpiexec -n N python test_checkpoint_mpi.py save|load2|load1 DIR`.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

MPIEXEC = Path(sys.executable).parent / "mpiexec"
pytestmark = [pytest.mark.mpi, pytest.mark.timeout(300)]

# name -> (global shape, dtype name, how the 4 writer ranks (tp, ep) = (r % 2, r // 2) hold it)
TENSORS = {
    "embedding.weight": ((96, 40), "bfloat16", "tp0"),  # vocab-parallel rows, replicated over EP
    "attn.qkv.weight": ((64, 40), "float32", "tp0"),  # column-parallel
    "attn.proj.weight": ((40, 32), "float32", "tp1"),  # row-parallel
    "norm.weight": ((40,), "float32", "replicated"),
    "experts.fc1.weight": ((8, 24, 40), "bfloat16", "ep0_tp1"),  # experts over EP, ETP on axis 1
    "optim.exp_avg.experts.fc1.weight": ((8, 24, 40), "float32", "ep0_tp1"),
    "optim.exp_avg_sq.experts.fc1.weight": ((8, 24, 40), "float32", "ep0_tp1"),
    "optim.exp_avg.attn.qkv.weight": ((64, 40), "float32", "tp0_dp0"),  # only EP-rank 0 writes it
    "optim.step": ((), "int64", "rank0"),
}


def global_tensor(name: str):
    import torch

    shape, dtype, _ = TENSORS[name]
    g = torch.Generator().manual_seed(sorted(TENSORS).index(name) + 1)
    if dtype == "int64":
        return torch.randint(0, 2**40, shape, generator=g)
    return torch.randn(shape, generator=g).to(getattr(torch, dtype))


def writer_boxes(name: str, rank: int) -> list:
    from moe.slices import Box

    shape, _, how = TENSORS[name]
    tp, ep = rank % 2, rank // 2
    full = Box.full(shape)
    if how == "tp0":
        return [full.split(0, 2, tp)]
    if how == "tp1":
        return [full.split(1, 2, tp)]
    if how == "replicated":
        return [full]
    if how == "ep0_tp1":
        return [full.split(0, 2, ep).split(1, 2, tp)]
    if how == "tp0_dp0":
        return [full.split(0, 2, tp)] if ep == 0 else []
    return [full] if rank == 0 else []


def save(root: str) -> dict:
    import uuid

    from mpi4py import MPI

    from checkpoints import CheckpointWriter
    from moe.slices import Box

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    attempt = comm.bcast(uuid.uuid4().hex if rank == 0 else None, root=0)  # once per run attempt
    import torch

    torch.manual_seed(100 + rank)
    w = CheckpointWriter(root, 42, rank=rank, world_size=world, attempt_id=attempt,
                         async_save=rank % 2 == 1, commit_timeout_s=60, block_bytes=1024)
    written = 0
    for name in TENSORS:
        g = global_tensor(name)
        for box in writer_boxes(name, rank):
            w.write(name, g[box.relative_to(Box.full(tuple(g.shape)))].clone(), box, tuple(g.shape))
            written += 1
    w.write_blob("rng.torch_cpu", torch.get_rng_state().numpy().tobytes())
    meta = {"step": 42, "layout": {"tp": 2, "ep": 2, "world": world}, "sampler": {"epoch": 1, "index": 77}}
    w.commit(meta if rank == 0 else None)
    res = w.wait(60, for_commit=True)
    assert res.committed
    return {"rank": rank, "slices": written, "nbytes": res.nbytes}


def load(root: str) -> dict:
    import torch
    from mpi4py import MPI

    from checkpoints import open_checkpoint, verify
    from moe.slices import Box

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    reader = open_checkpoint(root)
    assert reader.step == 42 and reader.metadata["sampler"] == {"epoch": 1, "index": 77}
    checked = 0
    for name in TENSORS:
        g = global_tensor(name)
        full = Box.full(tuple(g.shape))
        # The new layout splits the last axis over the loader ranks (the writers split axis 0
        # or 1), so every loader slice straddles several stored slices.
        box = full if world == 1 or not g.dim() else full.split(g.dim() - 1, world, rank)
        got = reader.read(name, box)
        want = g[box.relative_to(full)]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8),
                           want.contiguous().reshape(-1).view(torch.uint8)), name
        checked += got.numel()
    opened_for_tensors = sorted(reader._files)
    # Experts only: loader rank r of 2 takes experts [4r, 4r+4) = writer EP rank r = writer
    # ranks {2r, 2r+1}, and must open nothing else.
    expert_reader = open_checkpoint(root)
    name = "experts.fc1.weight"
    g = global_tensor(name)
    box = Box.full(tuple(g.shape)).split(0, world, rank)
    assert torch.equal(expert_reader.read(name, box).view(torch.uint16),
                       g[box.relative_to(Box.full(tuple(g.shape)))].view(torch.uint16))
    expert_files = sorted(expert_reader._files)
    if world == 2:
        assert expert_files == [f"rank{2 * rank:05d}.h5", f"rank{2 * rank + 1:05d}.h5"], expert_files
    blobs = [len(reader.blob("rng.torch_cpu", k)) for k in reader.blob_ranks("rng.torch_cpu")]
    assert len(blobs) == 4 and all(n > 0 for n in blobs)
    assert torch.equal(torch.frombuffer(bytearray(reader.blob("rng.torch_cpu", 3)), dtype=torch.uint8),
                       torch.manual_seed(103).get_state())
    report = verify(root) if rank == 0 else None
    return {"rank": rank, "elements": checked, "files": opened_for_tensors, "expert_files": expert_files,
            "verified_bytes": report.nbytes if report else None}


def _mpirun(n: int, mode: str, root: Path, timeout_s: float = 150) -> list[dict]:
    # -disable-auto-cleanup: else hydra SIGKILLs ranks still running once one exits (dev/LOG.md, session 13)
    cmd = [str(MPIEXEC), "-launcher", "fork", "-disable-auto-cleanup", "-n", str(n), sys.executable, __file__,
           mode, str(root)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the session this test started: mpiexec and its ranks
        out, _ = proc.communicate(timeout=10)
        pytest.fail(f"mpiexec -n {n} {mode} timed out after {timeout_s} s:\n{out[-4000:]}")
    assert proc.returncode == 0, f"mpiexec -n {n} {mode} failed (rc {proc.returncode}):\n{out[-6000:]}"
    reports = [json.loads(p.read_text()) for p in sorted(root.parent.glob(f"report.{mode}.*.json"))]
    assert sorted(r["rank"] for r in reports) == list(range(n)), out[-4000:]
    return sorted(reports, key=lambda r: r["rank"])


@pytest.mark.skipif(not MPIEXEC.exists(), reason=f"no mpiexec next to {sys.executable} (pip install mpich)")
def test_save_on_4_ranks_load_on_2_and_1(tmp_path):
    root = tmp_path / "ckpt"
    saved = _mpirun(4, "save", root)
    assert [r["slices"] for r in saved] == [9, 8, 7, 7]  # 7 each + exp_avg.qkv on EP rank 0 + step
    assert sorted(p.name for p in (root / "step_000042").iterdir()) == [
        "manifest.json", "rank00000.h5", "rank00001.h5", "rank00002.h5", "rank00003.h5"]
    assert (root / "latest").read_text() == "42\n"
    two = _mpirun(2, "load2", root)
    total = sum(math.prod(s) for s, _, _ in TENSORS.values())
    assert sum(r["elements"] for r in two) == total + 1  # both loader ranks read the 0-d step
    assert [r["expert_files"] for r in two] == [["rank00000.h5", "rank00001.h5"],
                                                ["rank00002.h5", "rank00003.h5"]]
    one = _mpirun(1, "load1", root)
    assert one[0]["elements"] == total and one[0]["verified_bytes"] > 0
    assert one[0]["files"] == ["rank00000.h5", "rank00001.h5", "rank00002.h5", "rank00003.h5"]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    mode, directory = sys.argv[1], sys.argv[2]
    result = save(directory) if mode == "save" else load(directory)
    # One file per rank: the ranks' stdout lines interleave.
    Path(directory).parent.joinpath(f"report.{mode}.{result['rank']}.json").write_text(json.dumps(result))
