"""The controller's step loop (rank 0). It reads like the algorithm; every phase lives elsewhere.

    sampler --prompts--> RolloutGroup --(HTTP /generate)--> engines
                              | tokens + engine log-probs
                              v
    RewardPool (reward_fn(prompt, completion, answer, extra) in worker processes, deadline)
                              | rewards (a reward error scores 0, counted in reward/errors)
                              v
                         group advantages
                              |
    PolicyGroup.ref_logprobs (Megatron, frozen reference; only with a KL penalty)
                              |
    PolicyGroup.train (GRPO loss, DDP, Adam; its forward gives the old log-probs: one update
                       per batch, so ratio = 1) --> sync check: trainer vs engine log-probs
                              |
    PolicyGroup.push_weights (Megatron shards -> HF tensors -> weight-update group -> engines)
                              |
    Evaluator (every eval.interval_steps: held-out prompts -> engines -> rewards -> val/*)
                              |
    MetricsLogger.log --> Checkpointer.maybe_save
"""

from __future__ import annotations

import time

import torch

from hpcrl.algorithms.grpo import group_advantages
from hpcrl.controller.session import Session
from hpcrl.controller.sync_check import logprob_max_abs_diff


class PhaseTimer:
    """Accumulates wall time per named phase: `with timer("train"): ...`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._name = ""

    def __call__(self, name: str) -> PhaseTimer:
        self._name = name
        return self

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.seconds[self._name] = time.perf_counter() - self._t0


def run(s: Session) -> None:
    """Train `s.job.algorithm.num_steps` GRPO steps from the checkpointer's resume step."""
    job = s.job
    algo, temperature = job.algorithm, job.rollout.temperature
    for step in range(s.checkpointer.resume_step(), algo.num_steps):
        t = PhaseTimer()
        step_t0 = time.perf_counter()
        s.phase(step, "generate")
        with t("rollout"):
            rollout = s.generate(step)
        s.phase(step, "reward")
        with t("reward"):
            rewards, reward_errors = s.score(step, rollout)
        advantages = group_advantages(torch.from_numpy(rewards), algo.group_size,
                                      algo.norm_adv_by_std).numpy()
        ref_BT = None
        if algo.kl_coef > 0:
            s.phase(step, "logprobs")
            with t("logprobs"):
                ref_BT = s.policy.ref_logprobs(step, rollout, temperature)
        s.phase(step, "train")
        with t("train"):
            train = s.policy.train(step, rollout, advantages, ref_BT, temperature)
        sync_diff = logprob_max_abs_diff(rollout, train.logprobs_BT, job.rollout.logprob_tolerance, step)
        s.phase(step, "sync")
        with t("sync"):
            sync = s.policy.push_weights(step)
        val = s.evaluate(step)
        s.metrics.log(step, {
            "reward/mean": float(rewards.mean()),
            "reward/std": float(rewards.std()),
            "reward/errors": reward_errors,
            "data/dropped_prompts": len(s.sampler.dropped(step)),
            "rollout/tokens": rollout.num_tokens,
            "rollout/response_len": rollout.num_tokens / len(rollout.response_ids),
            **{f"train/{k}": v for k, v in train.metrics.items()},
            "sync/bytes": sync["bytes"],
            "sync/gbps": sync["bytes"] * 8 / 1e9 / max(sync["seconds"], 1e-9),
            "sync/logprob_max_abs_diff": sync_diff,
            **{f"timing/{k}_s": round(v, 6) for k, v in t.seconds.items()},
            "timing/step_s": round(time.perf_counter() - step_t0, 6),
            **val,
        })
        s.checkpointer.maybe_save(step)

