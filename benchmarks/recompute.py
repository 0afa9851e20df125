"""Activation recomputation (trainer.recompute_*): what a training step keeps for its backward and
what it costs in time, against no recomputation side by side in one process.

    .venv/bin/python benchmarks/recompute.py [--reps 5] [--rows 8] [--prompt 128] [--response 128]
                                             [--results benchmarks/RESULTS.md]

One rank (a one-process gloo world), the small-qwen3-moe preset (4 MoE layers, hidden 512, 8 experts
of 512, top-2) in fp32, `--rows` sequences of `--prompt` + `--response` tokens in one micro-batch, one
torch thread. Each setting is a MegatronPolicy from the same seed; the steps alternate over the
settings, `--reps` times (lr 0: every repetition is the same work), and the median step time of each
is reported with its ratio to no recomputation's. The bytes are the decoder layers' saved tensors of
one forward (hpcrl/trainer/saved_activations.py: exact, the same on any host). Every setting's first
step must equal the baseline's bit for bit (metrics and log-probs), or the benchmark stops.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from one_rank import median_steps, one_rank_world
from results_md import publish
SETTINGS = {
    "none": {},
    "full uniform 1": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective core_attn": {"recompute_granularity": "selective", "recompute_modules": ["core_attn"]},
    "selective core_attn+moe": {"recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]},
}


def make_batch(vocab: int, rows: int, prompt: int, response: int):  # -> TrainBatch
    from hpcrl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    return TrainBatch.from_lists([torch.randint(3, vocab, (prompt,), generator=g).tolist() for _ in range(rows)],
                                 [torch.randint(3, vocab, (response,), generator=g).tolist() for _ in range(rows)])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--results", type=Path, default=None, help="append the table to this RESULTS.md")
    args = ap.parse_args()
    one_rank_world()
    import torch.distributed as dist

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.policy import MegatronPolicy
    from hpcrl.trainer.saved_activations import SavedActivations

    cfg = load_hf_config("small-qwen3-moe", None)
    batch = make_batch(cfg["vocab_size"], args.rows, args.prompt, args.response)
    adv = torch.linspace(-1, 1, args.rows)
    policies, saved, first = {}, {}, {}
    for name, settings in SETTINGS.items():
        policy = MegatronPolicy(cfg, TrainerConfig(micro_batch_size=args.rows, **settings), AlgorithmConfig(lr=0.0))
        policy.init_from_seed(1)
        with SavedActivations(policy.gpt) as measure:
            first[name] = policy.train_step(batch, adv, on_policy=True)
        policies[name], saved[name] = policy, max(measure.per_forward)
    want = first["none"]
    want_logp = want.pop("logprobs_BT")
    for name, got in first.items():
        if name != "none" and (not torch.equal(got.pop("logprobs_BT"), want_logp) or got != want):
            sys.exit(f"{name}: the step differs from no recomputation's")
    times = median_steps(policies, batch, adv, args.reps)
    base_t, base_b = times["none"], saved["none"]
    lines = [f"small-qwen3-moe fp32, {args.rows} x ({args.prompt} + {args.response}) tokens in one micro-batch, "
             f"1 thread, median of {args.reps} alternating steps; every setting's step equal to none's bit for bit",
             "", "| setting | saved by the layers (MiB) | vs none | step (s) | vs none |", "|---|---|---|---|---|"]
    for name in SETTINGS:
        lines.append(f"| {name} | {saved[name] / 2**20:.1f} | {saved[name] / base_b:.3f} | {times[name]:.3f} | "
                     f"{times[name] / base_t:.2f} |")
    publish("\n".join(lines), args.results, "recompute", "benchmarks/recompute.py", sys.argv[1:])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
