"""The learning rate of the policy's and the critic's Adam over a run: Megatron-core's
OptimizerParamScheduler (linear warmup from 0, then constant, linear or cosine decay to
`min_lr_ratio * lr`), indexed by the RL step.

Every optimizer step of RL step s (all epochs and mini-batches of its update) runs at the
scheduler's lr at s, over `algorithm.num_steps` steps: step 0 at 0 when there is a warmup (as
Megatron's first iteration), the last step just above the floor. The lr is a function of the step
alone, so a run resumed from a checkpoint, on any layout, continues the same schedule without
state of its own. The critic follows the same shape with its own peak (`critic.lr`).

`constant` without warmup (the default) builds no scheduler: the optimizer keeps the lr it was made
with, as before schedules existed.
"""

from __future__ import annotations

from typing import Any


class LRSchedule:
    """The lr of one Megatron optimizer, set per RL step (collective-free, the same on every rank)."""

    def __init__(self, optimizer: Any, lr: float, weight_decay: float, algorithm: Any) -> None:
        self.lr = lr
        self.scheduler = None
        if algorithm.lr_schedule != "constant" or algorithm.lr_warmup_steps > 0:
            from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

            min_lr = lr * algorithm.min_lr_ratio
            for group in optimizer.param_groups:  # Megatron's per-group bounds (made for a constant lr)
                group["max_lr"], group["min_lr"] = lr, min_lr
            self.scheduler = OptimizerParamScheduler(
                optimizer, init_lr=0.0, max_lr=lr, min_lr=min_lr, lr_warmup_steps=algorithm.lr_warmup_steps,
                lr_decay_steps=algorithm.num_steps, lr_decay_style=algorithm.lr_schedule,
                start_wd=weight_decay, end_wd=weight_decay, wd_incr_steps=algorithm.num_steps,
                wd_incr_style="constant")

    def at(self, step: int) -> float:
        """Set the optimizer's lr for RL step `step` and return it."""
        if self.scheduler is None:
            return self.lr
        self.scheduler.num_steps = step
        self.scheduler.step(0)
        return float(self.scheduler.optimizer.param_groups[0]["lr"])
