"""The reference engine's shard-to-shard weight route: POST /hpcrl/update_weights_reshard.

An hpcrl extension (SGLang has no such route; `rollout.backend: sglang` uses the broadcast path).
The trainer ranks and the engines already share a process group made by the SGLang route
/init_weights_update_group (trainer rank t is group rank t, engine i is T + i). The request names the
group and carries the plan's inputs -- both layouts and the memory budget -- rather than the plan:
planning is deterministic, so the engine computes the same plan from the same inputs and its own
model config, and the model spec's fingerprint guards against the two sides planning different
models. The engine then runs `moe.runtime.reshard` as rollout rank `engine_rank`, receiving into
buffers it keeps across syncs, and loads the tensors into its model.

Request: {"group_name", "engine_rank", "trainer": {TrainerLayout fields}, "rollout": {RolloutLayout
fields}, "memory_budget_bytes", "topology"?: {moe.network.Topology fields}, "spec_sha256",
"deadline_s", "weight_version"?}. Answer: SGLang's {"success", "message"}; a failure leaves the old
weights in place.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from moe.layouts import RolloutLayout, TrainerLayout
from moe.network import Topology
from moe.plan import Plan, plan
from moe.specs import MoESpec, spec_at_dtype  # noqa: F401  (the engine builds its spec here)

ROUTE = "/hpcrl/update_weights_reshard"


@dataclass(frozen=True)
class PlanRequest:
    """What both sides need to compute the same plan (hashable: it keys the plan cache)."""

    trainer: TrainerLayout
    rollout: RolloutLayout
    memory_budget_bytes: int
    topology: Topology = Topology()  # node placement the plan assumes (colocated: one host)

    def to_json(self) -> dict[str, Any]:
        return {"trainer": dataclasses.asdict(self.trainer), "rollout": dataclasses.asdict(self.rollout),
                "memory_budget_bytes": self.memory_budget_bytes, "topology": dataclasses.asdict(self.topology)}

    @staticmethod
    def from_json(req: dict[str, Any]) -> PlanRequest:
        """Raises ValueError (naming the field) for a malformed request."""
        for key, kind in (("trainer", dict), ("rollout", dict), ("memory_budget_bytes", int)):
            if not isinstance(req.get(key), kind):
                raise ValueError(f"field {key!r} must be a {kind.__name__}, got {req.get(key)!r}")
        topology = req.get("topology", {})
        if not isinstance(topology, dict):
            raise ValueError(f"field 'topology' must be a dict, got {topology!r}")
        try:
            return PlanRequest(TrainerLayout(**req["trainer"]), RolloutLayout(**req["rollout"]),
                               req["memory_budget_bytes"], Topology(**topology))
        except TypeError as exc:
            raise ValueError(f"bad layout or topology fields: {exc}") from None

    def build(self, spec: MoESpec) -> Plan:
        return _cached_plan(self, spec)


@lru_cache(maxsize=4)
def _cached_plan(request: PlanRequest, spec: MoESpec) -> Plan:
    request.trainer.validate(spec)
    request.rollout.validate(spec)
    return plan(request.trainer, request.rollout, spec, request.memory_budget_bytes, request.topology)


def spec_fingerprint(spec: MoESpec) -> str:
    """sha256 of every tensor's name, shape and dtype, in spec order."""
    rows = [[t.name, list(t.shape), str(t.dtype)] for t in spec.tensors]
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()
