"""Small costs of the tiny step, each against its baseline side by side in one process:
softmax_cpu against torch's softmax (compat patch 14), the reward pool's one-chunk call against its
spread over every worker, a step's TensorBoard scalars as one event against one per key, and the
reference engine's per-batch costs: its answers encoded and decoded by orjson against json, and
its requests' uniforms from one reseeded generator against a new generator per request; and a
step's record logged to W&B (offline) against the same record as one TensorBoard event.

    .venv/bin/python benchmarks/small_kernels.py [--reps 200] [--results benchmarks/RESULTS.md]

Softmax: forward + backward of `hpcrl.trainer.softmax_cpu.softmax_lastdim` and of `torch.softmax`
on the same tensors, alternating per repetition, one torch thread; the median of each, and whether
the values and gradients are equal bit for bit.

Reward pool: one `RewardPool("token_match", 2 workers)` scoring the tiny example's batch (64
completions), alternating per call between the pool's own choice (one chunk for one worker, since
the measured cost is far under SPREAD_MIN_S), the spread it made before (CHUNKS_PER_WORKER chunks
per worker) and `InlineRewards`, which scores the built-in in this process (what a run uses for
token_match now); each call after a 30 ms idle (as in a run: the controller scores after the
engines' generation) and back to back.

TensorBoard: the tiny example's 22 numeric metrics of a step, written by `MetricsLogger`'s
`FileWriter.add_summary(tensorboard_summary(...))` (one event) and by `SummaryWriter.add_scalar` per
key (what MetricsLogger did before), alternating per step, each after a 30 ms idle.

Engine: 64 answers in the shape `/generate` returns for the tiny example (4 output ids with their
log-probs each), encoded as the server did (json's C encoder, compact) and does (orjson), and
decoded as the client did (json.loads) and does (orjson.loads); the uniforms of 64 seeded requests
of 4 tokens drawn as `ReferenceModel` did (a new torch.Generator per request) and does (one
generator reseeded), with whether the values are identical. Alternating per call, back to back.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from results_md import append_to_section, run_heading

SHAPES = ((64, 4, 12, 12), (64, 4, 7, 7), (3072, 4), (64, 4, 16, 16))


def _softmax_rows(reps: int) -> list[str]:
    from hpcrl.trainer.softmax_cpu import fast_path, softmax_lastdim

    rows = []
    for shape in SHAPES:
        g = torch.Generator().manual_seed(0)
        x, grad = torch.randn(*shape, generator=g) * 4, torch.randn(*shape, generator=g)
        results, times = {}, {"torch": [], "softmax_cpu": []}
        for rep in range(reps + 10):
            for name, fn in (("torch", lambda t: torch.softmax(t, -1)), ("softmax_cpu", softmax_lastdim)):
                leaf = x.clone().requires_grad_()
                t0 = time.perf_counter()
                y = fn(leaf)
                y.backward(grad)
                if rep >= 10:
                    times[name].append(time.perf_counter() - t0)
                results[name] = (y.detach(), leaf.grad)
        same = all(torch.equal(a, b) for a, b in zip(results["torch"], results["softmax_cpu"]))
        base, new = (statistics.median(times[k]) * 1e6 for k in ("torch", "softmax_cpu"))
        path = "fast path" if fast_path(x) else "torch's (not taken)"
        rows.append(f"| {list(shape)} | {path} | {base:.0f} | {new:.0f} | {base / new:.2f}x | "
                    f"{'yes' if same else 'NO'} |")
    return rows


def _pool_rows(calls: int) -> list[str]:
    from hpcrl.rewards import pool as pool_mod

    items = [("c", "cccc", "cccc", {}) for _ in range(64)]
    rows = []
    with pool_mod.RewardPool("token_match", num_workers=2, timeout_s=10.0) as pool:
        for _ in range(20):  # both workers up, the cost measured
            pool.score(items)
            time.sleep(0.05)
        own = pool._chunks
        spread = lambda n: pool_mod.CHUNKS_PER_WORKER * len(pool._slots)  # noqa: E731
        inline = pool_mod.InlineRewards("token_match")
        for idle in (0.03, 0.0):
            times: dict[str, list[float]] = {"spread": [], "one chunk": [], "inline": []}
            for i in range(3 * calls):
                name = ("spread", "one chunk", "inline")[i % 3]
                pool._chunks = spread if name == "spread" else own
                time.sleep(idle)
                t0 = time.perf_counter()
                (inline if name == "inline" else pool).score(items)
                times[name].append(time.perf_counter() - t0)
            base, new, here = (statistics.median(times[k]) * 1e3 for k in ("spread", "one chunk", "inline"))
            rows.append(f"| {'after a 30 ms idle' if idle else 'back to back'} | {base:.2f} | {new:.2f} | "
                        f"{base / new:.2f}x | {here:.3f} |")
        pool._chunks = own
    return rows


def _tensorboard_rows(steps: int) -> list[str]:
    import tempfile

    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.writer import FileWriter

    from hpcrl.controller.metrics import tensorboard_summary

    metrics = {f"group/metric{i}": 0.5 + i for i in range(22)}
    times: dict[str, list[float]] = {"add_scalar per key": [], "one event": []}
    with tempfile.TemporaryDirectory() as tmp:
        per_key, one = SummaryWriter(log_dir=f"{tmp}/a"), FileWriter(f"{tmp}/b")
        for step in range(2 * steps):
            name = "one event" if step % 2 else "add_scalar per key"
            time.sleep(0.03)
            t0 = time.perf_counter()
            if step % 2:
                one.add_summary(tensorboard_summary(metrics), step)
            else:
                for key, value in metrics.items():
                    per_key.add_scalar(key, value, step)
            times[name].append(time.perf_counter() - t0)
        per_key.close()
        one.close()
    base, new = (statistics.median(times[k]) * 1e3 for k in ("add_scalar per key", "one event"))
    return [f"| 22 scalars, after a 30 ms idle | {base:.3f} | {new:.3f} | {base / new:.1f}x |"]


def _wandb_rows(steps: int) -> list[str]:
    """A step's record logged to W&B (logging.wandb_project; offline, its service writing the run
    file) against the same record as one TensorBoard event, alternating per step after a 30 ms idle:
    what W&B adds to the controller's critical path."""
    import importlib.util
    import tempfile

    from torch.utils.tensorboard.writer import FileWriter

    from hpcrl.controller.metrics import tensorboard_summary

    if importlib.util.find_spec("wandb") is None:
        return ["| (wandb is not installed: `bash install.sh --wandb`) | | | |"]
    from hpcrl.controller.wandb_log import WandbLog

    metrics = {f"group/metric{i}": 0.5 + i for i in range(22)}
    times: dict[str, list[float]] = {"TensorBoard event": [], "W&B row": []}
    with tempfile.TemporaryDirectory() as tmp:
        for key in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
            os.environ[key] = f"{tmp}/{key.lower()}"
        os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true")
        tb, wb = FileWriter(f"{tmp}/tb"), WandbLog("bench", None, Path(tmp), {}, -1, [])
        for step in range(2 * steps):
            name = "W&B row" if step % 2 else "TensorBoard event"
            time.sleep(0.03)
            t0 = time.perf_counter()
            if step % 2:
                wb.log(step, metrics)
            else:
                tb.add_summary(tensorboard_summary(metrics), step)
            times[name].append(time.perf_counter() - t0)
        tb.close()
        wb.close()
    base, new = (statistics.median(times[k]) * 1e3 for k in ("TensorBoard event", "W&B row"))
    return [f"| 22 metrics, after a 30 ms idle | {base:.3f} | {new:.3f} | {new / base:.1f}x |"]


