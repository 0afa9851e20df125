"""The tiny model's train step with megatron_compat patch 17 (DDP's grad hooks deferred to one fold)
against Megatron's per-parameter hooks, side by side in one process.

Two MegatronPolicy instances of the tiny-qwen3-moe preset from the same seed, one built while DDP's
hook factory is Megatron's own (the function patch 17 wraps), the other with the patch; their train
steps on the same 64-row batch alternate, and each step is timed. Printed per micro-batch size: the
median step of each, the ratio, and whether the per-step metrics and the final policy hashes are
bit-identical (they must be). One torch thread, a one-rank gloo world.

    .venv/bin/python benchmarks/train_step_grad_hooks.py [--steps 100] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from unittest import mock

from results_md import append_to_section, run_heading
from tiny_train_batch import one_rank_world, tiny_rows


def _policies(micro_batch_size: int) -> tuple:
    from megatron.core.distributed import DistributedDataParallel

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer import megatron_compat
    from hpcrl.trainer.policy import MegatronPolicy

    megatron_compat.apply()
    patched = DistributedDataParallel._make_backward_post_hook
    megatrons = megatron_compat.unpatched(patched, "_make_backward_post_hook")
    hf = load_hf_config("tiny-qwen3-moe", None)

    def build():
        policy = MegatronPolicy(hf, TrainerConfig(micro_batch_size=micro_batch_size),
                                AlgorithmConfig(aux_loss_coef=0.01))
        policy.init_from_seed(1234)
        return policy

    with mock.patch.object(DistributedDataParallel, "_make_backward_post_hook", megatrons):
        hooks = build()
    return hooks, build(), hf["vocab_size"]


def _row(micro_batch_size: int, steps: int) -> str:
    from hpcrl.trainer.batch import TrainBatch

    hooks, deferred, vocab = _policies(micro_batch_size)
    prompts, responses, adv = tiny_rows(vocab)
    batch = TrainBatch.from_lists(prompts, responses)
    times: dict[str, list[float]] = {"hooks": [], "deferred": []}
    metrics: dict[str, list] = {"hooks": [], "deferred": []}
    for i in range(steps):
        for name, policy in (("hooks", hooks), ("deferred", deferred))[:: 1 if i % 2 else -1]:
            t0 = time.perf_counter()
            out = policy.train_step(batch, adv, on_policy=True)
            times[name].append(time.perf_counter() - t0)
            out.pop("logprobs_BT")
            metrics[name].append(out)
    same = metrics["hooks"] == metrics["deferred"] and hooks.policy_sha256() == deferred.policy_sha256()
    base, new = (statistics.median(times[k][5:]) * 1e3 for k in ("hooks", "deferred"))
    return f"| {micro_batch_size} | {base:.2f} | {new:.2f} | {new / base:.3f} | {'yes' if same else 'NO'} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100, help="train steps of each policy per micro-batch size")
    ap.add_argument("--results", type=Path, help="append the table under '## train_step_grad_hooks' here")
    args = ap.parse_args()
    if args.steps < 10:
        ap.error(f"--steps={args.steps}: need >= 10 (the first 5 of each are excluded)")
    one_rank_world()
    load0 = os.getloadavg()[0]
    rows = [_row(mbs, args.steps) for mbs in (64, 16)]
    text = "\n".join([
        run_heading(f".venv/bin/python benchmarks/train_step_grad_hooks.py --steps {args.steps}"), "",
        f"Tiny train step (64 rows), {args.steps} alternating steps of each policy, one torch thread; "
        f"load average (1 min) {load0:.1f} before, {os.getloadavg()[0]:.1f} after.", "",
        "| micro-batch size | Megatron's grad hooks, ms | patch 17, ms | ratio "
        "| metrics and hash identical |",
        "|---|---|---|---|---|", *rows, ""])
    print(text)
    if args.results:
        append_to_section(args.results, "## train_step_grad_hooks", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
