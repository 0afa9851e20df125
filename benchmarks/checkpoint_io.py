"""Checkpoint I/O benchmark: checkpoints/ save and load throughput vs raw sequential file I/O.

Builds a sharded state of `--size-gb` (default 1.0) over `--ranks` simulated writer ranks (fp32
weights and Adam moments, bf16 weights; each rank holds a row slice of every tensor), then in each
of `--repeats` rounds measures, on the same disk and the same bytes:

    raw write   one file per rank, sequential os.write of every tensor, fsync
    ckpt save   CheckpointWriter per rank (HDF5 shard, crc32, fsync, rename, marker), rank 0 commits
    raw read    the raw files back into preallocated buffers, page cache dropped first
    ckpt load   open_checkpoint + read every tensor whole (checksums verified), cache dropped first
    resharded   the same load by 2 loader ranks splitting every tensor along axis 0
    async save  how long write()+commit() block the caller with async_save=True, next to the time
                of just copying the same tensors to host memory; then the time until wait() returns

The page cache is dropped per file with posix_fadvise(DONTNEED) after fsync, so reads hit the
disk without needing root. Files go under --dir (default a fresh directory in /tmp) and are
removed at the end. `--results FILE` replaces the `## checkpoint_io` section of FILE (creating it).

    .venv/bin/python benchmarks/checkpoint_io.py --size-gb 1.0 --repeats 3 --results benchmarks/RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from checkpoints import CheckpointWriter, open_checkpoint  # noqa: E402
from checkpoints._dtypes import to_storage  # noqa: E402
from moe.slices import Box  # noqa: E402
from results_md import replace_section  # noqa: E402

HEADING = "## checkpoint_io"


def build_state(size_gb: float, ranks: int) -> dict[str, torch.Tensor]:
    """Global tensors of about size_gb GB in total, rows divisible by `ranks`."""
    g = torch.Generator().manual_seed(0)
    rows, cols = 2048, 4096  # 32 MiB fp32, 16 MiB bf16 per tensor
    state: dict[str, torch.Tensor] = {}
    total, i = 0, 0
    while total < size_gb * 1e9:
        for kind, dtype in (("w", torch.bfloat16), ("exp_avg", torch.float32), ("exp_avg_sq", torch.float32)):
            t = torch.rand(rows, cols, generator=g).to(dtype)
            state[f"layer{i}.{kind}"] = t
            total += t.numel() * t.element_size()
        i += 1
    assert all(t.shape[0] % ranks == 0 for t in state.values())
    return state


def rank_slices(state: dict[str, torch.Tensor], ranks: int) -> list[list[tuple[str, torch.Tensor, Box]]]:
    out = []
    for r in range(ranks):
        part = []
        for name, t in state.items():
            box = Box.full(tuple(t.shape)).split(0, ranks, r)
            part.append((name, t[box.relative_to(Box.full(tuple(t.shape)))], box))
        out.append(part)
    return out


def drop_cache(paths: list[Path]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def raw_write(d: Path, parts: list) -> tuple[float, list[Path]]:
    d.mkdir(parents=True)
    paths = []
    t0 = time.perf_counter()
    for r, part in enumerate(parts):
        p = d / f"rank{r}.bin"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            for _, t, _ in part:
                mv = memoryview(to_storage(t)).cast("B")
                while mv:
                    mv = mv[os.write(fd, mv):]
            os.fsync(fd)
        finally:
            os.close(fd)
        paths.append(p)
    return time.perf_counter() - t0, paths


def raw_read(paths: list[Path], parts: list) -> float:
    bufs = [[np.empty(t.shape, dtype=to_storage(t[:1]).dtype) for _, t, _ in part] for part in parts]
    t0 = time.perf_counter()
    for p, part_bufs in zip(paths, bufs):
        with open(p, "rb", buffering=0) as f:
            for b in part_bufs:
                f.readinto(memoryview(b).cast("B"))
    return time.perf_counter() - t0


def ckpt_save(root: Path, step: int, parts: list, async_save: bool = False) -> tuple[float, float]:
    """(seconds until everything is committed, seconds the callers were blocked in total).

    Every simulated rank first writes all its tensors, then the ranks commit (rank 0 last, so its
    commit finds the other markers): in async mode a rank's background write does not overlap
    another simulated rank's snapshot, as it would not across real processes.
    """
    ranks = len(parts)
    t0 = time.perf_counter()
    writers = {}
    for r in range(ranks):
        w = CheckpointWriter(root, step, rank=r, world_size=ranks, attempt_id=f"bench{step}",
                             async_save=async_save, commit_timeout_s=600)
        for name, t, box in parts[r]:
            w.write(name, t, box, (t.shape[0] * ranks,) + tuple(t.shape[1:]))
        writers[r] = w
    for r in list(range(1, ranks)) + [0]:
        writers[r].commit({"step": step} if r == 0 else None)
    results = [writers[r].wait() for r in range(ranks)]
    assert results[0].committed
    return time.perf_counter() - t0, sum(x.blocked_s for x in results)


def ckpt_load(root: Path, step: int, state: dict[str, torch.Tensor], loaders: int) -> float:
    files = sorted((root / f"step_{step:06d}").glob("*.h5"))
    drop_cache(files)
    t0 = time.perf_counter()
    for lr in range(loaders):
        with open_checkpoint(root, step) as reader:
            for name, t in state.items():
                reader.read(name, Box.full(tuple(t.shape)).split(0, loaders, lr))
    return time.perf_counter() - t0


def copy_to_host(parts: list) -> float:
    t0 = time.perf_counter()
    copies = [[torch.empty_like(t).copy_(t) for _, t, _ in part] for part in parts]
    dt = time.perf_counter() - t0
    del copies
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=1.0)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=None, help="scratch parent directory (default /tmp)")
    ap.add_argument("--results", type=Path, default=None,
                    help="markdown file whose ## checkpoint_io section to replace")
    args = ap.parse_args()
    if args.size_gb <= 0 or args.ranks < 1 or args.repeats < 1:
        ap.error("--size-gb must be > 0, --ranks and --repeats >= 1")
    torch.set_num_threads(1)
    state = build_state(args.size_gb, args.ranks)
    parts = rank_slices(state, args.ranks)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    scratch = Path(tempfile.mkdtemp(prefix="hpcrl_ckpt_bench_", dir=args.dir))
    args.scratch_fs = f"{scratch.parent} ({shutil.disk_usage(scratch).total / 1e9:.0f} GB volume)"
    rows: list[dict[str, float]] = []
    args.load_start = os.getloadavg()[0]
    try:
        for rep in range(args.repeats):
            raw_dir, ck_root = scratch / f"raw{rep}", scratch / "ckpt"
            m: dict[str, float] = {}
            # Alternate which of raw and checkpoint goes first: the shared disk drifts.
            raw_first = rep % 2 == 0
            if raw_first:
                m["raw_write"], paths = raw_write(raw_dir, parts)
            m["ckpt_save"], m["save_blocked"] = ckpt_save(ck_root, 2 * rep, parts)
            if not raw_first:
                m["raw_write"], paths = raw_write(raw_dir, parts)
            if raw_first:
                drop_cache(paths)
                m["raw_read"] = raw_read(paths, parts)
            m["ckpt_load"] = ckpt_load(ck_root, 2 * rep, state, 1)
            if not raw_first:
                drop_cache(paths)
                m["raw_read"] = raw_read(paths, parts)
            m["ckpt_load_2"] = ckpt_load(ck_root, 2 * rep, state, 2)
            m["copy_to_host"] = copy_to_host(parts)
            m["async_total"], m["async_blocked"] = ckpt_save(ck_root, 2 * rep + 1, parts, async_save=True)
            shutil.rmtree(raw_dir)
            for step_dir in ck_root.glob("step_*"):
                shutil.rmtree(step_dir)
            rows.append(m)
            gb = nbytes / 1e9
            print(f"round {rep}: raw write {gb / m['raw_write']:.3f} GB/s, save {gb / m['ckpt_save']:.3f} "
                  f"GB/s ({m['raw_write'] / m['ckpt_save']:.2f} of raw); raw read {gb / m['raw_read']:.3f} "
                  f"GB/s, load {gb / m['ckpt_load']:.3f} GB/s ({m['raw_read'] / m['ckpt_load']:.2f} of raw), "
                  f"2-rank load {gb / m['ckpt_load_2']:.3f} GB/s; async blocked {m['async_blocked']:.3f} s "
                  f"vs host copy {m['copy_to_host']:.3f} s, async total {m['async_total']:.2f} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report = render(rows, nbytes, args)
    print(f"{HEADING}\n\n{report}")
    if args.results is not None:
        replace_section(args.results, HEADING, report)


def render(rows: list[dict[str, float]], nbytes: int, args: argparse.Namespace) -> str:
    gb = nbytes / 1e9

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    def ratio(a: str, b: str) -> str:
        vals = [r[a] / r[b] for r in rows]
        return f"{statistics.median(vals):.2f} (rounds: {', '.join(f'{v:.2f}' for v in vals)})"

    cmd = (f".venv/bin/python benchmarks/checkpoint_io.py --size-gb {args.size_gb} --ranks {args.ranks} "
           f"--repeats {args.repeats}" + (f" --results {args.results}" if args.results else ""))
    return "\n".join([
        f"`{cmd}`  ",
        f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs shared with other jobs (load average "
        f"{args.load_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end), "
        f"torch {torch.__version__}, scratch dir {args.scratch_fs}. "
        f"State: {gb:.2f} GB (bf16 weights + fp32 Adam moments, {args.ranks} rank shards); medians of "
        f"{len(rows)} rounds; page cache dropped (posix_fadvise) before every read.",
        "",
        "Times and GB/s are medians over rounds; \"vs raw\" is the median of the per-round ratios (raw and "
        "checkpoint measured back to back, order alternating), which is steadier than a ratio of medians "
        "on this shared VM, where a round's throughput can vary 3x.",
        "",
        "| measure | time (s) | GB/s | vs raw, median of rounds (>= 0.7 is the goal) |",
        "|---|---|---|---|",
        f"| raw sequential write + fsync | {med('raw_write'):.2f} | {gb / med('raw_write'):.3f} | 1 |",
        f"| checkpoint save (HDF5 shards, crc32, fsync, rename, manifest) | {med('ckpt_save'):.2f} | "
        f"{gb / med('ckpt_save'):.3f} | {ratio('raw_write', 'ckpt_save')} |",
        f"| raw sequential read (cold) | {med('raw_read'):.2f} | {gb / med('raw_read'):.3f} | 1 |",
        f"| checkpoint load, same layout, checksums verified (cold) | {med('ckpt_load'):.2f} | "
        f"{gb / med('ckpt_load'):.3f} | {ratio('raw_read', 'ckpt_load')} |",
        f"| checkpoint load resharded to 2 ranks (axis-0 split), verified (cold) | "
        f"{med('ckpt_load_2'):.2f} | {gb / med('ckpt_load_2'):.3f} | {ratio('raw_read', 'ckpt_load_2')} |",
        "",
        "| async save | time (s) |",
        "|---|---|",
        f"| copy of the state to host memory (the goal's bound) | {med('copy_to_host'):.3f} |",
        f"| caller blocked by write() + commit() with async_save=True | {med('async_blocked'):.3f} "
        f"(blocked / copy: {ratio('async_blocked', 'copy_to_host')}) |",
        f"| until wait() returns (background write + commit; the {args.ranks} simulated ranks' threads "
        f"write concurrently to one disk) | {med('async_total'):.2f} |",
        f"| caller blocked by a sync save | {med('save_blocked'):.2f} |",
        "",
    ])


if __name__ == "__main__":
    main()
