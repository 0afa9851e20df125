"""hpcrl.trainer.lr_schedule: the lr per RL step is Megatron's OptimizerParamScheduler's formula
(warmup from 0, linear / cosine decay to min_lr_ratio * lr over algorithm.num_steps), set on every
param group with its weight-decay multiplier kept; the default builds no scheduler."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hpcrl.config.schema import AlgorithmConfig
from hpcrl.trainer.lr_schedule import LRSchedule

pytestmark = pytest.mark.timeout(60)


def _adam(lr: float = 0.5, wd: float = 0.1) -> torch.optim.Optimizer:
    """Two param groups as Megatron makes them: decayed weights, and norms/biases (wd_mult 0)."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(2))], "wd_mult": 1.0, "weight_decay": wd},
              {"params": [torch.nn.Parameter(torch.ones(2))], "wd_mult": 0.0, "weight_decay": 0.0}]
    return torch.optim.Adam(groups, lr=lr)


def _lrs(style: str, warmup: int = 0, ratio: float = 0.0, steps: int = 10) -> list[float]:
    a = dataclasses.replace(AlgorithmConfig(), lr_schedule=style, lr_warmup_steps=warmup, min_lr_ratio=ratio,
                            num_steps=steps)
    opt = _adam()
    sched = LRSchedule(opt, 0.5, 0.1, a)
    out = [sched.at(s) for s in range(steps)]
    assert all(g["lr"] == out[-1] for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    return out


def test_linear_and_cosine_decay_to_the_floor_over_the_run():
    assert _lrs("linear") == pytest.approx([0.5 * (1 - s / 10) for s in range(10)])
    assert _lrs("linear", ratio=0.2) == pytest.approx([0.1 + 0.4 * (1 - s / 10) for s in range(10)])
    assert _lrs("cosine") == pytest.approx([0.25 * (1 + math.cos(math.pi * s / 10)) for s in range(10)])


def test_warmup_from_zero_then_the_schedule():
    assert _lrs("constant", warmup=4) == pytest.approx([0.0, 0.125, 0.25, 0.375] + [0.5] * 6)
    lin = _lrs("linear", warmup=2, steps=6)
    assert lin == pytest.approx([0.0, 0.25, 0.5, 0.375, 0.25, 0.125])


def test_any_step_in_any_order_gives_its_lr():
    """A resumed run asks for step 7 first: the lr is the step's, not the call count's."""
    a = dataclasses.replace(AlgorithmConfig(), lr_schedule="linear", num_steps=10)
    sched = LRSchedule(_adam(), 0.5, 0.1, a)
    assert sched.at(7) == pytest.approx(0.15) and sched.at(3) == pytest.approx(0.35)


def test_constant_without_warmup_builds_no_scheduler():
    opt = _adam(lr=0.3)
    sched = LRSchedule(opt, 0.3, 0.1, AlgorithmConfig())
    assert sched.scheduler is None and sched.at(5) == 0.3
    assert [g["lr"] for g in opt.param_groups] == [0.3, 0.3]
