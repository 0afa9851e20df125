"""DAPO's batch-side helpers: overlong reward shaping and the dynamic-sampling filter and fill.

Shape legend: B sequences, G prompt groups, S samples per group (the group size).

DAPO (Yu et al., arXiv 2503.14476) = clip-higher (`policy_loss.ppo_clip_loss` with eps_high > eps_low)
+ token-level loss (`token-mean` aggregation) + the two helpers here:

Overlong reward shaping (section 3.4, eq. 13), with L_max the maximum response length and L_cache the
buffer (`overlong_buffer_len`), added to the task reward:

    R_length(|y|) = 0                                      if |y| <= L_max - L_cache
                  = ((L_max - L_cache) - |y|) / L_cache    if L_max - L_cache < |y| <= L_max
                  = -1                                     if |y| > L_max
(scaled by `penalty_factor`, 1 in the paper; verl's `overlong_penalty_factor`).

Dynamic sampling (section 3.2, eq. 11): a group whose S rewards are all equal has zero advantage under
group normalisation and gives no gradient, so it is dropped and more prompts are generated until the
batch holds `num_groups` groups with 0 < #correct < S. `fill_groups` runs that loop deterministically
over generation rounds, up to `max_rounds` (verl's `max_num_gen_batches`), keeping groups in order
(round, then group) and discarding the surplus of the last round.

The filter tests correctness, the task reward *before* the overlong shaping (the paper's #correct,
verl's `filter_groups.metric: acc`): an all-wrong group whose lengths differ would otherwise pass on
its length penalties alone and train on length. `dynamic_sampling_batch` composes the two: filter on
the task rewards, advantages of the shaped ones, and zero advantages for groups padded in at the cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate

import torch

from hpcrl.algorithms.advantages import group_advantages

ON_SHORT = ("error", "partial", "pad")


def overlong_penalty(lengths_B: torch.Tensor, max_len: int, overlong_buffer_len: int,
                     penalty_factor: float = 1.0) -> torch.Tensor:
    """DAPO's soft length penalty in [-penalty_factor, 0] for response lengths (in tokens), [B]."""
    if not 0 < overlong_buffer_len <= max_len:
        raise ValueError(f"overlong_buffer_len must be in (0, max_len={max_len}], got {overlong_buffer_len}")
    expected_len = max_len - overlong_buffer_len
    exceed_B = lengths_B.to(torch.float64) - expected_len
    penalty_B = (-exceed_B / overlong_buffer_len).clamp(min=-1.0, max=0.0) * penalty_factor
    return penalty_B.to(torch.get_default_dtype())


def groups_with_signal(rewards_GS: torch.Tensor) -> torch.Tensor:
    """True for the groups whose rewards are not all equal (non-zero variance), [G]. A group of one
    sample is kept, as verl does (it has no group statistics to be degenerate in)."""
    if rewards_GS.shape[1] == 1:
        return torch.ones(rewards_GS.shape[0], dtype=torch.bool)
    return rewards_GS.amax(dim=1) != rewards_GS.amin(dim=1)


@dataclass(frozen=True)
class FillResult:
    """The outcome of `fill_groups`: `kept` lists (round, group-in-round) in batch order."""

    kept: list[tuple[int, int]]
    num_groups_wanted: int
    num_rounds: int
    num_groups_generated: int
    num_groups_dropped: int
    num_groups_surplus: int
    num_groups_padded: int

    @property
    def filled(self) -> bool:
        """Whether the batch is full of groups with signal (no padding, not partial)."""
        return self.num_groups_padded == 0 and len(self.kept) == self.num_groups_wanted

    def metrics(self) -> dict[str, float]:
        """Scalars for the step's log (prefix `dynamic_sampling/` is the caller's choice)."""
        generated = max(self.num_groups_generated, 1)
        return {"rounds": float(self.num_rounds), "groups_generated": float(self.num_groups_generated),
                "groups_dropped": float(self.num_groups_dropped),
                "groups_dropped_frac": self.num_groups_dropped / generated,
                "groups_surplus": float(self.num_groups_surplus),
                "groups_padded": float(self.num_groups_padded), "groups_kept": float(len(self.kept))}


