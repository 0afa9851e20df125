"""A one-process gloo world for benchmarks of one trainer rank, and their alternating step timings."""

from __future__ import annotations

import datetime
import statistics
import time
from typing import Any

import torch


def one_rank_world() -> None:
    """torch.distributed with one gloo rank (what MegatronPolicy needs), one torch thread."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=600))


def median_steps(policies: dict[str, Any], batch: Any, adv: torch.Tensor, reps: int) -> dict[str, float]:
    """Each policy's median on-policy train_step time over `reps` rounds, the policies alternating
    within each round (the machine's drift hits all alike)."""
    times: dict[str, list[float]] = {name: [] for name in policies}
    for _ in range(reps):
        for name, policy in policies.items():
            t0 = time.perf_counter()
            policy.train_step(batch, adv, on_policy=True)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}
