"""Routing replay (R3) against the rollout-train mismatch: a bf16 reference engine against the fp32
trainer on a tiny copy example (each tiny model's own, EXAMPLES, unless --example), measured two ways.

    .venv/bin/python benchmarks/routing_replay.py [--steps 80] [--model tiny-qwen3-moe] [--example F]
                                                  [--no-fp32-lm-head] [--checkpoints 16] [--samples 256]
                                                  [--seed N | --seeds N]

Unpaired (the issue's "side by side in one run"): two `hpcrl run`s of the example, routes observed
only (rollout.routing_replay observe) and replayed (r3), both with rollout.fp32_lm_head unless
--no-fp32-lm-head. Per mode, over all steps of its metrics.jsonl: the mean of mismatch/router_agreement
(share of (token, MoE layer) routes the trainer's training forward took as the engine did), of
mismatch/kl (token mean of k3 of the engine's log-probs against the trainer's, what the run logs),
the last step's reward, the median step time; then kl(observe) / kl(r3). The two runs follow their
own trajectories (other updates, other samples), so their KLs are of different policies and
different tokens.

Paired: at `--checkpoints` checkpoints of the r3 run (exported with `hpcrl export`), one rollout of
`--samples` completions of the copy prompts, sampled as the run samples (temperature, top_p,
max_new_tokens, stop ids), by the reference engine in bf16 on those weights with its routes, which
take the run's way (the reference server's encoding, the controller's RouteFormat, the trainer's
TrainBatch); then the fp32 trainer's log-probs of that same rollout on the same weights routing
freely and replaying the engine's routes (a one-rank MegatronPolicy, rollout.routing_replay observe
and r3), each scored by the run's own sync_check_metrics. kl(free) / kl(replay) is then the share of
the mismatch the routing carries, nothing else differing. The rollout is drawn with and without
the fp32 LM head (the same sampling seeds), so the table also shows what the head takes off. The
paired summary is the analogue of the run's mean over steps: kl(free) and kl(replay) each averaged
over the checkpoints, then their ratio.

Where the floor comes from (`ENGINES`): beside the bf16 engine with and without the fp32 LM head, a
third engine holds the same bf16-rounded weights but computes in float32 ("bf16 weights"). Its
kl(replay) is the part of the floor the weights' rounding alone makes, which no engine arithmetic
can take off; the rest of the bf16 engine's floor is its arithmetic rounding (activations, residual
stream, KV cache), spread over the whole forward.

Over seeds (`--seeds N`, unpaired only): the two runs at trainer.seed = data.seed = 0..N-1. A run's
mean kl is carried by the few steps in which a routing flip moves a token far (up to ~1.4 nats
against a floor of ~1e-3), so one seed's ratio swings 2-20x. The estimate of the expected ratio is
the pooled one, mean over seeds of kl(observe) / mean over seeds of kl(r3); the per-seed ratios and
their median are printed beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = {"tiny-qwen3-moe": REPO / "examples" / "tiny_moe_grpo.yaml",
            "tiny-deepseek-v3": REPO / "examples" / "tiny_deepseek_v3_grpo.yaml"}
"""Each tiny model's own example (its batch and aux-loss settings); another preset runs the Qwen one's."""


def example_of(args: argparse.Namespace) -> Path:
    return Path(args.example) if args.example else EXAMPLES.get(args.model, EXAMPLES["tiny-qwen3-moe"])


def hpcrl(*args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], cwd=REPO, capture_output=True,
                         text=True, timeout=3600)
    if out.returncode:
        raise SystemExit(f"hpcrl {args[0]} failed\n{out.stdout[-2000:]}{out.stderr[-2000:]}")


def run(mode: str, args: argparse.Namespace, run_dir: Path, checkpoint_every: int = 0,
        seed: int | None = None) -> dict:
    """One run of the example; its per-step means (see the module docstring)."""
    sets = ["rollout.dtype=bfloat16", f"rollout.logprob_tolerance={args.logprob_tolerance}",
            f"rollout.logprob_mean_tolerance={args.logprob_mean_tolerance}",
            f"rollout.routing_replay={mode}", f"algorithm.num_steps={args.steps}", "logging.progress=false",
            f"model.preset={args.model}", f"rollout.fp32_lm_head={args.fp32_lm_head}",
            f"checkpoint.interval_steps={checkpoint_every}", "checkpoint.keep=1000",
            *([] if seed is None else [f"trainer.seed={seed}", f"data.seed={seed}"])]
    hpcrl("run", str(example_of(args)), "--run-dir", str(run_dir), *(x for s in sets for x in ("--set", s)))
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {"agreement": statistics.mean(r["mismatch/router_agreement"] for r in recs),
            "kl": statistics.mean(r["mismatch/kl"] for r in recs),
            "over_tol": statistics.mean(r["mismatch/over_tolerance_frac"] for r in recs),
            "reward": recs[-1]["reward/mean"],
            "step_s": statistics.median(r["timing/step_s"] for r in recs)}


ENGINES = {"fp32 head": ("bfloat16", True), "bf16 head": ("bfloat16", False),
           "bf16 weights": ("float32", False)}
"""The paired measure's engines: (arithmetic dtype, fp32 LM head). Each holds the checkpoint's weights
rounded to bf16; "bf16 weights" computes in float32 from them (module docstring)."""


def rollout_of(model_dir: Path, cfg: dict, samples: int, engine_kind: str, job):  # -> Rollout
    """`samples` completions of the copy prompts (each letter in turn) by a reference engine of
    `ENGINES` on `model_dir`'s weights rounded to bf16, sampled as the run samples, with the engine's
    routes as the controller keeps them."""
    import torch

    from hpcrl.controller.groups import Rollout
    from hpcrl.controller.routes import RouteFormat
    from hpcrl.rollout.engine import ReferenceModel
    from hpcrl.rollout.reference_server import encode_routed_experts
    from hpcrl.tasks.synthetic import LETTERS
    from hpcrl.tasks.tokenizer import CharTokenizer
    from moe.hf_megatron import HFModelDims

    tok = CharTokenizer()
    dtype, fp32_lm_head = ENGINES[engine_kind]
    engine = ReferenceModel(cfg, dtype=getattr(torch, dtype), fp32_lm_head=fp32_lm_head)
    engine.load_model_dir(str(model_dir))
    if dtype != "bfloat16":  # the bf16 engines' weights, computed with in float32
        with torch.no_grad():
            for param in engine.model.parameters():
                param.copy_(param.bfloat16())
    prompts = [tok.encode_prompt(LETTERS[i % len(LETTERS)]) for i in range(samples)]
    r = job.rollout
    params = [{"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
               "stop_token_ids": list(tok.stop_token_ids), "ignore_eos": r.ignore_eos,
               "sampling_seed": 1000 + i} for i in range(samples)]
    outs = engine.generate(prompts, params, return_routes=True)
    fmt = RouteFormat.of(HFModelDims.from_hf_config(cfg))
    routes = [fmt.decode({"routed_experts": encode_routed_experts(o["routed_experts"])},
                         len(p) + len(o["output_ids"]), f"completion {i}")
              for i, (p, o) in enumerate(zip(prompts, outs))]
    return Rollout([None] * samples, prompts, [o["output_ids"] for o in outs],
                   [o["output_logprobs"] for o in outs], [o["finish_reason"]["type"] for o in outs], routes)


def paired(model_dir: Path, samples: int, engine_kind: str, job, step: int) -> dict:
    """One rollout on `model_dir`'s weights by an `ENGINES` engine and the trainer's log-probs of it,
    free and replayed."""
    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.controller.sync_check import sync_check_metrics
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.policy import MegatronPolicy

    cfg = json.loads((model_dir / "config.json").read_text())
    rollout = rollout_of(model_dir, cfg, samples, engine_kind, job)
    batch = TrainBatch.from_lists(rollout.prompt_ids, rollout.response_ids, rollout.routes)
    out = {}
    for mode in ("observe", "r3"):  # observe routes freely and counts the routes that agree
        policy = MegatronPolicy(cfg, TrainerConfig(micro_batch_size=samples), AlgorithmConfig(),
                                routing_replay=mode)
        policy.load_hf_dir(str(model_dir))
        policy.replay.take_agreement()
        logp_BT = policy.compute_logprobs(batch, temperature=job.rollout.temperature)
        same, total = policy.replay.take_agreement()
        # the run's metrics of this rollout; no tolerance stops a measurement
        m = sync_check_metrics(rollout, logp_BT.numpy(), math.inf, 0.0, step)
        out[mode] = {"kl": m["mismatch/kl"], "agreement": same / total,
                     "mean_abs": m["sync/logprob_mean_abs_diff"]}
    out["tokens"] = rollout.num_tokens
    return out


def checkpoint_steps(run_dir: Path) -> list[int]:
    """The run's complete checkpoints (committed: a manifest)."""
    done = (run_dir / "checkpoints").glob("step_*/manifest.json")
    return sorted(int(p.parent.name.split("_")[-1]) for p in done)


