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

Under activation recomputation (trainer.recompute_granularity full, or selective with moe) a router
runs again in the backward, for a micro-batch whose forward may lie several forwards back (the
pipeline schedule's warm-up runs forwards ahead): it then replays the oldest target not yet
recomputed (REPLAY_BACKWARD; RouterReplay keeps every target set, in order, and the backwards come in
the forwards' order), and neither counts nor observes, as the forward did both.

`Replay` also observes what every router did (a forward hook on its routing map), so the trainer
can say how often its routes equal the engine's (`router_agreement`), replaying or not, and tests
can compare the experts used with the experts given. The count stays on the routers' device until
`take_agreement`: a hook that read it back would stall a GPU at every MoE layer of every forward.
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
        self.observed: dict[int, list[torch.Tensor]] | None = None
        self.current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # j -> (engine rows, real rows)
        # counts on the routers' device while counting (no host sync)
        self.same: torch.Tensor | int = 0
        self.total: torch.Tensor | int = 0
        self._real: torch.Tensor | int = 0  # real tokens of the current micro-batch on this rank
        for j, router in self.routers:
            router.register_forward_pre_hook(_replay_action_hook)
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

    def before_forward(self, routes_BLNK: torch.Tensor | None, pad_BL: torch.Tensor, replay: bool) -> None:
        """Before a micro-batch's forward: with its engine routes, count how many of this stage's
        (token, layer) routes come out as the engine's (`pad_BL`: the batch's padding mask; a
        position routes a real token when the next one is not padding) and, with `replay`, set them
        on every router (REPLAY_FORWARD); without routes, route freely."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        self.current = {}
        if routes_BLNK is not None and self.routers:
            device = self.routers[0][1].weight.device
            real_BL = torch.cat([~pad_BL[:, 1:], torch.zeros_like(pad_BL[:, :1])], dim=1)
            real_T = self.local_rows(real_BL.unsqueeze(-1).unsqueeze(-1), 0)[:, 0].bool().to(device)
            self._real = real_T.sum()
            self.current = {j: (self.local_rows(routes_BLNK, j).to(device), real_T) for j, _ in self.routers}
        if not self.enabled:
            return
        for j, router in self.routers:
            state = router.router_replay
            if not (self.current and replay):
                state.clear_router_replay_action()
                continue
            state.set_target_indices(self.current[j][0])
            state.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def take_agreement(self) -> tuple[int, int]:
        """(token-layer routes equal to the engine's, routes compared) since the last call, this rank;
        reads the device count back (one sync)."""
        out = (int(self.same), int(self.total))
        self.same = self.total = 0
        return out

    def clear(self) -> None:
        """After a forward(-backward) pass: drop the targets (RouterReplay keeps a list of every set
        target for its recompute path) and route freely."""
        for _, router in self.routers:
            replay = getattr(router, "router_replay", None)
            if replay is not None:
                replay.clear_indices()
                replay.clear_router_replay_action()
        self.current = {}

    # -- observation -------------------------------------------------------------------------------

    def observe(self) -> None:
        """Start collecting the experts each router of this stage uses, per forward (`observed_routes`)."""
        self.observed = {j: [] for j, _ in self.routers}

    def observed_routes(self) -> dict[int, list[torch.Tensor]]:
        """MoE layer j -> one bool routing map [tokens, E] per forward since `observe` (host tensors),
        and stop."""
        out, self.observed = self.observed or {}, None
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # the hook's non-blocking copies have landed
        return out

    def _observe_hook(self, j: int) -> Any:
        def hook(module: Any, inputs: Any, output: Any) -> None:
            if recomputing():
                return
            if self.observed is not None:  # into pinned host memory from a GPU, without waiting for it
                self.observed[j].append(output[1].detach().to("cpu", non_blocking=True))
            if j in self.current:
                wanted_TK, real_T = self.current[j]
                self.same = self.same + (same_rows(output[1].detach(), wanted_TK) & real_T).sum()
                self.total = self.total + self._real
        return hook


def recomputing() -> bool:
    """Whether a checkpointed forward is being computed again, in the backward (Megatron's
    CheckpointFunction flags both passes; only the second runs with grad)."""
    from megatron.core.tensor_parallel.random import is_checkpointing

    return is_checkpointing() and torch.is_grad_enabled()


def _replay_action_hook(router: Any, inputs: Any) -> None:
    """Before a replaying router runs: the target of this forward, or in a recompute the oldest one."""
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    state = router.router_replay
    if state is not None and state.router_replay_action in (RouterReplayAction.REPLAY_FORWARD,
                                                            RouterReplayAction.REPLAY_BACKWARD):
        state.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD if recomputing()
                                       else RouterReplayAction.REPLAY_FORWARD)


def same_rows(routing_map_TE: torch.Tensor, wanted_TK: torch.Tensor) -> torch.Tensor:
    """[T] bool, on the map's device: whether each row's expert set, the router's bool map [T, E],
    equals the wanted expert ids [T, K]."""
    want_TE = torch.zeros_like(routing_map_TE).scatter_(1, wanted_TK.long(), True)
    return (want_TE == routing_map_TE).all(dim=1)


def agreement(routing_map_TE: torch.Tensor, wanted_TK: torch.Tensor, real_T: torch.Tensor) -> tuple[int, int]:
    """(rows whose expert set equals the wanted one, rows compared) over the rows `real_T` marks
    (`same_rows`), as ints."""
    return int((same_rows(routing_map_TE, wanted_TK) & real_T).sum()), int(real_T.sum())
