"""Routing replay (R3) against the rollout-train mismatch, side by side in one run: a bf16 reference
engine against the fp32 trainer on the tiny example, routes observed only (rollout.routing_replay
observe) and replayed (r3).

    .venv/bin/python benchmarks/routing_replay.py [--steps 30] [--model tiny-qwen3-moe]

Per mode, from metrics.jsonl over all steps: the mean of mismatch/router_agreement (share of
(token, MoE layer) routes the trainer's training forward took as the engine did), of mismatch/kl
(token mean of k3 of the engine's log-probs against the trainer's), the last step's reward, the
median step time; then kl(observe) / kl(r3), the factor R3 takes off the mismatch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
BF16_ENGINE = ["rollout.dtype=bfloat16", "rollout.logprob_tolerance=1.0", "rollout.logprob_mean_tolerance=0.02"]


def run(mode: str, steps: int, model: str, root: Path) -> dict:
    run_dir = root / mode
    sets = [*BF16_ENGINE, f"rollout.routing_replay={mode}", f"algorithm.num_steps={steps}",
            "logging.progress=false", f"model.preset={model}"]
    cmd = [sys.executable, "-m", "hpcrl.cli", "run", str(EXAMPLE), "--run-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"{mode}: hpcrl run failed\n{out.stdout[-2000:]}{out.stderr[-2000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"agreement": statistics.mean(r["mismatch/router_agreement"] for r in recs),
            "kl": statistics.mean(r["mismatch/kl"] for r in recs),
            "over_tol": statistics.mean(r["mismatch/over_tolerance_frac"] for r in recs),
            "reward": recs[-1]["reward/mean"], "step_s": statistics.median(r["timing/step_s"] for r in recs)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--model", default="tiny-qwen3-moe")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = {mode: run(mode, args.steps, args.model, Path(tmp)) for mode in ("observe", "r3")}
    print(f"routing replay, {args.model}, bf16 engine vs fp32 trainer, {args.steps} steps")
    print(f"{'mode':8} {'router_agreement':>17} {'mismatch/kl':>12} {'reward(last)':>13} {'step_s':>7}")
    for mode, g in got.items():
        print(f"{mode:8} {g['agreement']:17.5f} {g['kl']:12.3e} {g['reward']:13.3f} {g['step_s']:7.3f}")
    print(f"kl(observe) / kl(r3) = {got['observe']['kl'] / max(got['r3']['kl'], 1e-30):.2f}")


if __name__ == "__main__":
    main()