def over_seeds(args: argparse.Namespace, head: str) -> None:
    """Both runs at each seed 0..N-1; the pooled ratio of the mean kls (module docstring)."""
    print(f"routing replay, {args.model} ({example_of(args).name}), bf16 engine ({head}) vs fp32 trainer, "
          f"{args.steps} steps, seeds 0..{args.seeds - 1}, rollout.logprob_tolerance {args.logprob_tolerance}, "
          f"rollout.logprob_mean_tolerance {args.logprob_mean_tolerance}")
    print(f"{'seed':>4} {'agreement':>10} {'kl observe':>11} {'kl r3':>10} {'ratio':>6} "
          f"{'reward observe':>15} {'reward r3':>10}")
    kls = []
    for seed in range(args.seeds):
        with tempfile.TemporaryDirectory() as tmp:
            got = {mode: run(mode, args, Path(tmp) / mode, 0, seed) for mode in ("observe", "r3")}
        assert got["r3"]["agreement"] == 1.0, got
        obs, r3 = got["observe"]["kl"], got["r3"]["kl"]
        kls.append((obs, r3))
        print(f"{seed:4d} {got['observe']['agreement']:10.5f} {obs:11.3e} {r3:10.3e} {obs / r3:6.2f} "
              f"{got['observe']['reward']:15.3f} {got['r3']['reward']:10.3f}", flush=True)
    obs, r3 = (statistics.mean(x) for x in zip(*kls))
    print(f"pooled over {len(kls)} seeds: kl observe {obs:.3e}, kl r3 {r3:.3e}, kl(observe) / kl(r3) = "
          f"{obs / r3:.2f}; per-seed ratio median {statistics.median(o / r for o, r in kls):.2f}, "
          f"range {min(o / r for o, r in kls):.2f}-{max(o / r for o, r in kls):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--model", default="tiny-qwen3-moe")
    ap.add_argument("--example", default=None,
                    help="the job file (default: the model's own tiny example, see EXAMPLES)")
    ap.add_argument("--no-fp32-lm-head", dest="fp32_lm_head", action="store_false")
    ap.add_argument("--checkpoints", type=int, default=16, help="paired measures along the r3 run (0: none)")
    ap.add_argument("--samples", type=int, default=256, help="completions per paired measure")
    seeds = ap.add_mutually_exclusive_group()
    seeds.add_argument("--seed", type=int, default=None,
                       help="trainer.seed and data.seed (default: the example's)")
    seeds.add_argument("--seeds", type=int, default=0,
                       help="unpaired runs at seeds 0..N-1 and their pooled ratio (see the docstring)")
    ap.add_argument("--logprob-tolerance", type=float, default=1.0,
                    help="rollout.logprob_tolerance of both runs (docs/config.md's bf16 value; a larger "
                         "one lets a run go on whose sync check a routing flip stops)")
    ap.add_argument("--logprob-mean-tolerance", type=float, default=0.02,
                    help="rollout.logprob_mean_tolerance of both runs (docs/config.md's bf16 value; a flip "
                         "on a prompt token moves every later token of its group, which can exceed it)")
    args = ap.parse_args()
    if args.seeds < 0:
        ap.error(f"--seeds {args.seeds}: the number of seeds, >= 1 (0: one run pair at --seed)")
    head = "fp32 LM head" if args.fp32_lm_head else "bf16 LM head"
    if args.seeds:
        return over_seeds(args, head)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        every = max(args.steps // max(args.checkpoints, 1), 1)
        got = {mode: run(mode, args, root / mode, every if mode == "r3" else 0, args.seed)
               for mode in ("observe", "r3")}
        print(f"routing replay, {args.model} ({example_of(args).name}), bf16 engine ({head}) vs fp32 trainer, "
              f"{args.steps} steps")
        print(f"unpaired: {'mode':8} {'router_agreement':>17} {'mismatch/kl':>12} {'over_tol':>9} "
              f"{'reward(last)':>13} {'step_s':>7}")
        for mode, g in got.items():
            print(f"          {mode:8} {g['agreement']:17.5f} {g['kl']:12.3e} {g['over_tol']:9.5f} "
                  f"{g['reward']:13.3f} {g['step_s']:7.3f}")
        print(f"          kl(observe) / kl(r3) = {got['observe']['kl'] / max(got['r3']['kl'], 1e-30):.2f}",
              flush=True)
        if not args.checkpoints:
            return

        from hpcrl.config import load_job
        from tiny_train_batch import one_rank_world

        one_rank_world()
        job = load_job(example_of(args))
        print(f"paired: the r3 run's checkpoints, {args.samples} completions each, the same rollout for "
              "free and replayed trainer log-probs")
        print(f"{'step':>6} {'engine':>12} {'tokens':>7} {'agreement':>10} {'kl free':>10} {'kl replay':>10} "
              f"{'ratio':>6} {'|d| free':>9} {'|d| replay':>10}")
        kls: dict[str, list[tuple[float, float]]] = {kind: [] for kind in ENGINES}
        for step in checkpoint_steps(root / "r3"):
            model_dir = root / f"export_{step}"
            hpcrl("export", str(root / "r3"), "--step", str(step), "--out", str(model_dir))
            for kind in ENGINES:
                p = paired(model_dir, args.samples, kind, job, step)
                free, replay = p["observe"]["kl"], p["r3"]["kl"]
                kls[kind].append((free, replay))
                assert p["r3"]["agreement"] == 1.0, p
                print(f"{step:6d} {kind:>12} {p['tokens']:7d} "
                      f"{p['observe']['agreement']:10.5f} {free:10.3e} {replay:10.3e} "
                      f"{free / max(replay, 1e-30):6.2f} {p['observe']['mean_abs']:9.2e} "
                      f"{p['r3']['mean_abs']:10.2e}", flush=True)
        floor = statistics.mean(r for _, r in kls["fp32 head"])
        for kind, pairs in kls.items():
            # the paired analogue of the run's mean over steps: means over the checkpoints
            free, replay = (statistics.mean(x) for x in zip(*pairs))
            print(f"paired, {kind}, mean over {len(pairs)} checkpoints: kl free {free:.3e}, kl replay "
                  f"{replay:.3e}, kl(free) / kl(replay) = {free / max(replay, 1e-30):.2f}; kl replay / "
                  f"the fp32-head engine's {replay / max(floor, 1e-30):.2f}")


if __name__ == "__main__":
    main()
