"""CPU benchmark of the resharding runtime: 8+ processes on gloo move a >= 200 MB MoE model.

`python benchmarks/reshard_cpu.py [--procs 8] [--reps 5] [--shape S] [--results benchmarks/RESULTS.md]`
starts `mpiexec -n PROCS` (half trainer ranks, half rollout ranks) on a Qwen3-MoE spec of a few
hundred MB of bf16 weights, trainer TP2 x EP2 x DP2 -> one rollout engine TP4 x EP4. `--shape`
picks the tensors (SHAPES): "small-tensors" (294 MB, 1 MiB expert tensors, the shape of every run
before 2026-12-01) or "qwen3-30b-a3b" (512 MB with Qwen3-30B-A3B's own tensor shapes, 3 MiB expert
tensors; the real models' experts are 3-28 MiB). Per-message costs weigh more with small tensors.
It times, in alternating order per repetition:
  * planned   -- `moe.runtime.reshard` (plan rounds, bucketed point-to-point), with its default
                 checksums (a rotating 1/32 sample of every message), with checksums over every
                 byte (`verify="full"`), and without (`verify="off"`);
  * messages  -- the planned runtime's own messages (same rounds, same buffers) sent bare: no
                 packing, unpacking or checksums; separates transport cost from runtime work;
  * all_to_all -- a raw `all_to_all_single` of exactly the plan's bytes per (sender, receiver) pair,
                 pre-packed buffers: the transport's bound for the same traffic;
  * gather+bcast -- the naive baseline: every trainer rank sends its unique pieces to trainer
                 rank 0, which broadcasts the whole model to the rollout ranks (64 MB chunks);
  * broadcast_sync -- moe.runtime's broadcast of full HF tensors from disjoint sources inside one
                 torch world (the SGLang-style path; the one hpcrl drives over SGLang's HTTP routes is
                 benchmarks/broadcast_sync.py).
`--colocated` plans for trainer and rollout ranks sharing nodes, which is what this one host is
(no on-node relays, fewer rounds); the default plans for two nodes, as a cluster would have them.
Every method runs once untimed first (before 2026-12-01 02:40 UTC only the planned runtime did, and
all_to_all's first timed repetition took about twice its later ones). Each time is the slowest
rank's (barrier, run, max over ranks); reported values are medians over repetitions, and the
median of the per-repetition ratios is given too; GB/s = plan bytes / time; CPU s = process time
summed over ranks. Barrier and
reductions go over gloo, which blocks while it waits: MPICH busy-polls, so with MPI a rank that
finished early took CPU from the ranks still working (8 ranks share 2 cores here), which slowed
every method and most those whose ranks finish unevenly (results before 2026-11-30 18:50 UTC).
The results table (with the load average) is appended under `## reshard_cpu` in the results file.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from results_md import append_to_section

REPO = Path(__file__).resolve().parent.parent
CHUNK_BYTES = 64 << 20


DEFAULT_SHAPE = "small-tensors"  # the shape of every run before --shape existed
SHAPES = {
    "small-tensors": "Qwen3-MoE shaped like the tiny preset scaled up: hidden 1024, 1 MiB experts, "
                     "4 layers x 16 experts, vocab 16384 (294 MB)",
    "qwen3-30b-a3b": "Qwen3-30B-A3B's own tensor shapes (hidden 2048, 32 / 4 heads, 3 MiB experts) "
                     "with 2 layers x 16 experts and vocab 16384 (512 MB)",
}


def bench_spec(shape: str = DEFAULT_SHAPE):
    """The benchmark's model (SHAPES): Qwen3-MoE at a few hundred MB of bf16 weights, 16 experts."""
    from moe.specs import spec_from_config
    from moe.specs._types import CONFIG_DIR, HPCRL_CONFIG_DIR, load_config

    if shape == "qwen3-30b-a3b":
        cfg = load_config(CONFIG_DIR / "qwen3-30b-a3b.json")
        cfg.update(num_hidden_layers=2, num_experts=16, vocab_size=16384, dtype="bfloat16")
        return spec_from_config(cfg, "bench-qwen3-30b-a3b-2l")
    cfg = load_config(HPCRL_CONFIG_DIR / "tiny-qwen3-moe.json")
    cfg.update(hidden_size=1024, num_hidden_layers=4, num_experts=16, moe_intermediate_size=512,
               intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=128,
               vocab_size=16384, dtype="bfloat16")
    return spec_from_config(cfg, "bench-294MB")


