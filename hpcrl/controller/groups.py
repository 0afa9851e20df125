"""Controller-side handles on the worker roles, one typed method per phase of a step.

`PolicyGroup` (trainer ranks, Megatron) and `RolloutGroup` (one rank per engine) translate the
algorithm's calls into commands on the MPI control plane and merge the per-rank replies. Each
`async_*` method returns a handle whose `wait()` enforces the phase deadline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcrl.controller.comm import PendingCall, RoleGroup, World
from hpcrl.tasks import Example


@dataclass
class Rollout:
    """One step's completions, group after group (G completions of each prompt are adjacent)."""

    examples: list[Example]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    engine_logprobs: list[list[float]]
    finish_reasons: list[str]

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)

    def token_batch(self) -> dict:
        return {"prompt_ids": self.prompt_ids, "response_ids": self.response_ids}


@dataclass
class TrainResult:
    """One optimizer step: its metrics and the trainer's log-probs of the rollout's response
    tokens before the update ([B, T], zeros on padding) -- the old log-probs of the step."""

    metrics: dict[str, float]
    logprobs_BT: np.ndarray


def _leader(replies: dict[int, object]) -> object:
    """The one non-None reply (workers that hold no result answer None), or None if none has one."""
    values = [v for v in replies.values() if v is not None]
    assert len(values) <= 1, f"expected at most one result, got {len(values)}"
    return values[0] if values else None


class _Handle:
    def __init__(self, call: PendingCall, timeout_s: float, merge) -> None:
        self.call, self.timeout_s, self.merge = call, timeout_s, merge

    def wait(self):
        return self.merge(self.call.wait(self.timeout_s))


class PolicyGroup:
    """The Megatron trainer ranks."""

    def __init__(self, world: World, timeout_s: float) -> None:
        self.group = RoleGroup(world, "trainer")
        self.timeout_s = timeout_s

    def _async(self, op: str, step: int, payload: object = None) -> _Handle:
        return _Handle(self.group.async_call(op, step, payload, timeout_s=self.timeout_s), self.timeout_s,
                       _leader)

    def async_init(self, startup_timeout_s: float) -> _Handle:
        return _Handle(self.group.async_call("init", -1, None, timeout_s=startup_timeout_s),
                       startup_timeout_s, lambda replies: None)

    def connect_engines(self, engine_urls: list[str]) -> None:
        self._async("connect", -1, engine_urls).wait()

    def ref_logprobs(self, step: int, rollout: Rollout, temperature: float) -> np.ndarray:
        """Log-probs of the response tokens under the frozen reference policy, [B, T]."""
        return self._async("ref_logprobs", step, {**rollout.token_batch(), "temperature": temperature}).wait()

    def train(self, step: int, rollout: Rollout, advantages: np.ndarray, ref_BT: np.ndarray | None,
              temperature: float) -> TrainResult:
        """One on-policy optimizer step (the engines sampled with the current weights)."""
        payload = {**rollout.token_batch(), "advantages": advantages, "ref_logprobs": ref_BT,
                   "temperature": temperature}
        out = self._async("train", step, payload).wait()
        return TrainResult(out["metrics"], out["logprobs"])

    def push_weights(self, step: int) -> dict[str, float]:
        """Export Megatron shards as HF tensors and broadcast them into every engine."""
        return self._async("sync", step, {"weight_version": str(step)}).wait()

    def save_checkpoint(self, ckpt_dir: str, step: int, attempt_id: str, keep: int, metadata: dict) -> None:
        """Collective save of policy, reference, Adam state and RNG; committed when this returns."""
        self._async("save", step, {"dir": ckpt_dir, "attempt_id": attempt_id, "keep": keep,
                                   "metadata": metadata}).wait()

    def load_checkpoint(self, ckpt_dir: str, step: int) -> dict:
        """Collective load (any saved layout); returns the checkpoint's metadata."""
        return self._async("load", step, {"dir": ckpt_dir}).wait()

    def policy_sha256(self, step: int) -> str:
        return self._async("sha256", step).wait()

    def shutdown(self) -> None:
        self.group.call("shutdown", -1, None, timeout_s=self.timeout_s)


class RolloutGroup:
    """One rank per generation engine; prompts are split evenly across engines."""

    def __init__(self, world: World, timeout_s: float) -> None:
        self.group = RoleGroup(world, "rollout")
        self.timeout_s = timeout_s

    def async_init(self, startup_timeout_s: float) -> _Handle:
        def urls(replies: dict[int, object]) -> list[str]:
            return [replies[r] for r in sorted(replies)]

        return _Handle(self.group.async_call("init", -1, None, timeout_s=startup_timeout_s),
                       startup_timeout_s, urls)

    def generate(self, step: int, examples: list[Example], prompt_ids: list[list[int]],
                 sampling_params: list[dict]) -> Rollout:
        ranks = self.group.ranks
        bounds = np.linspace(0, len(prompt_ids), len(ranks) + 1).astype(int)
        per_rank = {rank: {"input_ids": prompt_ids[lo:hi], "sampling_params": sampling_params[lo:hi]}
                    for rank, lo, hi in zip(ranks, bounds[:-1], bounds[1:])}
        replies = self.group.call("generate", step, None, self.timeout_s, per_rank=per_rank)
        outs = [o for rank in ranks for o in replies[rank]]
        return Rollout(examples, prompt_ids, [o["output_ids"] for o in outs], [o["logprobs"] for o in outs],
                       [o["finish_reason"] for o in outs])

    def shutdown(self) -> None:
        self.group.call("shutdown", -1, None, timeout_s=self.timeout_s)
