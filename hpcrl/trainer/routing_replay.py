"""MoE routing replay in the trainer: each MoE layer routes every token to the experts a batch says
(rollout.routing_replay r3: the engine's routes), through megatron-core 0.16.1's RouterReplay.

With `moe_enable_routing_replay` every TopKRouter of the policy owns a `RouterReplay`. Before each
micro-batch's forward, `Replay.before_forward` gives each of this rank's routers its rows of the
micro-batch's `routes` [mb, L, N, K] (N: the model's MoE layers, j-th = Megatron's router of global
layer `first_dense_layers + j`): the layer's [mb, L, K] slice, sequence-major as the router sees its
tokens ([L, mb] flattened; under sequence parallelism this TP rank's contiguous L / TP chunk), int64.
The router then gathers its scores at those experts (REPLAY_FORWARD; group-limited routing and the
expert bias do not choose, the routed scaling still applies) and the backward reuses that routing
map. The aux loss keeps the router's own top-k (Megatron computes it separately).

`Replay` also observes what every router did (a forward hook on its routing map), so the trainer
can say how often its routes equal the engine's (`router_agreement`), replaying or not, and tests
can compare the experts used with the experts given.
"""

from __future__ import annotations

from typing import Any

import torch


class Replay:
    """The routing replay of one policy model on this rank (its pipeline stage's MoE layers)."""

    def __init__(self, gpt: torch.nn.Module, first_dense_layers: int, tp: int, tp_rank: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        self.tp, self.tp_rank = tp, tp_rank
        self.routers: list[tuple[int, Any]] = []  # (moe layer index j, TopKRouter)
        for module in gpt.modules():
            if isinstance(module, TopKRouter):
                self.routers.append((module.layer_number - 1 - first_dense_layers, module))
        self.routers.sort(key=lambda jr: jr[0])
        self.replaying = False
        self.observed: dict[int, list[torch.Tensor]] | None = None
        for j, router in self.routers:
            router.register_forward_hook(self._observe_hook(j))

    @property
    def enabled(self) -> bool:
        """Whether the model was built with Megatron's routing replay (rollout.routing_replay != none)."""
        return bool(self.routers) and getattr(self.routers[0][1], "router_replay", None) is not None

    def local_rows(self, routes_BLNK: torch.Tensor, j: int) -> torch.Tensor:
        """MoE layer j's routes of a micro-batch as its router sees the tokens: [L * mb, K] sequence-major,
        this TP rank's sequence chunk under sequence parallelism, int64."""
        rows_LBK = routes_BLNK[:, :, j].transpose(0, 1)
        if self.tp > 1:
            chunk = rows_LBK.shape[0] // self.tp
            rows_LBK = rows_LBK[self.tp_rank * chunk: (self.tp_rank + 1) * chunk]
        return rows_LBK.reshape(-1, rows_LBK.shape[-1]).long()

    def before_forward(self, routes_BLNK: torch.Tensor | None) -> None:
        """Set this micro-batch's routes on every router of this stage (REPLAY_FORWARD), or route
        freely when `routes_BLNK` is None."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if not self.enabled:
            return
        self.replaying = routes_BLNK is not None
        for j, router in self.routers:
            replay = router.router_replay
            if routes_BLNK is None:
                replay.clear_router_replay_action()
                continue
            replay.set_target_indices(self.local_rows(routes_BLNK, j).to(router.weight.device))
            replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def clear(self) -> None:
        """After a forward(-backward) pass: drop the targets (RouterReplay keeps a list of every set
        target for its recompute path) and route freely."""
        for _, router in self.routers:
            replay = getattr(router, "router_replay", None)
            if replay is not None:
                replay.clear_indices()
                replay.clear_router_replay_action()
        self.replaying = False

    # -- observation -------------------------------------------------------------------------------

    def observe(self) -> None:
        """Start collecting the experts each router of this stage uses, per forward (`observed_routes`)."""
        self.observed = {j: [] for j, _ in self.routers}

    def observed_routes(self) -> dict[int, list[torch.Tensor]]:
        """MoE layer j -> one bool routing map [tokens, E] per forward since `observe`, and stop."""
        out, self.observed = self.observed or {}, None
        return out

    def _observe_hook(self, j: int) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if self.observed is not None:
                self.observed[j].append(output[1].detach().cpu())
        return hook


def agreement(routing_map_TE: torch.Tensor, wanted_TK: torch.Tensor, real_T: torch.Tensor) -> tuple[int, int]:
    """(rows whose expert set equals the wanted one, rows compared) over the rows `real_T` marks: the
    router's bool map [T, E] against wanted expert ids [T, K]."""
    want_TE = torch.zeros_like(routing_map_TE).scatter_(1, wanted_TK.long(), True)
    same_T = (want_TE == routing_map_TE).all(dim=1)
    return int((same_T & real_T).sum()), int(real_T.sum())
