"""The engines' MoE routes (rollout.routing_replay r3), from their answers to the trainer's batch.

SGLang 0.5.23 (started with --enable-return-routed-experts, asked with `return_routed_experts`)
answers each completion with `meta_info["routed_experts"]`: base64 of little-endian int32, C-order
[P + R - 1, num_hidden_layers, top_k], the experts every token that was a forward input went to
(dense layers' rows are zeros; dev/notes_routing_replay.md). `RouteFormat.decode` keeps the MoE
layers' columns in the smallest integer type that holds the expert ids (uint8 up to 256 experts):
Qwen3-30B-A3B's 48 layers x top-8 are 384 bytes per token, against 1.5 KB as int32. The arrays then
travel by reference through `Rollout.select` / `concat` and to the trainer (TrainBatch.routes_BLNK).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hpcrl.rollout.client import ROUTED_EXPERTS_FLAG, decode_routed_experts


class RoutesError(ValueError):
    """An engine answer without routes, or with routes that do not fit the completion."""


@dataclass(frozen=True)
class RouteFormat:
    """What the engines' routes look like for one model: its decoder layers, the MoE ones among
    them, top_k and the expert count."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @staticmethod
    def of(dims) -> RouteFormat:  # dims: moe.hf_megatron.HFModelDims
        return RouteFormat(dims.num_layers, tuple(dims.moe_layers), dims.top_k, dims.num_experts)

    @property
    def dtype(self) -> np.dtype:
        return np.dtype(np.uint8 if self.num_experts <= 256 else np.int16)

    def bytes_per_token(self) -> int:
        return len(self.moe_layers) * self.top_k * self.dtype.itemsize

    def decode(self, meta_info: dict, num_tokens: int, where: str) -> np.ndarray:
        """[num_tokens - 1, MoE layers, top_k] in `dtype` from one answer's meta_info (num_tokens:
        prompt + completion); RoutesError naming `where` when the routes are missing or misshapen."""
        try:
            full = decode_routed_experts(meta_info, self.num_layers, self.top_k)
        except ValueError as exc:
            raise RoutesError(f"{where}: {exc}") from None
        if full is None:
            raise RoutesError(f"{where}: the engine answered without meta_info.routed_experts although "
                              f"rollout.routing_replay asks for them; SGLang returns them only when started with "
                              f"{ROUTED_EXPERTS_FLAG} (hpcrl adds it: check rollout.server_args)")
        if full.shape[0] != num_tokens - 1:
            raise RoutesError(f"{where}: routes of {full.shape[0]} tokens, expected (tokens - 1) x layers x top_k = "
                              f"{num_tokens - 1} x {self.num_layers} x {self.top_k}")
        routes = full[:, list(self.moe_layers)]
        if routes.size and (routes.min() < 0 or routes.max() >= self.num_experts):
            raise RoutesError(f"{where}: expert ids outside [0, {self.num_experts})")
        twice = np.argwhere((np.diff(np.sort(routes, axis=-1), axis=-1) == 0).any(axis=-1))
        if len(twice):  # SGLang's rows of layers it did not capture are zeros: K times expert 0
            token, j = twice[0]
            raise RoutesError(f"{where}: token {token} goes to one expert twice in MoE layer "
                              f"{self.moe_layers[j]} ({routes[token, j].tolist()}); a top-{self.top_k} route names "
                              f"{self.top_k} distinct experts (an engine serving another model, or a layer it "
                              "did not capture)")
        return routes.astype(self.dtype)