def _engine_rows(calls: int) -> list[str]:
    import json

    import orjson

    g = torch.Generator().manual_seed(0)
    ids_B4 = torch.randint(3, 60, (64, 4), generator=g).tolist()
    logprobs_B4 = (-torch.rand(64, 4, generator=g) * 4).tolist()
    answers = [{"text": "abc", "output_ids": ids, "meta_info": {
        "id": f"{i:032x}", "finish_reason": {"type": "stop", "matched": 2}, "prompt_tokens": 2,
        "completion_tokens": 4, "cached_tokens": 0, "weight_version": "3", "e2e_latency": 0.0123456789,
        "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids)]}}
        for i, (ids, lps) in enumerate(zip(ids_B4, logprobs_B4))]
    encoder = json.JSONEncoder(check_circular=False, separators=(",", ":"))
    body = orjson.dumps(answers)
    seeds = torch.randint(0, 1 << 62, (64,), generator=g).tolist()

    def each_new() -> torch.Tensor:
        u = torch.zeros(64, 4)
        for b, seed in enumerate(seeds):
            u[b, :4] = torch.rand(4, generator=torch.Generator().manual_seed(seed))
        return u

    reseeded = torch.Generator()

    def one_reseeded() -> torch.Tensor:
        u = torch.zeros(64, 4)
        for b, seed in enumerate(seeds):
            torch.rand(4, generator=reseeded.manual_seed(seed), out=u[b, :4])
        return u

    cases = (("64 answers encoded", lambda: encoder.encode(answers).encode(), lambda: orjson.dumps(answers),
              json.loads(encoder.encode(answers)) == orjson.loads(orjson.dumps(answers))),
             ("64 answers decoded", lambda: json.loads(body), lambda: orjson.loads(body),
              json.loads(body) == orjson.loads(body)),
             ("uniforms of 64 requests", each_new, one_reseeded, torch.equal(each_new(), one_reseeded())))
    rows = []
    for name, before, now, same in cases:
        times: dict[str, list[float]] = {"before": [], "now": []}
        for i in range(2 * calls):
            key, fn = ("now", now) if i % 2 else ("before", before)
            t0 = time.perf_counter()
            fn()
            times[key].append(time.perf_counter() - t0)
        base, new = (statistics.median(times[k]) * 1e3 for k in ("before", "now"))
        rows.append(f"| {name} | {base:.3f} | {new:.3f} | {base / new:.1f}x | {'yes' if same else 'NO'} |")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=200,
                    help="softmax repetitions; reward-pool calls per mode are a quarter of it")
    ap.add_argument("--results", type=Path, help="append the tables under '## small_kernels' here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    softmax = _softmax_rows(args.reps)
    pool = _pool_rows(max(args.reps // 4, 10))
    tensorboard = _tensorboard_rows(max(args.reps // 2, 10))
    wandb = _wandb_rows(max(args.reps // 2, 10))
    engine = _engine_rows(args.reps)
    text = "\n".join([
        run_heading(f".venv/bin/python benchmarks/small_kernels.py --reps {args.reps}"), "",
        f"{os.cpu_count()} CPUs, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"load average (1 min) {load0:.1f} before, {os.getloadavg()[0]:.1f} after.", "",
        "Softmax over the last dim, forward + backward (median us):", "",
        "| shape | path | torch | softmax_cpu | speed-up | bit-identical |", "|---|---|---|---|---|---|",
        *softmax, "",
        "Reward pool, 64 token_match completions, 2 workers (median ms per call):", "",
        "| calls | spread (4 chunks) | one chunk | speed-up | in the controller (InlineRewards, what "
        "token_match uses now) |", "|---|---|---|---|---|", *pool, "",
        "A step's TensorBoard scalars (median ms per step):", "",
        "| write | add_scalar per key | one event | speed-up |", "|---|---|---|---|", *tensorboard, "",
        "A step's record to W&B (offline; WandbLog.log: the row and RUN_DIR/.wandb.json) against the same "
        "as one TensorBoard event (median ms per step):", "",
        "| write | TensorBoard event | W&B row | W&B / TensorBoard |", "|---|---|---|---|", *wandb, "",
        "Reference engine, per generate call of the tiny step (median ms; before: json / a new generator "
        "per request, now: orjson / one reseeded generator):", "",
        "| cost | before | now | speed-up | same result |", "|---|---|---|---|---|", *engine, ""])
    print(text)
    if args.results:
        append_to_section(args.results, "## small_kernels", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