def _layouts(procs: int):
    from moe.layouts import RolloutLayout, TrainerLayout

    half = procs // 2
    return TrainerLayout(tp=2, ep=2, dp=half // 2), RolloutLayout(num_engines=1, tp=half, ep=half)


def worker(reps: int, budget_bytes: int, colocated: bool = False, shape: str = DEFAULT_SHAPE) -> None:
    """The MPI program: every rank runs every method `reps` times; rank 0 prints a JSON summary."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed
    from moe.network import Topology
    from moe.plan import plan
    from moe.runtime import Staging, allocate_shards, broadcast_groups, broadcast_sync, reshard

    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    g = comm.Get_rank()
    init_torch_distributed(comm, "gloo", timeout_s=600)
    spec = bench_spec(shape)
    src, dst = _layouts(comm.Get_size())
    T, R = src.world_size, dst.world_size
    assert T + R == comm.Get_size()
    p = plan(src, dst, spec, budget_bytes, Topology(colocated=colocated))
    role, rank = ("trainer", g) if g < T else ("rollout", g - T)
    shards = None
    if role == "trainer":
        shards = {}
        for n, box in src.shards(spec, rank):
            t = spec[n]
            gen = torch.Generator().manual_seed(spec.index(n) * 7919 + 1)  # replicas hold equal bytes
            shards[n] = (box, torch.randn(box.shape, generator=gen).to(getattr(torch, t.dtype)))
    # raw all_to_all: the plan's bytes per (global sender, global receiver) pair
    gsrc = np.where(p.from_rollout, p.src_rank + T, p.src_rank)
    pair = np.zeros((T + R, T + R), dtype=np.int64)
    np.add.at(pair, (gsrc, p.dst_rank.astype(np.int64) + T), p.nbytes)
    send_sizes, recv_sizes = pair[g].tolist(), pair[:, g].tolist()
    a2a_in = torch.ones(sum(send_sizes), dtype=torch.uint8)
    a2a_out = torch.empty(sum(recv_sizes), dtype=torch.uint8)
    bcast_group = dist.new_group([0] + list(range(T, T + R)))
    groups = broadcast_groups(p)
    unique = _unique_pieces(src, spec)

    # the rollout engine's weights exist already: it receives into them (no fresh pages per sync)
    out = allocate_shards(spec, dst.shards(spec, rank)) if role == "rollout" else None
    for _, t in (out or {}).values():
        t.zero_()

    staging = Staging()  # bucket memory reused across syncs, as an engine syncing every step would

    def planned():
        reshard(p, role, rank, shards, deadline_s=600.0, out=out, staging=staging)

    def planned_full():
        reshard(p, role, rank, shards, deadline_s=600.0, verify="full", out=out, staging=staging)

    def planned_noverify():
        reshard(p, role, rank, shards, deadline_s=600.0, verify="off", out=out, staging=staging)

    def all_to_all():
        dist.all_to_all_single(a2a_out, a2a_in, recv_sizes, send_sizes)

    def gather_bcast():
        _gather_broadcast(spec, dst, role, rank, g, shards, unique, bcast_group, T)

    def bsync():
        broadcast_sync(p, role, rank, shards, deadline_s=600.0, groups=groups, out=out)

    # The plan's messages alone: the prepared rounds' own buffers (bucket + direct per peer), in the
    # same rounds, sent without packing, unpacking or checksums -- what the transport costs for
    # this message structure, to separate it from the runtime's own work.
    def _bytes(v):  # a direct piece as the flat bytes it travels as (copied once if not contiguous)
        return (v if v.is_contiguous() else v.contiguous()).reshape(-1).view(torch.uint8)

    planned()
    _, _, (_, rounds) = staging.program
    msg_rounds = []
    for _, peers in rounds:
        ops = []
        for q in peers:
            sends = [_bytes(v) for v in q.send_direct] + ([q.send_bucket] if q.pack[0] else [])
            recvs = [_bytes(v) for v in q.recv_direct] + ([q.recv_bucket] if q.unpack[0] else [])
            ops += [dist.P2POp(dist.isend, b, q.plan.peer, None, tag) for tag, b in enumerate(sends)]
            ops += [dist.P2POp(dist.irecv, b, q.plan.peer, None, tag) for tag, b in enumerate(recvs)]
        msg_rounds.append(ops)

    def messages():
        for ops in msg_rounds:
            for w in dist.batch_isend_irecv(ops) if ops else []:
                w.wait()

    methods = {"planned": planned, "planned_full": planned_full, "planned_noverify": planned_noverify,
               "messages": messages,
               "all_to_all": all_to_all,
               "gather_bcast": gather_bcast,
               "broadcast_sync": bsync}
    times: dict[str, list[float]] = {m: [] for m in methods}
    cpu: dict[str, list[float]] = {m: [] for m in methods}
    for m in methods.values():  # warm-up, every method once: connections, allocator, first-call costs
        dist.barrier()
        m()
    for rep in range(reps):
        order = list(methods) if rep % 2 == 0 else list(reversed(methods))
        for m in order:
            # Synchronise and reduce over gloo, whose waits block: MPICH's busy-polling barrier and
            # allreduce would let ranks that finished early take CPU from those still working.
            dist.barrier()
            c0, t0 = time.process_time(), time.perf_counter()
            methods[m]()
            took = torch.tensor([time.perf_counter() - t0, time.process_time() - c0], dtype=torch.float64)
            total = took.clone()
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            dist.all_reduce(total, op=dist.ReduceOp.SUM)
            times[m].append(float(took[0]))
            cpu[m].append(float(total[1]))
    if g == 0:
        print("RESULT " + json.dumps({"times": times, "cpu": cpu, "bytes": int(p.nbytes.sum()), "rounds": p.num_rounds,
                                      "relays": int(p.from_rollout.sum()), "transfers": len(p),
                                      "model_bytes": spec.total_bytes,
                                      "trainer": repr(src), "rollout": repr(dst)}), flush=True)
    comm.Barrier()
    os._exit(0)


def _unique_pieces(src, spec) -> list[tuple[str, object, int]]:
    """(tensor, box, holder): every box of every tensor once, from its first holder."""
    return [(t.name, box, ranks[0]) for t, pl in zip(spec.tensors, src.placement(spec)) for box, ranks in pl]


def _gather_broadcast(spec, dst, role, rank, g, shards, unique, group, T) -> None:
    """Baseline: all unique pieces to trainer rank 0, which broadcasts the whole model in chunks."""
    import torch
    import torch.distributed as dist

    from moe.slices import Box

    offs, off = {}, 0
    for t in spec.tensors:
        offs[t.name] = off
        off += -(-t.nbytes // 8) * 8
    flat = torch.empty(off, dtype=torch.uint8) if (g == 0 or role == "rollout") else None

    def full(name):
        t = spec[name]
        return flat[offs[name]:offs[name] + t.nbytes].view(getattr(torch, t.dtype)).view(t.shape)

    if role == "trainer":
        ops, tmp = [], []
        for name, box, holder in unique:
            if g == 0 and holder == 0:
                full(name)[box.relative_to(Box.full(spec[name].shape))].copy_(
                    shards[name][1][box.relative_to(shards[name][0])])
            elif g == 0:
                buf = torch.empty(box.shape, dtype=getattr(torch, spec[name].dtype))
                tmp.append((name, box, buf))
                ops.append(dist.P2POp(dist.irecv, buf, holder))
            elif holder == rank:
                piece = shards[name][1][box.relative_to(shards[name][0])].contiguous()
                ops.append(dist.P2POp(dist.isend, piece, 0))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for name, box, buf in tmp:
            full(name)[box.relative_to(Box.full(spec[name].shape))].copy_(buf)
    if g == 0 or role == "rollout":
        for lo in range(0, flat.numel(), CHUNK_BYTES):
            dist.broadcast(flat[lo:lo + CHUNK_BYTES], src=0, group=group)
    if role == "rollout":
        for name, box in dst.shards(spec, rank):
            full(name)[box.relative_to(Box.full(spec[name].shape))].clone()


def _load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--procs", type=int, default=8,
                    help="MPI processes (a multiple of 4, >= 8): half trainer, half rollout")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions of every method")
    ap.add_argument("--budget-mib", type=int, default=64, help="plan memory budget per rank and round (MiB)")
    ap.add_argument("--colocated", action="store_true",
                    help="plan with trainer and rollout ranks on the same nodes (true of this one host): "
                         "rollout ranks receive straight from trainer ranks, no relays")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=DEFAULT_SHAPE,
                    help="the model's tensor shapes: " + "; ".join(f"{k}: {v}" for k, v in SHAPES.items()))
    ap.add_argument("--results", type=Path, default=None, help="append a section to this RESULTS.md")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args.reps, args.budget_mib << 20, args.colocated, args.shape)
    if args.procs < 8 or args.procs % 4:
        raise SystemExit(f"--procs={args.procs} must be a multiple of 4 and >= 8 (TP2 x EP2 x DP trainer)")
    load_before = _load()
    mpiexec = Path(sys.executable).parent / "mpiexec"
    cmd = [str(mpiexec), "-n", str(args.procs), sys.executable, __file__, "--worker",
           "--reps", str(args.reps),
           "--budget-mib", str(args.budget_mib), "--shape", args.shape,
           *(["--colocated"] if args.colocated else [])]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(f"benchmark failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                         f"{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len("RESULT "):])
    text = render(res, args, load_before, _load(), time.time() - t0)
    print(text)
    if args.results:
        append_to_section(args.results, "## reshard_cpu", text)


def render(res: dict, args, load_before: str, load_after: str, wall_s: float) -> str:
    nb = res["bytes"]
    med = {m: statistics.median(ts) for m, ts in res["times"].items()}
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    rel = lambda m: " ".join(f"{v:.2f}" for v in res["times"][m])  # noqa: E731
    rows = [
        ("planned runtime (`moe.runtime.reshard`, default sampled checksums)", "planned"),
        ('planned runtime, checksums over every byte (`verify="full"`)', "planned_full"),
        ('planned runtime, checksums off (`verify="off"`)', "planned_noverify"),
        ("the plan's messages alone (no packing, no checksums)", "messages"),
        ("raw gloo `all_to_all_single`, same bytes per pair", "all_to_all"),
        ("gather to trainer rank 0, then broadcast", "gather_bcast"),
        ("`moe.runtime.broadcast_sync` (SGLang-style, one torch world)", "broadcast_sync"),
    ]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=REPO).stdout.strip()
    out = [f"### {now} (commit {commit}): `python benchmarks/reshard_cpu.py --procs {args.procs} "
           f"--reps {args.reps} --budget-mib {args.budget_mib}{' --colocated' if args.colocated else ''}"
           f"{' --shape ' + args.shape if args.shape != DEFAULT_SHAPE else ''}"
           f"{' --results ' + str(args.results) if args.results else ''}`", "",
           f"Host: {platform.node()} ({os.cpu_count()} CPUs, shared), load average (1/5/15 min) "
           f"{load_before} before, {load_after} after; {args.procs} processes on gloo, one torch thread each; total "
           f"{wall_s:.0f} s. Model: {res['model_bytes'] / 1e6:.0f} MB bf16 ({SHAPES[args.shape]}); "
           f"trainer {res['trainer']} -> rollout {res['rollout']}; plan: {res['transfers']} transfers, "
           f"{res['rounds']} rounds at a {args.budget_mib} MiB budget, {res['relays']} relays"
           f"{' (colocated topology)' if args.colocated else ''}, {nb / 1e6:.0f} MB moved. "
           f"Times: slowest rank, median of {args.reps} (all reps in brackets); GB/s = plan bytes / time; "
           f"CPU s = process time summed over all ranks (every thread), median.", "",
           "| method | median s | GB/s | CPU s | reps (s) |", "|---|---|---|---|---|"]
    cpu = {m: statistics.median(ts) for m, ts in res["cpu"].items()}
    for label, m in rows:
        out.append(f"| {label} | {med[m]:.3f} | {nb / med[m] / 1e9:.3f} | {cpu[m]:.3f} | {rel(m)} |")
    ratio_a2a = med["all_to_all"] / med["planned"]
    ratio_gb = med["gather_bcast"] / med["planned"]
    per_rep = [a / b for a, b in zip(res["times"]["all_to_all"], res["times"]["planned"])]
    ratio_nv = med["all_to_all"] / med["planned_noverify"]
    ratio_full = med["all_to_all"] / med["planned_full"]
    out += ["", f"Planned GB/s / all_to_all GB/s: {ratio_a2a:.2f} with the default sampled checksums "
            f"(goal >= 0.8; per rep: {' '.join(f'{x:.2f}' for x in per_rep)}; their median "
            f"{statistics.median(per_rep):.2f}), {ratio_full:.2f} with full "
            f"checksums, {ratio_nv:.2f} without. Planned vs gather+broadcast: "
            f"{ratio_gb:.1f}x faster (goal >= 3x). CPU seconds, all_to_all / planned: "
            f"{cpu['all_to_all'] / cpu['planned']:.2f} sampled, "
            f"{cpu['all_to_all'] / cpu['planned_full']:.2f} full, "
            f"{cpu['all_to_all'] / cpu['planned_noverify']:.2f} off. The plan's messages alone / "
            f"all_to_all: {med['all_to_all'] / med['messages']:.2f} (the transport cost of the plan's "
            f"message structure).", ""]
    return "\n".join(out)


if __name__ == "__main__":
    main()
