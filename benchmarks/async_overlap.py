"""Asynchronous RL (rollout.max_staleness, docs/async.md) against the synchronous loop, side by side
in one run (issue 32): the tiny example with the trainer rank and the engine pinned to cores of their
own (resources.cpu_bind: apart) and fixed-length completions sized so that generating a batch takes
about as long as training on one. Synchronously the two take turns; with max_staleness 1 the engine
samples the next batch while the trainer trains, so a step costs about the longer of the two. (train_s
includes, with k = 1, waiting for the next batch and the sync check's scores: the controller collects
them during the train command, docs/async.md.)

    .venv/bin/python benchmarks/async_overlap.py [--reps 3] [--steps 40] [--max-new-tokens 16]

Per run: steady-state steps/s from the per-step end timestamps in metrics.jsonl (the first --warmup
steps excluded), and the step's mean generation, train, trainer-idle and engine-idle seconds. The
runs alternate (sync first, then async first) and the ratio is of the medians over reps, and per
rep. The machine may be shared: read the load average printed with them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"


def run(k: int, args: argparse.Namespace, root: Path, tag: str) -> dict:
    run_dir = root / f"k{k}-{tag}"
    sets = [f"rollout.max_staleness={k}", f"algorithm.num_steps={args.steps}", "logging.progress=false",
            "logging.tensorboard=false", "resources.cpu_bind=apart", "rollout.ignore_eos=true",
            f"rollout.max_new_tokens={args.max_new_tokens}", f"data.num_prompts_per_step={args.prompts}"]
    cmd = [sys.executable, "-m", "hpcrl.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"max_staleness {k}: hpcrl run failed\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = recs[args.warmup:]
    span = steady[-1]["time"] - recs[args.warmup - 1]["time"]
    mean = lambda key: statistics.mean(r.get(key, 0.0) for r in steady)  # noqa: E731
    return {"steps_s": len(steady) / span, "rollout_s": mean("timing/rollout_s"), "train_s": mean("timing/train_s"),
            "sync_s": mean("timing/sync_s"),
            "trainer_idle_s": mean("timing/trainer_idle_s"), "engine_idle_s": mean("timing/engine_idle_s"),
            "staleness": mean("rollout/staleness_mean"), "reward": statistics.mean(r["reward/mean"] for r in recs[-5:])}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=16,
                    help="fixed completion length; 16 makes generating a batch (~39 ms) about as long as training "
                         "on it (~52 ms) on a 2-core AMD EPYC")
    ap.add_argument("--prompts", type=int, default=16, help="data.num_prompts_per_step (x 8 completions)")
    args = ap.parse_args()
    got: dict[int, list[dict]] = {0: [], 1: []}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for k in ((0, 1) if rep % 2 == 0 else (1, 0)):
                got[k].append(run(k, args, Path(tmp), str(rep)))
    print(f"async_overlap: tiny-qwen3-moe, {args.prompts} prompts x 8, {args.max_new_tokens} new tokens (ignore_eos), "
          f"{args.steps} steps (first {args.warmup} excluded), cpu_bind apart, {args.reps} reps, "
          f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}")
    print(f"{'max_staleness':>13} {'steps/s':>8} {'generate_s':>10} {'train_s':>8} {'sync_s':>8} {'trainer_idle_s':>14} "
          f"{'engine_idle_s':>13} {'staleness':>9} {'reward(last5)':>13}")
    med = {}
    for k, runs in got.items():
        med[k] = {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        m = med[k]
        print(f"{k:>13} {m['steps_s']:8.2f} {m['rollout_s']:10.4f} {m['train_s']:8.4f} {m['sync_s']:8.4f} "
              f"{m['trainer_idle_s']:14.4f} "
              f"{m['engine_idle_s']:13.4f} {m['staleness']:9.2f} {m['reward']:13.3f}")
    pairs = [a["steps_s"] / s["steps_s"] for a, s in zip(got[1], got[0])]
    print(f"steps/s max_staleness 1 / synchronous = {med[1]['steps_s'] / med[0]['steps_s']:.2f} "
          f"(per rep: {', '.join(f'{p:.2f}' for p in pairs)})")


if __name__ == "__main__":
    main()
