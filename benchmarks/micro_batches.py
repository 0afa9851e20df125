"""Micro-batches by tokens (trainer.max_tokens_per_micro_batch) against micro-batches of a fixed number
of sequences on an RL-shaped batch (a few long responses, many short ones), side by side in one process.

    .venv/bin/python benchmarks/micro_batches.py [--reps 3] [--results benchmarks/RESULTS.md]

One rank (a one-process gloo world), the small-qwen3-moe preset in fp32, one torch thread. The batch:
16 sequences of a 32-token prompt, two with 224-token responses and fourteen with 8 to 48 (seeded).
Fixed: micro_batch_size 4, every micro-batch padded to the batch's 256 positions. By tokens:
max_tokens_per_micro_batch 1024 (= 4 x 256, so the long rows' micro-batch is as large as a fixed one)
and micro_batch_size 16. Both policies from the same seed, lr 0 (every repetition the same work),
the steps alternating `--reps` times; reported: the positions each computes (rows x padded length,
summed over micro-batches), the median step time, and how far the log-probs lie apart (the same step
up to the order of the sums; the load-balancing loss is off, as Megatron computes it per micro-batch).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from one_rank import median_steps, one_rank_world
from results_md import publish
PROMPT, LONG, SHORT = 32, 224, (8, 48)


def make_batch(vocab: int):  # -> TrainBatch
    from hpcrl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    lengths = [LONG, LONG] + torch.randint(SHORT[0], SHORT[1] + 1, (14,), generator=g).tolist()
    order = torch.randperm(16, generator=g).tolist()  # the long rows anywhere in the batch
    return TrainBatch.from_lists([torch.randint(3, vocab, (PROMPT,), generator=g).tolist() for _ in order],
                                 [torch.randint(3, vocab, (lengths[i],), generator=g).tolist() for i in order])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--results", type=Path, default=None, help="append the table to this RESULTS.md")
    args = ap.parse_args()
    one_rank_world()
    import torch.distributed as dist

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.policy import MegatronPolicy

    cfg = load_hf_config("small-qwen3-moe", None)
    batch = make_batch(cfg["vocab_size"])
    adv = torch.linspace(-1, 1, batch.batch_size)
    settings = {"fixed (4 sequences)": dict(micro_batch_size=4),
                "by tokens (1024)": dict(micro_batch_size=16, max_tokens_per_micro_batch=1024)}
    policies, positions, logp = {}, {}, {}
    for name, trainer in settings.items():
        policy = MegatronPolicy(cfg, TrainerConfig(**trainer), AlgorithmConfig(lr=0.0, aux_loss_coef=0.0))
        policy.init_from_seed(1)
        split = policy._plan(batch)
        positions[name] = sum(len(m.rows) * m.seq_len for m in split.ranks[0])
        logp[name] = policy.train_step(batch, adv, on_policy=True)["logprobs_BT"]
        policies[name] = policy
    times = median_steps(policies, batch, adv, args.reps)
    base = next(iter(settings))
    apart = max((logp[name] - logp[base]).abs().max().item() for name in settings)
    lines = [f"small-qwen3-moe fp32, 16 x ({PROMPT} + responses: 2 of {LONG}, 14 of {SHORT[0]}-{SHORT[1]}), one "
             f"rank, 1 thread, median of {args.reps} alternating steps; log-probs at most {apart:.1e} apart",
             "", "| micro-batches | positions computed | vs fixed | step (s) | vs fixed |", "|---|---|---|---|---|"]
    for name in settings:
        lines.append(f"| {name} | {positions[name]} | {positions[name] / positions[base]:.2f} | "
                     f"{times[name]:.3f} | {times[name] / times[base]:.2f} |")
    publish("\n".join(lines), args.results, "micro_batches", "benchmarks/micro_batches.py", sys.argv[1:])
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
