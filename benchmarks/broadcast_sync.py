"""The SGLang-protocol weight sync from several trainer sources vs from trainer rank 0 alone.

`python benchmarks/broadcast_sync.py [--reps 3] [--steps 5] [--results benchmarks/RESULTS.md]` runs
`hpcrl run` of the example with the small preset (small-qwen3-moe, 108 MiB fp32), 2 trainer ranks
(EP 2) and 2 reference engines, in alternating order per repetition:
  * multi-source -- `rollout.weight_sync: broadcast`, bucket 16 MB: sources [0, 1] broadcast to the
                   engines in 2 turns (hpcrl/trainer/broadcast_sync.py);
  * rank 0       -- the same path with 128 MB buckets: the model fits one bucket, so trainer rank 0
                   is the only source (it gathers rank 1's experts), the verl / slime pattern;
  * shard        -- `rollout.weight_sync: shard` (the reference engine's default), for reference.
Each run's time is the median of `timing/sync_s` over its steps after the first; reported values
are medians over repetitions, with the ratio to rank 0. Every run must end with the same policy
hash (the three paths deliver the same weights).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from results_md import append_to_section, run_heading

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
COMMON = ["model.preset=small-qwen3-moe", "trainer.num_procs=2", "trainer.ep=2", "rollout.num_engines=2",
          "data.num_prompts_per_step=2", "algorithm.group_size=2", "logging.progress=false"]
METHODS = {"multi-source": ["rollout.weight_sync=broadcast", "rollout.bucket_mb=16"],
           "rank 0": ["rollout.weight_sync=broadcast", "rollout.bucket_mb=128"],
           "shard": ["rollout.weight_sync=shard", "rollout.bucket_mb=16"]}


def one_run(method: str, steps: int, root: Path) -> tuple[float, str, str]:
    """(median sync seconds after step 0, policy hash, the trainer's weight-sync line)."""
    run_dir = root / f"{method.replace(' ', '_')}-{len(list(root.iterdir()))}"
    sets = [*COMMON, f"algorithm.num_steps={steps}", *METHODS[method]]
    cmd = [sys.executable, "-m", "hpcrl.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"{method}: hpcrl run failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    sync_s = statistics.median(r["timing/sync_s"] for r in records[1:])
    digest = json.loads((run_dir / "final.json").read_text())["policy_sha256"]
    line = next(ln for ln in (run_dir / "logs" / "rank1-trainer.log").read_text().splitlines()
                if ln.startswith("weight sync:"))
    return sync_s, digest, line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--results", type=Path, help="append the table under '## broadcast_sync' here")
    args = ap.parse_args()
    load0 = os.getloadavg()
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    digests, lines = set(), {}
    with tempfile.TemporaryDirectory(prefix="hpcrl-bench-bcast-") as tmp:
        for rep in range(args.reps):
            order = list(METHODS) if rep % 2 == 0 else list(reversed(METHODS))
            for m in order:
                s, digest, line = one_run(m, args.steps, Path(tmp))
                times[m].append(s)
                digests.add(digest)
                lines[m] = line
                print(f"rep {rep} {m}: sync {s * 1e3:.1f} ms", flush=True)
    if len(digests) != 1:
        raise RuntimeError(f"the paths ended with different policies: {sorted(digests)}")
    base = statistics.median(times["rank 0"])
    load1 = os.getloadavg()
    rows = [run_heading(f"python benchmarks/broadcast_sync.py --reps {args.reps} --steps {args.steps}"), "",
            f"Host: {platform.node()} ({os.cpu_count()} CPUs, shared), load average (1 min) {load0[0]:.1f} before, "
            f"{load1[0]:.1f} after. small-qwen3-moe (108 MiB fp32), 2 trainer ranks (EP 2) -> 2 reference "
            f"engines; per run the median `timing/sync_s` of steps 1..{args.steps - 1}; medians over "
            f"{args.reps} alternating repetitions. Same policy hash in every run.", "",
            "| method | weight-sync line | median ms | vs rank 0 | reps (ms) |", "|---|---|---|---|---|"]
    for m in METHODS:
        med = statistics.median(times[m])
        rows.append(f"| {m} | `{lines[m]}` | {med * 1e3:.1f} | {base / med:.2f}x | "
                    f"{' '.join(f'{t * 1e3:.0f}' for t in times[m])} |")
    table = "\n".join(rows) + "\n"
    print(table)
    if args.results:
        append_to_section(args.results, "## broadcast_sync", table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
