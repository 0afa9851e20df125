"""Plan DeepSeek-V3 (671B) weight syncs at 256 -> 128 and 1,024 -> 512 GPUs, with no processes.

For each case: planning wall time and CPU time (goal <= 10 s), the modelled transfer time against
the NIC line-rate lower bound (goal estimate / bound <= 1.15), and the verl/slime broadcast
baseline under the same network model (moe/network.py). Layouts follow public recipes: Megatron
DeepSeek-V3 with uneven first/last pipeline stages (61 layers), SGLang engines of 32 GPUs with EP
32 and DP-attention 4. Results are appended under `## plan_scale` in benchmarks/RESULTS.md.

    python benchmarks/plan_scale.py [--budget-gib 1] [--no-write]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shlex
import sys
import time
from pathlib import Path

from moe.layouts import RolloutLayout, TrainerLayout
from moe.network import Topology
from moe.report import plan_report
from moe.specs import get_spec
from results_md import append_to_section

CASES = {
    "256 -> 128": (TrainerLayout(tp=8, pp=8, ep=32, etp=1, dp=4, first_stage_layers=7, last_stage_layers=6),
                   RolloutLayout(num_engines=4, tp=32, ep=32, dp_attention=4)),
    "1,024 -> 512": (TrainerLayout(tp=2, pp=16, ep=64, etp=1, dp=32, first_stage_layers=3, last_stage_layers=2),
                     RolloutLayout(num_engines=16, tp=32, ep=32, dp_attention=4)),
}
RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
HEADING = "## plan_scale"


def run(budget_bytes: int) -> list[dict]:
    spec = get_spec("deepseek_v3/671B")
    rows = []
    for name, (trainer, rollout) in CASES.items():
        cpu0, wall0 = time.process_time(), time.perf_counter()
        r = plan_report(spec, trainer, rollout, topology=Topology(), memory_budget_bytes=budget_bytes,
                        gpu_memory_bytes=80 * 2**30)
        r["report_wall_s"], r["report_cpu_s"] = time.perf_counter() - wall0, time.process_time() - cpu0
        r["case"] = name
        rows.append(r)
        print(f"{name}: planned {r['plan']['num_transfers']:,} transfers / {r['plan']['num_rounds']} rounds in "
              f"{r['plan']['planning_s']:.2f} s wall, {r['plan']['planning_cpu_s']:.2f} s CPU "
              f"(report {r['report_wall_s']:.2f} s wall, "
              f"{r['report_cpu_s']:.2f} s CPU); estimate {r['estimate_s']:.3f} s, lower bound "
              f"{r['lower_bound_s']:.3f} s, ratio {r['estimate_over_lower_bound']:.3f}; broadcast baseline "
              f"{r['baseline_broadcast_s']:.2f} s", flush=True)
    return rows


def section(rows: list[dict], command: str) -> str:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"### {now}: `{command}`", "",
             f"Host: {platform.node()} ({platform.machine()}, {os.cpu_count()} CPUs, Python "
             f"{platform.python_version()}), load average {os.getloadavg()[0]:.1f} at the end: the machine is shared, "
             "so CPU seconds (process time) are what an idle machine's wall clock would show. "
             "Network: H100 DGX (8 GPUs/node, 8 x 400 Gb/s NICs, "
             "NVLink 450 GB/s), trainer and rollout on separate nodes.", "",
             "| case | trainer | rollout | transfers | rounds | plan s (wall / CPU) | report s (wall / CPU) | "
             "estimate s | lower bound s | ratio | broadcast baseline s | max recv GiB/GPU |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t, ro = r["trainer"]["layout"], r["rollout"]["layout"]
        lines.append(
            f"| {r['case']} | tp{t['tp']} pp{t['pp']} ep{t['ep']} etp{t['etp']} dp{t['dp']} "
            f"(first {t['first_stage_layers']}, last {t['last_stage_layers']}) | {ro['num_engines']} x "
            f"(tp{ro['tp']} ep{ro['ep']} dpa{ro['dp_attention']}) | {r['plan']['num_transfers']:,} | "
            f"{r['plan']['num_rounds']} | {r['plan']['planning_s']:.2f} / {r['plan']['planning_cpu_s']:.2f} | "
            f"{r['report_wall_s']:.2f} / "
            f"{r['report_cpu_s']:.2f} | {r['estimate_s']:.3f} | {r['lower_bound_s']:.3f} | "
            f"{r['estimate_over_lower_bound']:.3f} | {r['baseline_broadcast_s']:.2f} | "
            f"{r['max_recv_bytes_per_gpu'] / 2**30:.1f} |")
    lines += ["", f"Goals: planning <= 10 s, estimate / lower bound <= 1.15. Memory budget "
                  f"{rows[0]['plan']['memory_budget_bytes'] / 2**30:g} GiB per GPU per round.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-gib", type=float, default=1.0, help="staging memory per GPU per round")
    ap.add_argument("--no-write", action="store_true", help="print only; do not touch RESULTS.md")
    args = ap.parse_args()
    rows = run(int(args.budget_gib * 2**30))
    if not args.no_write:
        command = " ".join(shlex.quote(a) for a in ["python", "benchmarks/plan_scale.py", *sys.argv[1:]])
        append_to_section(RESULTS, HEADING, section(rows, command))
        print(f"appended to {RESULTS}")


if __name__ == "__main__":
    main()
