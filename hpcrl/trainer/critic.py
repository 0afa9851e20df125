"""PPO's critic: a Megatron value model on the trainer ranks, beside the policy.

Megatron's parallel state is global per process, so the critic has the policy's layout
(TP/PP/EP/ETP/DP) and lives on the same ranks; `hpcrl plan` counts a second model, its gradients and
its Adam state there. The body is a second GPTModel of the policy's architecture, initialised from
the policy's weights (a local copy of each rank's own shards) or read from `critic.path` (a directory
of the policy's architecture, or a one-label reward model of it, whose `score` head then starts the
value head). On the last pipeline stage the
vocabulary projection is replaced by a value head: one [H] weight and a bias, replicated, applied to
the final hidden states of the whole sequence (gathered from the sequence-parallel split under TP;
every TP rank then computes the same values, so the gather's backward keeps each rank's own chunk).

V_t, the value of the state before response token t, is the head's output at the position whose
logits predict token t (hpcrl/trainer/batch.py), as in verl and OpenRLHF. The critic reuses the
policy's batch split, pipeline schedule and gathers (MegatronPolicy._split, _run, _gather_rows).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from hpcrl.algorithms.aggregation import aggregate
from hpcrl.algorithms.value import value_loss
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.lr_schedule import LRSchedule
from hpcrl.trainer.model import build_gpt_model, transformer_config, weight_tensors

HEAD_NAMES = ("value_head.weight", "value_head.bias")  # checkpoint names, under critic/
METRICS = ("vf_loss", "vf_clip_frac", "values_mean")


class ValueHead(torch.nn.Module):
    """Replaces GPTModel.output_layer: hidden [S/tp, B, H] -> values [S, B, 1] (same call signature)."""

    def __init__(self, hidden_size: int, seed: int, std: float) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(hidden_size, generator=gen) * std)
        self.bias = torch.nn.Parameter(torch.zeros(1))

    def forward(self, hidden_SBH: torch.Tensor, weight: Any = None, runtime_gather_output: Any = None
                ) -> tuple[torch.Tensor, None]:
        from megatron.core import parallel_state
        from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

        full = gather_from_sequence_parallel_region(hidden_SBH, tensor_parallel_output_grad=False,
                                                    group=parallel_state.get_tensor_model_parallel_group())
        return (full @ self.weight + self.bias).unsqueeze(-1), None


class MegatronCritic:
    """The value model of `policy`'s ranks (collective: construct on every trainer rank after the
    policy's weights are loaded). `critic` is the job's CriticConfig, `algorithm` its AlgorithmConfig."""

    def __init__(self, policy: Any, critic: Any, algorithm: Any) -> None:
        from hpcrl.trainer.policy import ddp_and_adam

        self.policy, self.cfg, self.algorithm = policy, critic, algorithm
        hf_config = {**policy.hf_config, "tie_word_embeddings": False}  # the head replaces the projection
        config = transformer_config(hf_config, **policy.layout)
        gpt = build_gpt_model(hf_config, config)
        if policy.last_stage:
            std = float(policy.hf_config.get("initializer_range", 0.02))
            # made after build_gpt_model moved the body: on its device and in its dtype (a bf16 run's
            # distributed optimizer would move it anyway; an fp32 run's plain Adam never does)
            gpt.output_layer = ValueHead(policy.dims.hidden_size, policy.trainer.seed + 2, std).to(
                device=policy.device, dtype=config.params_dtype)
        if critic.path:  # each rank reads only its own slices of the directory
            from hpcrl.trainer import weight_init
            from moe.hf_checkpoint import HFCheckpoint

            with HFCheckpoint(critic.path, policy.dims, score_head=True) as ckpt, torch.no_grad():
                weight_init.load(policy, ckpt.read, [gpt], skip="output_layer.")
                if ckpt.score_names and policy.last_stage:  # a reward model: its head starts the value head
                    gpt.output_layer.weight.copy_(ckpt.read("score.weight")[0])
                    gpt.output_layer.bias.copy_(ckpt.read("score.bias") if "score.bias" in ckpt.score_names
                                                else torch.zeros(1))
        else:
            with torch.no_grad():
                own = weight_tensors(policy.gpt)
                for name, param in weight_tensors(gpt).items():
                    if not name.startswith("output_layer."):
                        param.copy_(own[name])
        self.gpt = gpt
        self.ddp, self.optimizer = ddp_and_adam(gpt, config, policy.device, lr=critic.lr,
                                                weight_decay=critic.weight_decay,
                                                betas=(algorithm.adam_beta1, algorithm.adam_beta2),
                                                eps=algorithm.adam_eps, grad_clip=critic.grad_clip)
        self.lr_schedule = LRSchedule(self.optimizer, critic.lr, critic.weight_decay, algorithm)

    @torch.no_grad()
    def sha256(self) -> str | None:
        """The critic's layout-independent hash on rank 0 (None elsewhere): the policy hash's
        definition (docs/policy_hash.md) over the body's HF tensors without lm_head, plus
        `value_head.weight` and `value_head.bias`. Collective, no gather."""
        from moe.slices import Box

        p = self.policy
        shapes = {n: s for n, s in p.dims.hf_shapes().items() if n != "lm_head.weight"}
        shapes.update({HEAD_NAMES[0]: (p.dims.hidden_size,), HEAD_NAMES[1]: (1,)})
        params = weight_tensors(self.gpt)
        # each HF region from its first holder, as the policy's; one replica of the head
        pieces = [(pc.hf_name, params[n].detach()[pc.local_box.index], pc.hf_box)
                  for n, pc in p._export_plan[p.rank] if not n.startswith("output_layer.") and n in params]
        head = self.head()
        if head is not None and p.coords.tp_rank == 0 and p.dp_rank == 0:
            pieces += [(name, param.detach(), Box.full(shapes[name]))
                       for name, param in zip(HEAD_NAMES, (head.weight, head.bias))]
        return p.sharded_hash(shapes, next(iter(params.values())).dtype, pieces)

    def head(self) -> ValueHead | None:
        """This rank's value head (last pipeline stage only)."""
        return self.gpt.output_layer if self.policy.last_stage else None

    @staticmethod
    def _values_BT(mbd: dict[str, torch.Tensor], values_BL1: torch.Tensor) -> torch.Tensor:
        v_BT = values_BL1[..., 0].gather(1, mbd["pos_BT"])
        return torch.where(mbd["mask_BT"], v_BT, 0.0)

    def _values_out(self, mbd: dict[str, torch.Tensor], values_BL1: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return values_BL1.new_zeros(()), {"v_BT": self._values_BT(mbd, values_BL1)}

    @torch.no_grad()
    def values(self, batch: TrainBatch | None) -> torch.Tensor | None:
        """Float32 [B, T] values of the response positions (0 on padding), on rank 0; None elsewhere."""
        p = self.policy
        batch, _ = p._share(batch, {})
        mbs, split = p._split(batch, {}, forward_only=True)
        store = p._run(self.ddp, mbs, split, True, self._values_out)
        return p._gather_rows(store, "v_BT", split, batch)

    def _loss(self, num_tokens: int, num_seqs: int, scale: int, mbd: dict[str, torch.Tensor],
              values_BL1: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        v_BT = self._values_BT(mbd, values_BL1)
        mask_BT = mbd["mask_BT"]
        loss_BT, m = value_loss(v_BT, mbd["oldv_BT"], mbd["ret_BT"], self.cfg.value_clip or None)
        a = self.algorithm
        loss = aggregate(loss_BT, mask_BT, a.loss_agg, num_tokens, num_seqs, a.loss_agg_norm or None)
        clip = aggregate(m["vf_clip_frac"], mask_BT, "token-mean", num_tokens)
        mean_v = aggregate(v_BT.detach(), mask_BT, "token-mean", num_tokens)
        return loss * scale, {"metrics": torch.stack([loss.detach(), clip, mean_v]).float()}

    def train_step(self, batch: TrainBatch | None, returns_BT: torch.Tensor | None,
                   old_values_BT: torch.Tensor | None) -> dict[str, float] | None:
        """One optimizer step of the clipped value loss (critic.value_clip) over the batch; metrics
        (vf_loss, vf_clip_frac, values_mean, grad_norm) on rank 0, None elsewhere."""
        p = self.policy
        batch, t = p._share(batch, {"ret": returns_BT, "oldv": old_values_BT})
        B, T = batch.batch_size, batch.response_width
        for name, v in (("returns_BT", t["ret"]), ("old_values_BT", t["oldv"])):
            if v is None or tuple(v.shape) != (B, T):
                raise ValueError(f"{name} has shape {None if v is None else tuple(v.shape)}, expected {(B, T)}")
        mbs, split = p._split(batch, {"ret_BT": t["ret"].float(), "oldv_BT": t["oldv"].float()})
        if not self.ddp.training:
            self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        loss_fn = partial(self._loss, max(batch.num_response_tokens(), 1), B, split.num_micro_batches * p.dp_size)
        store = p._run(self.ddp, mbs, split, False, loss_fn)
        _, grad_norm, _ = self.optimizer.step()
        local = torch.zeros(len(METRICS), dtype=torch.float32)
        if p._counts_here():
            for d in store:
                local += d["metrics"].detach().cpu()
        summed = p._to_rank0(local)
        if summed is None:
            return None
        out = {name: float(v) for name, v in zip(METRICS, summed)}
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        return out

    def update(self, batch: TrainBatch | None, returns_BT: torch.Tensor | None,
               old_values_BT: torch.Tensor | None, epochs: int = 1, mini_batch_size: int = 0
               ) -> dict[str, float] | None:
        """`epochs` passes over the batch in contiguous mini-batches of `mini_batch_size` rows (0: the
        whole batch), one optimizer step each; the mean of each metric over the steps on rank 0."""
        if epochs < 1 or mini_batch_size < 0:
            raise ValueError(f"epochs={epochs}, mini_batch_size={mini_batch_size}: need >= 1 and >= 0")
        p = self.policy
        batch, t = p._share(batch, {"ret": returns_BT, "oldv": old_values_BT})
        parts = batch.mini_batches(mini_batch_size)
        sums: dict[str, float] = {}
        for _ in range(epochs):
            for rows, sub in parts:
                width = sub.response_width
                out = self.train_step(sub, t["ret"][rows, :width], t["oldv"][rows, :width])
                for k, v in (out or {}).items():
                    sums[k] = sums.get(k, 0.0) + v
        if p.rank != 0:
            return None
        steps = epochs * len(parts)
        return {**{k: v / steps for k, v in sums.items()}, "num_updates": float(steps)}

