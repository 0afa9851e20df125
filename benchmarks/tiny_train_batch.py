"""The tiny train step's inputs that the train-step benchmarks share, so that they time the same
work: a one-rank gloo world on one torch thread, and 64 rows of the copy task's shape."""

from __future__ import annotations

import datetime

import torch


def one_rank_world() -> None:
    """One torch thread and a one-rank gloo world (what MegatronPolicy needs to be built)."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))


def tiny_rows(vocab: int) -> tuple[list[list[int]], list[list[int]], torch.Tensor]:
    """64 prompts of 2 tokens, responses of 1-4 tokens and their advantages, drawn from seed 0."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (2,), generator=g).tolist() for _ in range(64)]
    responses = [torch.randint(3, vocab, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(64)]
    return prompts, responses, torch.randn(64, generator=g)
