"""hpcrl vs TRL's GRPOTrainer, end to end and side by side, on the same GRPO problem (issue 2, item 10).

Runs `hpcrl run` (MPI controller + Megatron trainer rank + reference engine over HTTP, weight sync
every step) and benchmarks/trl_grpo_tiny.py (TRL GRPOTrainer in .venv-bench, one process) on the
same model config, initial weights (the HF draw under seed 1234), prompts (hpcrl's sampler), reward
(token_match), batch (8 prompts x 8 completions), response length, lr, Adam and MoE aux-loss
coefficient; fp32 on the CPU. Two configurations:

    tiny     tiny-qwen3-moe (~83k params), up to 4 new tokens, --tiny-steps steps
    compute  small-qwen3-moe (~28M params), exactly --compute-tokens new tokens per completion
             (hpcrl rollout.ignore_eos, TRL min_new_tokens), --compute-steps steps

Each configuration runs --reps repetitions of each backend, alternating which goes first. Per run:
steady-state steps/s and generated tokens/s over the steps after the warm-up (from the per-step end
timestamps in metrics.jsonl, so logging and every other inter-step cost counts), the mean time
breakdown over the same steps (generation, reward, old log-probs, train, weight sync, overhead =
step interval - phases), the whole-process wall time including start-up, the CPU seconds of the
process tree and the load average around the run. Reports medians over repetitions and the ratios
hpcrl / TRL. The machine may be shared with other work: read the load column.

    bash benchmarks/setup_trl_env.sh          # once: .venv-bench with TRL
    .venv/bin/python benchmarks/e2e_vs_trl.py --reps 3 --results benchmarks/RESULTS.md

`--hpcrl-rev REV` runs hpcrl from `git archive REV` (via PYTHONPATH) instead of the working tree, so
uncommitted edits in a shared checkout cannot break or skew a run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from results_md import replace_section

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "tiny_moe_grpo.yaml"
TRL_SCRIPT = REPO / "benchmarks" / "trl_grpo_tiny.py"
PHASES = ("rollout", "reward", "logprobs", "train", "sync")
SECTION = "## e2e_vs_trl"


@dataclass(frozen=True)
class BenchConfig:
    name: str
    preset: str
    max_new_tokens: int
    fixed_length: bool
    num_steps: int
    warmup: int
    num_prompts: int = 8
    group_size: int = 8
    lr: float = 5e-3
    aux_loss_coef: float = 0.01
    temperature: float = 1.0


@dataclass
class RunResult:
    """One process run: its per-step records and what the driver measured around it."""

    backend: str
    rep: int
    t_spawn: float
    t_exit: float
    cpu_s: float
    load_before: float
    load_after: float
    records: list[dict]

    def summary(self, warmup: int) -> dict[str, float]:
        """Rates and mean phase seconds over steps warmup..N-1 (interval i = end(i) - end(i-1))."""
        r = self.records
        span = r[-1]["time"] - r[warmup - 1]["time"]
        n = len(r) - warmup
        out = {"steps_per_s": n / span,
               "tokens_per_s": sum(x["rollout/tokens"] for x in r[warmup:]) / span,
               "interval_s": span / n}
        for p in PHASES:
            out[p] = sum(x.get(f"timing/{p}_s", 0.0) for x in r[warmup:]) / n
        out["overhead"] = out["interval_s"] - sum(out[p] for p in PHASES)
        out["startup_s"] = r[0]["time"] - r[0]["timing/step_s"] - self.t_spawn
        out["process_s"] = self.t_exit - self.t_spawn
        out["cpu_s"] = self.cpu_s
        out["load"] = (self.load_before + self.load_after) / 2
        return out


def hpcrl_command(cfg: BenchConfig, run_dir: Path, src: Path, cpus_per_rank: int,
                  extra: list[str] = ()) -> list[str]:
    sets = {"resources.cpus_per_rank": cpus_per_rank, "model.preset": cfg.preset, "data.task": "copy",
            "data.num_prompts_per_step": cfg.num_prompts, "data.seed": 0,
            "algorithm.group_size": cfg.group_size, "algorithm.num_steps": cfg.num_steps,
            "algorithm.lr": cfg.lr, "algorithm.aux_loss_coef": cfg.aux_loss_coef, "algorithm.kl_coef": 0.0,
            "algorithm.loss_agg": "token-mean", "algorithm.clip_eps": 0.2, "algorithm.grad_clip": 0.0,
            "trainer.seed": 1234, "trainer.micro_batch_size": cfg.num_prompts * cfg.group_size,
            "rollout.max_new_tokens": cfg.max_new_tokens, "rollout.temperature": cfg.temperature,
            "rollout.top_p": 1.0, "rollout.ignore_eos": str(cfg.fixed_length).lower(),
            "reward.fn": "token_match", "logging.progress": "false", "logging.tensorboard": "false"}
    cmd = [sys.executable, "-m", "hpcrl.cli", "run", str(src / "examples" / "tiny_moe_grpo.yaml"),
           "--run-dir", str(run_dir)]
    for k, v in sets.items():
        cmd += ["--set", f"{k}={v}"]
    for kv in extra:  # --hpcrl-set, e.g. rollout.max_staleness=1 (asynchronous RL)
        cmd += ["--set", kv]
    return cmd


def trl_command(cfg: BenchConfig, run_dir: Path, bench_python: Path, threads: int) -> list[str]:
    cmd = [str(bench_python), str(TRL_SCRIPT), "--out-dir", str(run_dir), "--preset", cfg.preset,
           "--threads", str(threads),
           "--num-steps", str(cfg.num_steps), "--num-prompts", str(cfg.num_prompts),
           "--group-size", str(cfg.group_size), "--max-new-tokens", str(cfg.max_new_tokens),
           "--lr", str(cfg.lr), "--aux-loss-coef", str(cfg.aux_loss_coef),
           "--temperature", str(cfg.temperature), "--seed", "1234", "--data-seed", "0"]
    return cmd + (["--fixed-length"] if cfg.fixed_length else [])


def children_cpu_s() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def run_once(backend: str, cmd: list[str], run_dir: Path, env: dict[str, str], cwd: Path,
             timeout_s: float, rep: int) -> RunResult:
    """Run `cmd` in its own session (killed as a group on timeout); read RUN_DIR/metrics.jsonl.

    `cwd` matters: `python -m` puts it first on sys.path, ahead of PYTHONPATH. A run dir left by an
    earlier invocation is removed first: `hpcrl run` would resume from it (and measure a few steps
    against an old start time)."""
    if run_dir.exists():
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True)
    log = run_dir.parent / f"{run_dir.name}.log"
    load0, cpu0, t0 = os.getloadavg()[0], children_cpu_s(), time.time()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"{backend} rep {rep} ran past --timeout-s={timeout_s}; log: {log}") from None
    t1 = time.time()
    if rc != 0:
        raise RuntimeError(f"{backend} rep {rep} exited {rc}; log: {log}")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return RunResult(backend, rep, t0, t1, children_cpu_s() - cpu0, load0, os.getloadavg()[0], records)


def hpcrl_source(rev: str | None, tmp: Path) -> tuple[Path, dict[str, str]]:
    """The hpcrl tree to run and its environment: the working tree, or `git archive REV`."""
    env = dict(os.environ)
    if rev is None:
        return REPO, env
    src = tmp / "hpcrl_src"
    src.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    env["PYTHONPATH"] = f"{src}{os.pathsep}{env['PYTHONPATH']}" if env.get("PYTHONPATH") else str(src)
    where = subprocess.run([sys.executable, "-c", "import hpcrl; print(hpcrl.__file__)"], env=env, cwd=src,
                           capture_output=True, text=True, check=True).stdout.strip()
    if not where.startswith(str(src)):
        raise RuntimeError(f"--hpcrl-rev={rev}: hpcrl imports from {where}, not from the snapshot {src}")
    return src, env


def med(values: list[float]) -> float:
    return statistics.median(values)


def report(cfg: BenchConfig, runs: list[RunResult]) -> tuple[str, dict]:
    """A markdown block (tables and reward curves) and the numbers behind it."""
    by = {b: [r for r in runs if r.backend == b] for b in ("hpcrl", "trl")}
    sums = {b: [r.summary(cfg.warmup) for r in rs] for b, rs in by.items()}
    keys = ["steps_per_s", "tokens_per_s", "interval_s", *PHASES, "overhead", "startup_s", "process_s",
            "cpu_s", "load"]
    medians = {b: {k: med([s[k] for s in ss]) for k in keys} for b, ss in sums.items()}
    paired = [h["steps_per_s"] / t["steps_per_s"] for h, t in zip(sums["hpcrl"], sums["trl"])]
    lines = [f"### {cfg.name}: {cfg.preset}, {cfg.num_prompts} prompts x {cfg.group_size}, "
             f"{'exactly' if cfg.fixed_length else 'up to'} {cfg.max_new_tokens} new tokens, "
             f"{cfg.num_steps} steps (first {cfg.warmup} excluded), {len(by['hpcrl'])} reps each", "",
             "| measure (median of reps) | hpcrl | TRL | hpcrl / TRL |", "|---|---|---|---|"]
    fmt = {"steps_per_s": ("steps/s (steady state)", 3), "tokens_per_s": ("generated tokens/s", 1),
           "interval_s": ("step interval, s", 4), "rollout": ("  generation, s", 4),
           "reward": ("  reward, s", 4), "logprobs": ("  old log-probs, s", 4), "train": ("  train, s", 4),
           "sync": ("  weight sync, s", 4), "overhead": ("  overhead, s", 4),
           "startup_s": ("start-up (spawn -> first step), s", 1), "process_s": ("whole process wall, s", 1),
           "cpu_s": ("CPU seconds of the process tree", 1), "load": ("load average (1 min) around runs", 1)}
    for k in keys:
        label, nd = fmt[k]
        h, t = medians["hpcrl"][k], medians["trl"][k]
        ratio = f"{h / t:.2f}" if t > 1e-9 and k not in ("load",) else "-"
        lines.append(f"| {label} | {h:.{nd}f} | {t:.{nd}f} | {ratio} |")
    lines += ["", f"Paired steps/s ratios per rep (hpcrl / TRL, run back to back): "
              + ", ".join(f"{x:.2f}" for x in paired) + f"; steps/s per rep: hpcrl "
              + ", ".join(f"{s['steps_per_s']:.3f}" for s in sums["hpcrl"]) + "; TRL "
              + ", ".join(f"{s['steps_per_s']:.3f}" for s in sums["trl"]) + ".", ""]
    lines += reward_curves(cfg, by)
    data = {"config": cfg.__dict__, "medians": medians, "paired_steps_ratio": paired,
            "runs": {b: [{"summary": s, "rewards": [x["reward/mean"] for x in r.records]}
                         for s, r in zip(sums[b], by[b])] for b in by}}
    return "\n".join(lines), data


def reward_curves(cfg: BenchConfig, by: dict[str, list[RunResult]]) -> list[str]:
    """Mean reward per step (median over reps), at up to 10 evenly spaced steps."""
    n = cfg.num_steps
    idx = sorted({round(i * (n - 1) / 9) for i in range(10)}) if n > 10 else list(range(n))
    out = ["Reward/mean per step (median over reps):", "",
           "| step | " + " | ".join(str(i) for i in idx) + " |", "|---|" + "---|" * len(idx)]
    for b, label in (("hpcrl", "hpcrl"), ("trl", "TRL")):
        vals = [med([r.records[i]["reward/mean"] for r in by[b]]) for i in idx]
        out.append(f"| {label} | " + " | ".join(f"{v:.3f}" for v in vals) + " |")
    return out + [""]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tiny,compute", help="comma list of: tiny, compute")
    ap.add_argument("--reps", type=int, default=3, help="repetitions of each backend per configuration")
    ap.add_argument("--tiny-steps", type=int, default=30)
    ap.add_argument("--tiny-warmup", type=int, default=5)
    ap.add_argument("--compute-steps", type=int, default=5)
    ap.add_argument("--compute-warmup", type=int, default=1)
    ap.add_argument("--compute-tokens", type=int, default=128)
    ap.add_argument("--bench-python", type=Path, default=REPO / ".venv-bench" / "bin" / "python",
                    help="python of the TRL environment (bash benchmarks/setup_trl_env.sh)")
    ap.add_argument("--hpcrl-rev", default=None, help="run hpcrl from `git archive REV` (default: working tree)")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch/OpenMP threads of each compute process: TRL's one process, hpcrl's trainer "
                    "and engine ranks (resources.cpus_per_rank). 1 by default: on a shared machine a "
                    "2-thread OpenMP process next to other busy processes slows down erratically (measured "
                    "up to 10x), while 1 thread degrades only by its fair share")
    ap.add_argument("--out-dir", type=Path, default=None, help="run dirs and logs (default: a temp dir)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per run")
    ap.add_argument("--results", type=Path, default=None, help="replace the e2e_vs_trl section of this file")
    ap.add_argument("--hpcrl-set", action="append", default=[], metavar="KEY=VALUE",
                    help="a further --set of the hpcrl runs (repeatable), e.g. rollout.max_staleness=1")
    ap.add_argument("--note", default="", help="a line added to the results section (e.g. the machine)")
    args = ap.parse_args(argv)
    bad = [c for c in args.configs.split(",") if c not in ("tiny", "compute")]
    if bad:
        ap.error(f"--configs={args.configs!r}: unknown {bad}; valid: tiny, compute")
    for name in ("reps", "threads", "tiny_warmup", "compute_warmup", "compute_tokens"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)}: must be >= 1")
    if args.tiny_steps <= args.tiny_warmup or args.compute_steps <= args.compute_warmup:
        ap.error("--tiny-steps / --compute-steps must exceed their warm-up (steady-state steps are after it)")
    if not args.bench_python.exists():
        ap.error(f"--bench-python={args.bench_python}: not found; run `bash benchmarks/setup_trl_env.sh` first")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    configs = {"tiny": BenchConfig("tiny", "tiny-qwen3-moe", 4, False, args.tiny_steps, args.tiny_warmup),
               "compute": BenchConfig("compute", "small-qwen3-moe", args.compute_tokens, True,
                                      args.compute_steps, args.compute_warmup)}
    tmp = Path(tempfile.mkdtemp(prefix="e2e_vs_trl_"))
    out_dir = args.out_dir or tmp
    src, hp_env = hpcrl_source(args.hpcrl_rev, tmp)
    threads_env = {"OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    hp_env.update(threads_env)
    trl_env = {**os.environ, **threads_env}
    rev = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", args.hpcrl_rev or "HEAD"],
                         capture_output=True, text=True).stdout.strip()
    blocks, data = [], {}
    for name in args.configs.split(","):
        cfg, runs = configs[name], []
        for rep in range(args.reps):
            order = ("hpcrl", "trl") if rep % 2 == 0 else ("trl", "hpcrl")
            for backend in order:
                run_dir = out_dir / f"{name}-{backend}-{rep}"
                if backend == "hpcrl":
                    cmd = hpcrl_command(cfg, run_dir, src, args.threads, args.hpcrl_set)
                    res = run_once(backend, cmd, run_dir, hp_env, src, args.timeout_s, rep)
                else:
                    res = run_once(backend, trl_command(cfg, run_dir, args.bench_python, args.threads), run_dir,
                                   trl_env, REPO, args.timeout_s, rep)
                s = res.summary(cfg.warmup)
                print(f"[{name}] {backend} rep {rep}: {s['steps_per_s']:.3f} steps/s, "
                      f"{s['tokens_per_s']:.1f} tok/s, process {s['process_s']:.1f} s, "
                      f"load {s['load']:.1f}", flush=True)
                runs.append(res)
        block, data[name] = report(cfg, runs)
        print("\n" + block, flush=True)
        blocks.append(block)
    (out_dir / "results.json").write_text(json.dumps(data, indent=1))
    head = (f"`{' '.join(['.venv/bin/python', 'benchmarks/e2e_vs_trl.py', *(argv or sys.argv[1:])])}`  \n"
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, hpcrl {rev}"
            f"{' (git archive)' if args.hpcrl_rev else ' (working tree)'}, {os.cpu_count()} CPUs, "
            f"{args.threads} torch thread(s) per compute process on both sides. {args.note}")
    print(f"\nrun dirs and results.json: {out_dir}")
    if args.results:
        replace_section(args.results, SECTION, head + "\n\n" + "\n".join(blocks))
        print(f"wrote the {SECTION} section of {args.results}")


if __name__ == "__main__":
    main()
