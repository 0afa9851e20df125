"""The reference engine's generate call through `DirectForward` against transformers' own forward,
alternating in one process: what the decoding forward's wrappers cost.

One `ReferenceModel` per preset; each generate call is the tiny example's (64 prompts of 2 tokens, up
to 4 new tokens, temperature 1, a seed per request) or, for the small preset, 16 prompts of 16
tokens and 16 new tokens; the calls alternate between `engine._forward` = DirectForward and
= the HF forward (`engine._hf_forward`), so the host's drift cancels; the median of each, whether
the tokens and finish reasons are the same both ways, and the largest log-prob difference. One torch
thread.

    .venv/bin/python benchmarks/engine_forward.py [--calls 100] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from results_md import append_to_section, run_heading

CASES = (("tiny-qwen3-moe", 64, 2, 4), ("small-qwen3-moe", 16, 16, 16))  # preset, prompts, length, new


def _row(preset: str, prompts_n: int, length: int, new: int, calls: int) -> str:
    from hpcrl.models.presets import load_hf_config
    from hpcrl.rollout.engine import ReferenceModel

    engine = ReferenceModel(load_hf_config(preset, None), seed=0)
    direct = engine._forward
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 60, (length,), generator=g).tolist() for _ in range(prompts_n)]
    params = [{"temperature": 1.0, "max_new_tokens": new, "sampling_seed": i} for i in range(prompts_n)]
    times: dict[str, list[float]] = {"transformers": [], "direct": []}
    answers = {}
    for i in range(2 * (calls + 5)):
        name = ("transformers", "direct")[i % 2]
        engine._forward = direct if name == "direct" else engine._hf_forward
        t0 = time.perf_counter()
        answers[name] = engine.generate(prompts, params)
        if i >= 10:
            times[name].append(time.perf_counter() - t0)
    base, new_ms = (statistics.median(times[k]) * 1e3 for k in ("transformers", "direct"))
    a, b = answers["direct"], answers["transformers"]
    same = all(x["output_ids"] == y["output_ids"] and x["finish_reason"] == y["finish_reason"]
               for x, y in zip(a, b))
    diff = max(abs(p - q) for x, y in zip(a, b) for p, q in zip(x["output_logprobs"], y["output_logprobs"]))
    return (f"| {preset}, {prompts_n} x {length} tokens, {new} new | {base:.2f} | {new_ms:.2f} | "
            f"{base / new_ms:.2f}x | {'yes' if same else 'NO'} | {diff:.1e} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=100, help="measured generate calls of each forward")
    ap.add_argument("--results", type=Path, help="append the table under '## engine_forward' here")
    args = ap.parse_args()
    if args.calls < 10:
        ap.error(f"--calls={args.calls}: need >= 10")
    torch.set_num_threads(1)
    load0 = os.getloadavg()[0]
    rows = [_row(*case, calls=args.calls if case[0].startswith("tiny") else max(args.calls // 5, 10))
            for case in CASES]
    text = "\n".join([
        run_heading(f".venv/bin/python benchmarks/engine_forward.py --calls {args.calls}"), "",
        f"One torch thread; load average (1 min) {load0:.1f} before, {os.getloadavg()[0]:.1f} after.", "",
        "| generate call | transformers' forward, ms | DirectForward, ms | speed-up | same tokens | "
        "max log-prob difference |", "|---|---|---|---|---|---|", *rows, ""])
    print(text)
    if args.results:
        append_to_section(args.results, "## engine_forward", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
