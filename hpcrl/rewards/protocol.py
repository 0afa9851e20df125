"""The reward hook's contract."""

from __future__ import annotations

from typing import Any, Protocol


class RewardFn(Protocol):
    """A verifiable reward: score one completion of one prompt against its reference answer.

    `extra` holds the data row's other columns (everything but the prompt and the answer; {} for
    the synthetic tasks), e.g. a test suite or a rubric. A function written without `extra`,
    `def reward(prompt, completion, answer)`, is accepted too: the loader inspects the signature
    once and calls it with three arguments.

    Runs in a reward worker process on the controller's node (`reward.num_workers` of them), once
    per completion, under the deadline `reward.timeout_s`. Must be deterministic and return a
    finite float (conventionally in [0, 1]). A call that raises, returns a non-number or NaN, or
    runs past its deadline scores 0 and is counted in the `reward/errors` metric; the run goes on.
    Module-level state is per worker: a worker may be replaced (after a hang) at any time.

    Optional: a `warm_up` attribute, a callable without arguments that each worker calls once after
    loading the reward, before any deadline (heavy imports, loading a verifier); if it raises, the
    run stops with its traceback.
    """

    def __call__(self, prompt: str, completion: str, answer: str,
                 extra: dict[str, Any] | None = None) -> float: ...