def fill_groups(generate_round: Callable[[int], torch.Tensor], num_groups: int, max_rounds: int,
                on_short: str = "error",
                keep_fn: Callable[[torch.Tensor], torch.Tensor] = groups_with_signal) -> FillResult:
    """Call `generate_round(r)` for r = 0, 1, ... (each returns that round's rewards [G_r, S]) until
    `num_groups` groups pass `keep_fn`, or `max_rounds` rounds were generated. Deterministic: the kept
    groups are the first passing ones in (round, group) order; the rest of the last round is surplus.

    If the cap is hit first, `on_short` decides: `error` raises, `partial` returns fewer groups, `pad`
    tops the batch up with the earliest dropped groups (zero advantage under group normalisation, so
    no gradient, but a fixed batch shape; counted in `num_groups_padded`).
    """
    if on_short not in ON_SHORT:
        raise ValueError(f"on_short={on_short!r}; valid: {', '.join(ON_SHORT)}")
    if num_groups < 1 or max_rounds < 1:
        raise ValueError(f"need num_groups >= 1 and max_rounds >= 1, got {num_groups}, {max_rounds}")
    kept: list[tuple[int, int]] = []
    dropped: list[tuple[int, int]] = []
    generated = surplus = rounds = 0
    while len(kept) < num_groups and rounds < max_rounds:
        keep_G = keep_fn(generate_round(rounds))
        for g, keep in enumerate(keep_G.tolist()):
            if not keep:
                dropped.append((rounds, g))
            elif len(kept) < num_groups:
                kept.append((rounds, g))
            else:
                surplus += 1
        generated += keep_G.shape[0]
        rounds += 1
    padded = 0
    if len(kept) < num_groups:
        if on_short == "error":
            raise RuntimeError(f"dynamic sampling kept {len(kept)} of {num_groups} groups after "
                               f"max_rounds={max_rounds} rounds ({len(dropped)} of {generated} groups had "
                               f"equal rewards); raise max_rounds or use on_short='pad' or 'partial'")
        if on_short == "pad":
            padded = min(num_groups - len(kept), len(dropped))
            kept = kept + dropped[:padded]
    return FillResult(kept=kept, num_groups_wanted=num_groups, num_rounds=rounds,
                      num_groups_generated=generated,
                      num_groups_dropped=len(dropped), num_groups_surplus=surplus, num_groups_padded=padded)


@dataclass(frozen=True)
class DynamicBatch:
    """A DAPO step's batch: `rows` index the concatenation of the rounds' completions (batch order);
    the other tensors are [B] over those rows."""

    rows: list[int]
    rewards: torch.Tensor
    """The task rewards (what the filter tested), float64."""
    shaped: torch.Tensor
    """The rewards with the overlong penalty added (what the advantages are of), float64."""
    advantages: torch.Tensor
    """Group advantages of `shaped`; exactly 0 on the groups padded in at the round cap."""
    fill: FillResult


def dynamic_sampling_batch(generate_round: Callable[[int], tuple[torch.Tensor, torch.Tensor]],
                           group_size: int, num_groups: int, max_rounds: int, max_len: int,
                           overlong_buffer_len: int = 0, penalty_factor: float = 1.0,
                           norm_by_std: bool = True, on_short: str = "pad") -> DynamicBatch:
    """DAPO's dynamic sampling with overlong shaping. `generate_round(r)` returns round r's task
    rewards [N_r] and response lengths [N_r] (N_r a multiple of `group_size`, groups contiguous).
    Groups are kept on their task rewards (`groups_with_signal`: not all equal) by `fill_groups`;
    the kept groups' advantages are `group_advantages` of the task reward plus
    `overlong_penalty(length, max_len, overlong_buffer_len, penalty_factor)` (no shaping when
    `overlong_buffer_len` is 0). Padded groups (on_short="pad") get zero advantages: their task
    rewards are all equal, and their length penalties alone must not train the policy."""
    task: list[torch.Tensor] = []
    shaped: list[torch.Tensor] = []

    def filtered_round(r: int) -> torch.Tensor:
        rewards_N, lengths_N = generate_round(r)
        rewards_N = rewards_N.to(torch.float64)
        task.append(rewards_N)
        shaped.append(rewards_N + overlong_penalty(lengths_N, max_len, overlong_buffer_len,
                                                   penalty_factor).to(torch.float64)
                      if overlong_buffer_len else rewards_N)
        return rewards_N.reshape(-1, group_size)  # correctness decides, before the length shaping

    fill = fill_groups(filtered_round, num_groups, max_rounds, on_short)
    starts = list(accumulate((len(t) for t in task), initial=0))  # each round's first row
    rows = [starts[r] + g * group_size + i for r, g in fill.kept for i in range(group_size)]
    rewards, shaped_B = torch.cat(task)[rows], torch.cat(shaped)[rows]
    advantages = group_advantages(shaped_B, group_size, norm_by_std)
    if fill.num_groups_padded:  # the padded groups are the last ones kept
        advantages[len(rows) - fill.num_groups_padded * group_size:] = 0.0
    return DynamicBatch(rows=rows, rewards=rewards, shaped=shaped_B, advantages=advantages, fill=fill)
