"""resources.cpu_bind auto against none: the tiny example's steps/s, runs alternating.

    .venv/bin/python benchmarks/cpu_bind.py [--reps 10] [--steps 60] [--results benchmarks/RESULTS.md]

Each rep runs `hpcrl run` twice in e2e_vs_trl's tiny configuration (the same command, one torch
thread per compute process), once with `resources.cpu_bind=auto` and once with `none`, in
alternating order, and reads the steady-state steps/s and phase times from metrics.jsonl
(steps after the warm-up). This host drifts by tens of percent within minutes, so only the paired
ratio of the two runs of one rep, and their median over reps, mean anything.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from e2e_vs_trl import REPO, BenchConfig, hpcrl_command, run_once
from results_md import append_to_section, run_heading

MODES = ("auto", "none")
PHASES = ("rollout", "train", "sync")


def one_run(cfg: BenchConfig, mode: str, run_dir: Path, rep: int) -> dict[str, float]:
    cmd = hpcrl_command(cfg, run_dir, REPO, 1) + ["--set", f"resources.cpu_bind={mode}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return run_once(f"hpcrl cpu_bind={mode}", cmd, run_dir, env, REPO, 600, rep).summary(cfg.warmup)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=10, help="pairs of runs (auto, none)")
    ap.add_argument("--steps", type=int, default=60, help="steps per run; the first 10 are warm-up")
    ap.add_argument("--results", type=Path, help="append the table under '## cpu_bind' here")
    args = ap.parse_args()
    if args.steps <= 10:
        ap.error(f"--steps={args.steps}: must exceed the 10 warm-up steps")
    cfg = BenchConfig("tiny", "tiny-qwen3-moe", 4, False, args.steps, 10)
    out = Path(tempfile.mkdtemp(prefix="cpu_bind_"))
    runs: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    for rep in range(args.reps):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            s = one_run(cfg, mode, out / f"{mode}-{rep}", rep)
            runs[mode].append(s)
            print(f"rep {rep} cpu_bind={mode}: {s['steps_per_s']:.2f} steps/s, "
                  + ", ".join(f"{p} {s[p] * 1e3:.1f} ms" for p in PHASES)
                  + f", start-up {s['startup_s']:.1f} s", flush=True)
    paired = [a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs["auto"], runs["none"])]
    rows = ["| | cpu_bind auto | cpu_bind none | auto / none |", "|---|---|---|---|"]
    for key, label, scale in (("steps_per_s", "steps/s", 1.0), *((p, f"{p}, ms", 1e3) for p in PHASES),
                              ("startup_s", "start-up (spawn -> first step), s", 1.0),
                              ("process_s", "whole process wall, s", 1.0)):
        a = statistics.median(r[key] for r in runs["auto"]) * scale
        n = statistics.median(r[key] for r in runs["none"]) * scale
        rows.append(f"| {label} (median of {args.reps}) | {a:.2f} | {n:.2f} | {a / n:.3f} |")
    text = "\n".join([
        run_heading(f".venv/bin/python benchmarks/cpu_bind.py --reps {args.reps} --steps {args.steps}"), "",
        *rows, "",
        f"Paired steps/s ratios auto / none per rep: {', '.join(f'{x:.3f}' for x in paired)}; "
        f"median {statistics.median(paired):.3f}, geometric mean "
        f"{statistics.geometric_mean(paired):.3f}, auto faster in {sum(x > 1 for x in paired)} "
        f"of {len(paired)}."])
    print("\n" + text)
    if args.results:
        append_to_section(args.results, "## cpu_bind", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
