"""Every built-in algorithm on the tiny example, side by side in one run: step time, its breakdown
by phase, the controller's overhead share, and whether it learns.

    .venv/bin/python benchmarks/algorithms_tiny.py [--steps 80] [--algorithms grpo,dapo,...] \
        [--seeds 1234,1,2] [--results benchmarks/RESULTS.md]

Each algorithm is one `hpcrl run examples/tiny_moe_grpo.yaml --set algorithm.name=...` in turn, in
the same session, on the same machine state. From metrics.jsonl, over the steady steps (the first 5
excluded): median `timing/step_s`, the median of each phase (`timing/<phase>_s`), and the overhead:
step time minus the sum of the phases (what the controller spends outside the workers' phases:
the API's bookkeeping, advantages, the sync check, metrics), as a share of the step. Learning: the
mean reward of the first and last 5 steps (dapo's reward/mean is over its kept groups).

With `--seeds`, every algorithm also runs once per seed (`trainer.seed` and `data.seed` both set to
it: another init, other prompts, other samples) and a second table gives each run's last-5 reward:
whether an algorithm learns, rather than whether one trajectory happens to cross the bar.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
SETTINGS = {"grpo": ["algorithm.entropy_coef=0.01"], "dr_grpo": ["algorithm.entropy_coef=0.03"],
            "rloo": ["algorithm.entropy_coef=0.02"],
            "reinforce_pp": ["algorithm.kl_coef=0.01", "data.num_prompts_per_step=64"],
            "gspo": [], "dapo": [],  # their own clip ranges: 3e-4 / 4e-4 and 0.2 / 0.28
            "ppo": ["algorithm.ppo_epochs=2", "algorithm.mini_batch_size=64", "algorithm.kl_coef=0.02",
                    "algorithm.kl_target=20", "critic.value_clip=0", "algorithm.lr_schedule=linear"],
            "sft": []}
PHASES = ("rollout", "reward", "logprobs", "train", "sync")
WARMUP = 5


def run_one(name: str, steps: int, root: Path, seed: int | None = None) -> dict:
    run_dir = root / (name if seed is None else f"{name}-{seed}")
    cmd = [sys.executable, "-m", "hpcrl.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir), "--set",
           f"algorithm.name={name}", "--set", f"algorithm.num_steps={steps}", "--set", "logging.progress=false"]
    if seed is not None:
        cmd += ["--set", f"trainer.seed={seed}", "--set", f"data.seed={seed}"]
    for s in SETTINGS[name]:
        cmd += ["--set", s]
    t0 = time.monotonic()
    subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, stdin=subprocess.DEVNULL)
    wall = time.monotonic() - t0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steady = records[WARMUP:]
    step_s = statistics.median(r["timing/step_s"] for r in steady)
    phases = {p: statistics.median(r.get(f"timing/{p}_s", 0.0) for r in steady) for p in PHASES}
    overhead = statistics.median(r["timing/step_s"] - sum(r.get(f"timing/{p}_s", 0.0) for p in PHASES)
                                 for r in steady)
    rewards = [r.get("reward/mean", float("nan")) for r in records]
    return {"name": name, "wall_s": wall, "step_s": step_s, "phases": phases, "overhead_s": overhead,
            "first5": sum(rewards[:5]) / 5, "last5": sum(rewards[-5:]) / 5,
            "nll_last": records[-1].get("train/nll")}


def table(rows: list[dict], steps: int) -> str:
    head = ("| algorithm | step (ms) | " + " | ".join(f"{p} (ms)" for p in PHASES)
            + " | overhead (ms) | overhead share | reward first 5 -> last 5 |")
    lines = [head, "|" + "---|" * (len(PHASES) + 5)]
    for r in rows:
        learn = (f"{r['first5']:.3f} -> {r['last5']:.3f}" if r["nll_last"] is None
                 else f"(sft: final nll {r['nll_last']:.3f})")
        lines.append(f"| {r['name']} | {1e3 * r['step_s']:.1f} | "
                     + " | ".join(f"{1e3 * r['phases'][p]:.1f}" for p in PHASES)
                     + f" | {1e3 * r['overhead_s']:.2f} | {100 * r['overhead_s'] / r['step_s']:.1f}% | {learn} |")
    return "\n".join(lines)


def seed_table(runs: dict[str, list[dict]], seeds: list[int]) -> str:
    lines = ["| algorithm | " + " | ".join(f"seed {s}" for s in seeds) + " | min | runs >= 0.8 |",
             "|" + "---|" * (len(seeds) + 3)]
    for name, rs in runs.items():
        last5 = [r["last5"] for r in rs]
        lines.append(f"| {name} | " + " | ".join(f"{v:.3f}" for v in last5)
                     + f" | {min(last5):.3f} | {sum(v >= 0.8 for v in last5)} of {len(last5)} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--algorithms", default=",".join(SETTINGS))
    ap.add_argument("--seeds", default="", help="comma-separated seeds: also run each algorithm per seed")
    ap.add_argument("--results", default=None, help="append the table to this RESULTS.md")
    args = ap.parse_args()
    names = args.algorithms.split(",")
    seeds = [int(x) for x in args.seeds.split(",") if x]
    nonrl = {"sft"}  # no reward to learn
    with tempfile.TemporaryDirectory(prefix="hpcrl-algos-") as tmp:
        rows = [run_one(n, args.steps, Path(tmp)) for n in names]
        by_seed = {n: [run_one(n, args.steps, Path(tmp), s) for s in seeds] for n in names if n not in nonrl}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                         text=True).stdout.strip()
    command = " ".join(["--steps", str(args.steps)] + (["--seeds", args.seeds] if seeds else [])
                       + (["--algorithms", args.algorithms] if args.algorithms != ",".join(SETTINGS) else []))
    text = (f"`.venv/bin/python benchmarks/algorithms_tiny.py {command}`  \n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, hpcrl {rev}, tiny example, "
            f"{args.steps} steps each (medians over steps {WARMUP}+).\n\n" + table(rows, args.steps))
    if seeds:
        text += ("\n\nLast-5 reward/mean per seed (trainer.seed = data.seed = the seed):\n\n"
                 + seed_table(by_seed, seeds))
    print(text)
    if args.results:
        sys.path.insert(0, str(REPO / "benchmarks"))
        from results_md import append_to_section

        append_to_section(Path(args.results), "## algorithms_tiny", text)


if __name__ == "__main__":
    main()
