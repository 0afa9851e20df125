"""The Megatron-core policy of a trainer rank: weights in HF names, log-probs, policy updates.

Every trainer rank builds one `MegatronPolicy` after `hpcrl.dist.init_torch_distributed` (the
default torch.distributed world is exactly the trainer ranks) and then calls each method
collectively with the same arguments; results come back on trainer rank 0 (None elsewhere).

    batch (every rank)  -> rows split over DP ranks -> micro-batches (trainer.micro_batch_size)
        -> Megatron schedule (1F1B under PP) -> GPTModel (TP/SP, EP/ETP MoE)
        -> last stage: log-probs of response tokens, the algorithm's loss (global token/seq counts)
        -> Megatron DDP grad reduce + finalize_model_grads -> Adam step
    results (log-probs, metrics, HF weights) -> trainer rank 0

Loss scaling: each micro-batch's loss (the algorithm's, hpcrl/algorithms/losses.py; GRPO's by
default) uses the *global* token and sequence counts, so the sum over all micro-batches of all DP
ranks is the full-batch loss. The schedule divides a
micro-batch loss by the number of micro-batches M and DDP averages over the D DP ranks, so the
policy hands Megatron `loss * M * D`; the MoE aux loss then gets Megatron's usual weight (mean
over the M * D micro-batches). Pad tokens are masked out of the aux loss (`padding_mask`), so
the update does not depend on how much padding a layout adds (L is rounded up to a multiple of tp).

Optimizer: megatron's `get_megatron_optimizer` (torch AdamW with decoupled weight decay when TE
and Apex are absent; no weight decay on 1-D params, Megatron's standard) with Megatron's
model-parallel-aware grad-norm clipping (`grad_clip`, 0 disables): non-distributed over fp32
parameters, or (model.dtype bfloat16) Megatron's distributed optimizer over fp32 main parameters
of the bf16 ones (`ddp_and_adam`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.algorithms.grpo import KL_ESTIMATORS, LOSS_AGGS, aggregate
from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
from hpcrl.trainer import megatron_compat
from hpcrl.trainer.batch import TrainBatch
from hpcrl.trainer.lr_schedule import LRSchedule
from hpcrl.trainer.micro_batches import Split, fixed_split, token_split
from hpcrl.trainer.model import (Recompute, aux_loss_coef_of, build_gpt_model, check_layout, keep_expert_bias_fp32,
                                 transformer_config, weight_tensors)
from hpcrl.trainer.policy_export import PolicyExport
from moe.hf_megatron import HFModelDims, RankCoords, hf_to_megatron, local_params



def hf_state_dict_sha256(sd: Mapping[str, torch.Tensor]) -> str:
    """The policy hash of full HF checkpoint-named tensors (`moe.digest.state_dict_digest`,
    docs/policy_hash.md): what `MegatronPolicy.policy_sha256` gives for the same weights."""
    from moe.digest import state_dict_digest

    return state_dict_digest(sd)


def _identity(x: torch.Tensor) -> torch.Tensor:
    return x


HEAD_CHUNK_BYTES = 1 << 28
"""The float32 bytes of one chunk of response positions in the log-prob head: its transients (the
float32 logits, their shift, the entropy's product) exist one chunk at a time. Chunks of positions
change no value: every reduction runs over one position's vocab."""


def _logp_and_entropy(logits_BLv: torch.Tensor, pos_BT: torch.Tensor, tgt_BT: torch.Tensor, temperature: float,
                      entropy_grad: bool = False, entropy: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under log_softmax(logits / temperature) at its position, and the
    entropy there (detached, a metric, unless `entropy_grad`: then the entropy bonus's gradient
    flows through it; None without `entropy`: the log-prob forwards skip its [B, T, v] product and
    its TP all-reduce).

    `logits_BLv` is this TP rank's vocab shard (Megatron's parallel output: TP rank r holds vocab
    ids [r*v, (r+1)*v), v the same on every rank: Megatron divides the vocab evenly); the softmax
    normaliser and the target logit are summed over the TP group with Megatron's autograd-aware
    all-reduce, so full-vocab logits are never materialised. The positions go through in chunks of
    HEAD_CHUNK_BYTES (the same on every TP rank: the collectives pair up).
    """
    # Indexing, not gather: gather's backward keeps its whole input, so the step held the logits of
    # every position [B, L, v] and the fp32 [B, T, v] for the backward beside the softmax's exp; an
    # index keeps only its indices (hpcrl/trainer/saved_activations.py measures it). One index for
    # all chunks: its backward is one scatter into the logits' gradient (without a backward, one index
    # per chunk: no [B, T, v] copy of the positions' logits at all).
    B, T = pos_BT.shape
    v = logits_BLv.shape[-1]
    rows_B1 = torch.arange(B, device=pos_BT.device).unsqueeze(-1)
    step = max(1, HEAD_CHUNK_BYTES // (4 * B * v))
    if torch.is_grad_enabled() and logits_BLv.requires_grad:
        chunks = logits_BLv[rows_B1, pos_BT].split(step, dim=1)
    else:  # no backward to scatter into: each chunk's positions picked on their own
        chunks = (logits_BLv[rows_B1, p_BC] for p_BC in pos_BT.split(step, dim=1))
    parts = [_logp_chunk(p_BCv, t_BC, temperature, entropy_grad, entropy)
             for p_BCv, t_BC in zip(chunks, tgt_BT.split(step, dim=1), strict=True)]
    logp_BT = _join_positions([lp for lp, _ in parts])
    return logp_BT, _join_positions([e for _, e in parts]) if entropy else None


def _join_positions(chunks_BC: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' [B, C] results side by side; a lone chunk as it is (no copy)."""
    return chunks_BC[0] if len(chunks_BC) == 1 else torch.cat(chunks_BC, dim=1)


def _logp_chunk(picked_BCv: torch.Tensor, tgt_BC: torch.Tensor, temperature: float, entropy_grad: bool,
                entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`_logp_and_entropy` of C positions: their logits [B, C, v] on this TP rank and their targets."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    v = picked_BCv.shape[-1]
    z_BCv = picked_BCv.float() / temperature
    max_BC = z_BCv.detach().amax(dim=-1)
    if ps.get_tensor_model_parallel_world_size() > 1:
        group = ps.get_tensor_model_parallel_group()
        dist.all_reduce(max_BC, op=dist.ReduceOp.MAX, group=group)
        tp_sum = partial(reduce_from_tensor_model_parallel_region, group=group)
    else:
        tp_sum = _identity
    exp_BCv = torch.exp(z_BCv - max_BC.unsqueeze(-1))
    sum_BC = tp_sum(exp_BCv.sum(dim=-1))
    logz_BC = max_BC + torch.log(sum_BC)
    local_BC = tgt_BC - ps.get_tensor_model_parallel_rank() * v
    inside_BC = (local_BC >= 0) & (local_BC < v)
    rows_B1 = torch.arange(z_BCv.shape[0], device=z_BCv.device).unsqueeze(-1)
    cols_1C = torch.arange(z_BCv.shape[1], device=z_BCv.device).unsqueeze(0)
    tgt_logit_BC = z_BCv[rows_B1, cols_1C, local_BC.clamp(0, v - 1)]
    logp_BC = tp_sum(torch.where(inside_BC, tgt_logit_BC, 0.0)) - logz_BC
    if not entropy:
        return logp_BC, None
    with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
        mean_z_BC = tp_sum((exp_BCv * z_BCv).sum(dim=-1)) / sum_BC
        entropy_BC = logz_BC - mean_z_BC
    return logp_BC, entropy_BC


@contextlib.contextmanager
def torch_adam() -> Iterator[None]:
    """Megatron-core's optimizer factory builds transformer-engine's or apex's FusedAdam when either
    imports (NGC images ship both), which keeps Adam's step in the param group; hpcrl's checkpoints
    hold torch's Adam state, a step per parameter (hpcrl/trainer/checkpoint_io.py: a FusedAdam's
    bf16 resume lost the moments, an fp32 save failed). Inside, the factory builds torch's Adam(W),
    the optimizer hpcrl is tested with (torch's fused kernels on CUDA)."""
    import megatron.core.optimizer as factory

    saved = factory.USING_PYTORCH_OPTIMIZER
    factory.USING_PYTORCH_OPTIMIZER = True
    try:
        yield
    finally:
        factory.USING_PYTORCH_OPTIMIZER = saved


def ddp_and_adam(gpt: torch.nn.Module, config: Any, device: torch.device, *, lr: float, weight_decay: float,
                 betas: tuple[float, float], eps: float, grad_clip: float) -> tuple[Any, Any]:
    """`gpt` wrapped for training as hpcrl trains (the policy, and PPO's critic) at learning rate
    `lr` (an `LRSchedule` may move it per RL step), with Megatron DDP's fp32 grad buffers.

    fp32 parameters (`config.bf16` off): Megatron's non-distributed Adam on them. bf16 parameters:
    Megatron's mixed precision as its trainers run it: the model under `Float16Module` (bf16
    compute, fp32 logits out of the last stage), Megatron's distributed optimizer with fp32 main
    parameters and Adam moments sharded over the data-parallel group (each DP rank keeps 1/D of
    them), grads reduce-scattered to the owners and the updated bf16 parameters all-gathered back.
    """
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    bf16 = bool(config.bf16)
    module = gpt
    if bf16:
        from megatron.core.transformer.module import Float16Module

        module = Float16Module(config, gpt)  # casts every buffer to bf16, the expert bias too
        keep_expert_bias_fp32(gpt)
    ddp = DistributedDataParallel(
        config=config, module=module,
        ddp_config=DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                 use_distributed_optimizer=bf16))
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = ddp.no_sync
    with torch_adam():
        optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=lr, min_lr=lr, weight_decay=weight_decay, adam_beta1=betas[0],
                            adam_beta2=betas[1], adam_eps=eps, clip_grad=grad_clip,
                            params_dtype=config.params_dtype, bf16=bf16, fp16=False, use_distributed_optimizer=bf16),
            [ddp])
    # Megatron applies wd_mult (0 for norms and biases) through its LR scheduler, which hpcrl
    # builds only for a schedule (LRSchedule); apply it to the param groups once here. torch's Adam takes
    # its per-tensor loop on CPU unless asked otherwise; its fused CPU kernel (one pass over
    # each tensor for the whole update) is 3x faster than the foreach kernels and 5x faster
    # than the loop on the tiny model. On CUDA Megatron's choice stands.
    for group in optimizer.param_groups:
        group["weight_decay"] = weight_decay * group.get("wd_mult", 1.0)
        if device.type == "cpu":
            group["foreach"], group["fused"] = False, True
    return ddp, optimizer


class MegatronPolicy(PolicyExport):
    """A Megatron GPTModel (MoE) policy, plus a frozen reference copy when `kl_coef > 0`.

    Construct on every trainer rank (collective). Weights start at Megatron's random init, not
    HF's: call `load_hf_dir`, `init_from_seed` or `load_hf_state_dict` before computing anything. `gpu` is this
    rank's CUDA device (hpcrl.rollout.placement) with device cuda; None: rank % visible GPUs.
    `dtype` is `model.dtype`: "float32", or "bfloat16" (bf16 parameters, reference and critic;
    fp32 main parameters in Megatron's distributed optimizer: `ddp_and_adam`).
    """

    def __init__(self, hf_config: dict, trainer: TrainerConfig, algorithm: AlgorithmConfig,
                 device: str = "cpu", gpu: int | None = None, dtype: str = "float32",
                 routing_replay: str = "none") -> None:
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r}; valid: 'cpu', 'cuda'")
        if not dist.is_initialized():
            raise RuntimeError("MegatronPolicy needs torch.distributed; call "
                               "hpcrl.dist.init_torch_distributed(trainer_comm, backend) first")
        world = dist.get_world_size()
        tp, pp, ep, etp = trainer.tp, trainer.pp, trainer.ep, trainer.etp
        if world != trainer.num_procs:
            raise ValueError(f"trainer.num_procs={trainer.num_procs} but the torch.distributed world has "
                             f"{world} ranks; the default group must be exactly the trainer ranks")
        if world % (tp * pp) or (world // pp) % (ep * etp):
            raise ValueError(f"trainer layout tp={tp} pp={pp} ep={ep} etp={etp} does not fit "
                             f"num_procs={world}: need tp*pp | num_procs and ep*etp | num_procs/pp")
        if algorithm.loss_agg not in LOSS_AGGS or algorithm.kl_estimator not in (*KL_ESTIMATORS, None):
            raise ValueError(f"algorithm.loss_agg={algorithm.loss_agg!r} (valid: {LOSS_AGGS}) / "
                             f"algorithm.kl_estimator={algorithm.kl_estimator!r} (valid: {KL_ESTIMATORS})")
        if trainer.micro_batch_size < 1:
            raise ValueError(f"trainer.micro_batch_size={trainer.micro_batch_size}; must be >= 1")
        self.dims = HFModelDims.from_hf_config(hf_config)
        stages = dict(first_stage_layers=trainer.first_stage_layers, last_stage_layers=trainer.last_stage_layers)
        check_layout(hf_config, tp=tp, pp=pp, ep=ep, etp=etp, dispatcher=trainer.dispatcher, device=device,
                     **stages)
        megatron_compat.apply()
        if device == "cuda":
            # gpu: this rank's GPU from hpcrl.rollout.placement; else one per rank, round robin
            torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count() if gpu is None else gpu)
        self.device = torch.device(device)
        self.hf_config = dict(hf_config)
        self.trainer, self.algorithm = trainer, algorithm
        self.rank = dist.get_rank()

        from megatron.core import parallel_state as ps
        from megatron.core import tensor_parallel

        if ps.model_parallel_is_initialized():
            have = (ps.get_tensor_model_parallel_world_size(), ps.get_pipeline_model_parallel_world_size(),
                    ps.get_expert_model_parallel_world_size(), ps.get_expert_tensor_parallel_world_size())
            if have != (tp, pp, ep, etp):
                raise RuntimeError(f"Megatron model parallel is already initialised as tp,pp,ep,etp={have}; "
                                   f"this policy needs {(tp, pp, ep, etp)}")
        else:
            ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                         expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
        tensor_parallel.model_parallel_cuda_manual_seed(trainer.seed)
        self.coords = RankCoords(
            tp_rank=ps.get_tensor_model_parallel_rank(), tp=tp, pp_rank=ps.get_pipeline_model_parallel_rank(),
            pp=pp, ep_rank=ps.get_expert_model_parallel_rank(), ep=ep,
            etp_rank=ps.get_expert_tensor_parallel_rank(), etp=etp, **stages)
        self.dp_size, self.dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
        self.first_stage, self.last_stage = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        all_coords: list[Any] = [None] * world
        dist.all_gather_object(all_coords, self.coords)
        self._export_plan = self._make_export_plan(all_coords)

        from hpcrl.config.validate import ROUTING_REPLAYS

        if routing_replay not in ROUTING_REPLAYS:
            raise ValueError(f"rollout.routing_replay={routing_replay!r}; valid: {', '.join(ROUTING_REPLAYS)}")
        self.routing_replay = routing_replay
        self.aux_loss_coef = aux_loss_coef_of(self.hf_config, algorithm.aux_loss_coef)
        self.layout = layout = dict(tp=tp, pp=pp, ep=ep, etp=etp, dispatcher=trainer.dispatcher,
                                    aux_loss_coef=self.aux_loss_coef, device=device, dtype=dtype,
                                    recompute=Recompute.of(trainer),
                                    variable_seq_lengths=trainer.max_tokens_per_micro_batch > 0 and pp > 1,
                                    **stages)
        self._build_policy(layout)
        self.critic: Any = None  # PPO's value model on these ranks (hpcrl/trainer/critic.py), if any
        self.ref: torch.nn.Module | None = None
        if algorithm.kl_coef > 0:
            self.ref = build_gpt_model(self.hf_config, transformer_config(self.hf_config, **layout))
            self.ref.requires_grad_(False)
        self._loaded = {"policy": False, "ref": self.ref is None}
        self._losses: dict[str, Any] = {}

    def _build_policy(self, layout: dict) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplay

        from hpcrl.trainer.routing_replay import Replay

        RouterReplay.clear_global_router_replay_instances()  # a class-level list of every router built
        config = transformer_config(self.hf_config, **layout, routing_replay=self.routing_replay != "none")
        gpt = build_gpt_model(self.hf_config, config)
        self.replay = Replay(gpt, self.dims.first_dense_layers, self.coords.tp, self.coords.tp_rank)
        names = set(weight_tensors(gpt))
        expected = {p.name for p in local_params(self.dims, self.coords)}
        assert names == expected, f"Megatron params differ from the HF map: {sorted(names ^ expected)}"
        self.gpt = gpt
        a = self.algorithm
        self.ddp, self.optimizer = ddp_and_adam(gpt, config, self.device, lr=a.lr, weight_decay=a.weight_decay,
                                                betas=(a.adam_beta1, a.adam_beta2), eps=a.adam_eps,
                                                grad_clip=a.grad_clip)
        self.lr_schedule = LRSchedule(self.optimizer, a.lr, a.weight_decay, a)

    # ------------------------------------------------------------------ weights

    def _models(self, model: str) -> list[tuple[str, torch.nn.Module]]:
        if model not in ("policy", "ref", "both"):
            raise ValueError(f"model={model!r}; valid: 'policy', 'ref', 'both'")
        if model != "policy" and self.ref is None:
            raise ValueError(f"model={model!r} but there is no reference model (algorithm.kl_coef=0)")
        out = [] if model == "ref" else [("policy", self.gpt)]
        return out + ([("ref", self.ref)] if model != "policy" else [])

    def init_from_seed(self, seed: int, random_init: str = "auto") -> None:
        """Random weights drawn from `seed` (policy and ref), the same under every layout.

        random_init (`model.random_init`): "hf" is transformers' own init, drawn by trainer rank 0
        (debug sizes) and broadcast a tensor at a time; "sharded" has each rank draw only its own
        slices (moe/sharded_init.py); "auto" picks hf up to 1B parameters, else sharded.
        """
        from hpcrl.trainer import weight_init

        mode = weight_init.resolve_random_init(random_init, self.dims)
        modules = [m for _, m in self._models("both" if self.ref is not None else "policy")]
        if mode == "hf":
            weight_init.load_transformers_init(self, seed, modules)
        elif mode == "sharded":
            std = float(self.hf_config.get("initializer_range", 0.02))
            weight_init.load(self, weight_init.sharded_source(seed, self.dims, std), modules)
        else:
            raise ValueError(f"random_init={random_init!r}; valid: 'auto', 'hf', 'sharded'")
        self._loaded.update(policy=True, ref=True)
        self.weights_changed()

    def load_hf_dir(self, model_dir: str) -> None:
        """Load a HF model directory's weights into policy and ref, each rank reading only the
        slices it holds (moe/hf_checkpoint.py). CheckpointFormatError names a bad file or tensor."""
        from hpcrl.trainer import weight_init

        source, ckpt = weight_init.hf_dir_source(model_dir, self.dims)
        with ckpt:
            weight_init.load(self, source, [m for _, m in self._models("both" if self.ref is not None
                                                                          else "policy")])
        self._loaded.update(policy=True, ref=True)
        self.weights_changed()

    @torch.no_grad()
    def load_hf_state_dict(self, sd: Mapping[str, torch.Tensor], model: str = "policy") -> None:
        """Copy full HF checkpoint-named tensors into this rank's shards of `model`
        ("policy", "ref" or "both"). Every rank passes the full state dict."""
        local = hf_to_megatron(sd, self.dims, self.coords)
        for which, module in self._models(model):
            params = weight_tensors(module)
            for name, tensor in local.items():
                params[name].copy_(tensor)
            self._loaded[which] = True
        self.weights_changed()

    def weights_changed(self) -> None:
        """Call after writing the policy's parameters from outside the optimizer: with bf16
        parameters the optimizer's fp32 main parameters are set from them (Megatron's
        `reload_model_params`); fp32 parameters are their own main parameters."""
        if self.layout["dtype"] != "float32":
            self.optimizer.reload_model_params()

    # ------------------------------------------------------------------ compute

    def _require_loaded(self, which: str) -> None:
        if not self._loaded[which]:
            raise RuntimeError(f"the {which} weights are not loaded; call init_from_seed(seed) or "
                               f"load_hf_state_dict(sd, model={which!r}) first")

    def _share(self, batch: TrainBatch | None, tensors: dict[str, torch.Tensor | None]
               ) -> tuple[TrainBatch, dict[str, torch.Tensor | None]]:
        """The inputs on every rank: an input that some rank passed as None is taken from rank 0
        (so callers may pass results of rank-0-only methods, e.g. log-probs, on rank 0 alone)."""
        items: list[Any] = [batch, *tensors.values()]
        if dist.get_world_size() > 1:
            self._fill_from_rank0(items)
        if items[0] is None:
            raise ValueError("batch is None on every trainer rank; rank 0 must always pass the batch")
        return items[0], dict(zip(tensors, items[1:]))

    def _fill_from_rank0(self, items: list[Any]) -> None:
        """Replace, in place, each item that some rank has as None by rank 0's value."""
        have = torch.tensor([x is not None for x in items], dtype=torch.int32, device=self.device)
        both = torch.cat([have, -have])  # MIN over ranks of have and of -have: (min, -max)
        dist.all_reduce(both, op=dist.ReduceOp.MIN)
        n = len(items)
        missing = [i for i in range(n) if both[i] == 0 and -both[n + i] == 1]
        if missing:
            payload: list[Any] = [[items[i] for i in missing] if self.rank == 0 else None]
            dist.broadcast_object_list(payload, src=0)
            for i, value in zip(missing, payload[0]):
                items[i] = value

    def _plan(self, batch: TrainBatch, forward_only: bool = False) -> Split:
        """Every DP rank's micro-batches of `batch` (hpcrl/trainer/micro_batches.py); `forward_only`:
        for a forward without a backward (trainer.logprob_micro_batch_size)."""
        t = self.trainer
        rows = (t.logprob_micro_batch_size or t.micro_batch_size) if forward_only else t.micro_batch_size
        if t.max_tokens_per_micro_batch:
            return token_split(batch.prompt_lens_B + batch.response_lens_B, self.dp_size, self.coords.tp,
                               rows, t.max_tokens_per_micro_batch)
        return fixed_split(batch.batch_size, batch.seq_len, self.dp_size, self.coords.tp, rows)

    def _recorded_routes(self, batch: TrainBatch, temperature: float) -> tuple[torch.Tensor | None, TrainBatch]:
        """rollout.routing_replay r2: the old log-probs of `batch` (rank 0) and `batch` carrying the
        routes that forward took, every rank's (its stage's layers, its TP chunk, its DP rows) put
        together on every rank, for the training forwards to replay."""
        from hpcrl.trainer.batch import filler_routes, route_dtype

        self.replay.observe()
        old = self.compute_logprobs(batch, temperature=temperature)
        split, K, tp = self._plan(batch, forward_only=True), self.dims.top_k, self.coords.tp  # compute_logprobs
        mine = [(self.dp_rank, m, self.coords.tp_rank, j, map_TE.nonzero()[:, 1].view(
                    split.ranks[self.dp_rank][m].seq_len // tp, -1, K).to(route_dtype(self.dims.num_experts)))
                for j, maps in self.replay.observed_routes().items() for m, map_TE in enumerate(maps)]
        every: list[Any] = [mine]
        if dist.get_world_size() > 1:
            every = [None] * dist.get_world_size()
            dist.all_gather_object(every, mine)
        N = len(self.dims.moe_layers)
        routes = filler_routes(K, route_dtype(self.dims.num_experts)).expand(
            split.padded_rows, max(split.max_seq_len, batch.seq_len), N, K).clone()
        for part in every:
            for dp_rank, m, tp_rank, j, idx_SBK in part:
                micro = split.ranks[dp_rank][m]
                chunk = micro.seq_len // tp
                routes[micro.rows, tp_rank * chunk: (tp_rank + 1) * chunk, j] = idx_SBK.transpose(0, 1)
        B, S = batch.batch_size, batch.seq_len
        return old, TrainBatch(batch.tokens_BL, batch.prompt_lens_B, batch.response_lens_B,
                               routes[:B, :S].contiguous())

    def _split(self, batch: TrainBatch, per_row: dict[str, torch.Tensor], forward_only: bool = False
               ) -> tuple[list[dict[str, torch.Tensor]], Split]:
        """This DP rank's micro-batches and every rank's split (`_plan`: fixed shapes, or by tokens with
        trainer.max_tokens_per_micro_batch). Each micro-batch is cut to its own length, a multiple of
        tp (sequence parallelism splits it); dummy rows pad the batch."""
        split = self._plan(batch, forward_only)
        B = batch.batch_size
        if batch.routes_BLNK is not None:
            self._check_routes(batch.routes_BLNK)
        L = max(split.max_seq_len, batch.seq_len)  # a mini-batch keeps its batch's width (rows, mini_batches)
        padded = batch.padded(split.padded_rows, L)
        assert padded.response_width == batch.response_width
        full = {"tokens_BL": padded.tokens_BL, "pad_BL": padded.padding_mask_BL(),
                "pos_BT": padded.logit_positions_BT(), "tgt_BT": padded.response_tokens_BT(),
                "mask_BT": padded.response_mask_BT()}
        if padded.routes_BLNK is not None:  # replayed (r3) or compared with the routers' own (observe)
            full["routes"] = padded.routes_BLNK
        for name, t in per_row.items():
            full[name] = torch.cat([t, t.new_zeros((padded.batch_size - B, *t.shape[1:]))])
        by_position = ("tokens_BL", "pad_BL", "routes")  # [rows, L, ...]: cut to the micro-batch's length
        out = []
        for micro in split.ranks[self.dp_rank]:
            rows, n = micro.rows, micro.seq_len
            d = {k: (v[rows, :n] if k in by_position else v[rows]).to(self.device) for k, v in full.items()}
            if n < L:  # the positions that predict padding columns stay inside the micro-batch
                d["pos_BT"] = d["pos_BT"].clamp(max=n - 1)
            d["position_ids"] = torch.arange(n, device=self.device).unsqueeze(0).expand(len(rows), n)
            out.append(d)
        return out, split

    def _agreement(self, batch: TrainBatch) -> float | None:
        """On rank 0: the share of (token, MoE layer) routes of the forward(s) since the last call that
        equal `batch`'s routes, pooled over every rank; None elsewhere and for a batch without routes.
        Collective: every rank has the batch, so all or none take part."""
        if batch.routes_BLNK is None:
            return None
        routed = self._to_rank0(torch.tensor(self.replay.take_agreement(), dtype=torch.float64))
        # each (token, layer) is counted on one rank: sums
        return None if routed is None or routed[1] == 0 else float(routed[0] / routed[1])

    def _check_routes(self, routes_BLNK: torch.Tensor) -> None:
        """Routes to replay or compare fit this model: its MoE layers and top_k, K distinct expert ids
        in [0, num_experts) per (token, layer). Megatron would replay a top-(K+1) or a row of K copies
        of one expert without a word, and fail deep inside on a missing layer or an id out of range."""
        d = self.dims
        want = (len(d.moe_layers), d.top_k)
        if tuple(routes_BLNK.shape[2:]) != want:
            raise ValueError(f"routes_BLNK has shape {tuple(routes_BLNK.shape)}; this model needs [B, L, "
                             f"{want[0]} MoE layers, top_k={want[1]}] (an engine serving another model?)")
        # in the routes' own compact dtype: an int64 copy would be 8x the batch's routes, at every split
        lo, hi = (int(routes_BLNK.min()), int(routes_BLNK.max())) if routes_BLNK.numel() else (0, 0)
        if lo < 0 or hi >= d.num_experts:
            raise ValueError(f"routes_BLNK holds expert ids in [{lo}, {hi}]; this model has {d.num_experts} experts")
        ids = routes_BLNK.sort(dim=-1).values
        if d.top_k > 1 and bool((ids[..., 1:] == ids[..., :-1]).any()):
            raise ValueError("routes_BLNK routes a (token, layer) to one expert twice; a top-k route names "
                             f"{d.top_k} distinct experts")

    def _forward_step(self, data_iterator: Any, model: torch.nn.Module, loss_fn: Any) -> tuple[Any, Any]:
        mbd = next(data_iterator)
        pad_BL = mbd["pad_BL"]
        if not self.first_stage and self.coords.tp > 1:
            # Later stages get sequence-parallel hidden states; GPTModel scatters the padding
            # mask only on the first stage, so cut this TP rank's columns here.
            s = pad_BL.shape[1] // self.coords.tp
            pad_BL = pad_BL[:, self.coords.tp_rank * s: (self.coords.tp_rank + 1) * s]
        if model is self.ddp:  # only the policy replays (its routers own the RouterReplays)
            self.replay.before_forward(mbd.get("routes"), mbd["pad_BL"], self.routing_replay in ("r3", "r2"))
        out = model(mbd["tokens_BL"], mbd["position_ids"], None, padding_mask=pad_BL)
        return out, partial(loss_fn, mbd)

    def _run(self, model: torch.nn.Module, mbs: list[dict[str, torch.Tensor]], split: Split,
             forward_only: bool, loss_fn: Any) -> list[dict[str, torch.Tensor]]:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        try:  # (micro-batches of other shapes: the stages exchange each one's shape, variable_seq_lengths)
            return get_forward_backward_func()(
                forward_step_func=partial(self._forward_step, loss_fn=loss_fn), data_iterator=iter(mbs),
                model=[model], num_microbatches=split.num_micro_batches, seq_length=split.max_seq_len,
                micro_batch_size=split.max_rows, forward_only=forward_only)
        finally:
            self.replay.clear()

    def _to_rank0(self, local: torch.Tensor) -> torch.Tensor | None:
        """Sum of `local` over all ranks, on rank 0 (callers zero it where it must not count)."""
        local = local.to(self.device).contiguous()
        if dist.get_world_size() > 1:  # one rank: the sum is the tensor (py-spy: ~0.4 ms per call here)
            dist.reduce(local, dst=0, op=dist.ReduceOp.SUM)
        return local.cpu() if self.rank == 0 else None

    def _counts_here(self) -> bool:
        """Whether this rank's last-stage results count (one TP replica per DP rank)."""
        return self.last_stage and self.coords.tp_rank == 0

    @staticmethod
    def _logp_loss(temperature: float, mbd: dict[str, torch.Tensor], logits_BLv: torch.Tensor
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        logp_BT, _ = _logp_and_entropy(logits_BLv, mbd["pos_BT"], mbd["tgt_BT"], temperature, entropy=False)
        return logp_BT.new_zeros(()), {"logp_BT": torch.where(mbd["mask_BT"], logp_BT, 0.0)}

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch | None, model: str = "policy",
                         temperature: float = 1.0) -> torch.Tensor | None:
        """Float32 [B, T] log-probs of the response tokens (alignment: hpcrl/trainer/batch.py;
        0 on padding columns) under `model` ("policy" or "ref"), on rank 0; None elsewhere."""
        if model not in ("policy", "ref"):
            raise ValueError(f"model={model!r}; valid: 'policy', 'ref'")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}; must be > 0")
        module = self._models(model)[-1][1]
        self._require_loaded(model)
        batch, _ = self._share(batch, {})
        mbs, split = self._split(batch, {}, forward_only=True)
        store = self._run(self.ddp if model == "policy" else module, mbs, split, True,
                          partial(self._logp_loss, temperature))
        return self._gather_rows(store, "logp_BT", split, batch)

    def _gather_rows(self, store: list[dict[str, torch.Tensor]], key: str, split: Split,
                     batch: TrainBatch) -> torch.Tensor | None:
        """Per-micro-batch [rows, T] results of every DP rank as one [B, T] tensor on rank 0 (each row
        from the one micro-batch that holds it; dummy rows are dropped)."""
        T = batch.response_width
        out_BT = torch.zeros(split.padded_rows, T, dtype=torch.float32)
        if self._counts_here():
            for micro, d in zip(split.ranks[self.dp_rank], store, strict=True):
                real = micro.rows < batch.batch_size
                out_BT[micro.rows[real]] = d[key].float().cpu()[real]
        full = self._to_rank0(out_BT)
        return None if full is None else full[: batch.batch_size]

    def _policy_loss(self, spec: str):  # -> PolicyLoss
        """The loss named `spec`, resolved once per name (hpcrl/algorithms/losses.py)."""
        from hpcrl.algorithms.losses import resolve_loss

        if spec not in self._losses:
            self._losses[spec] = resolve_loss(spec)
        return self._losses[spec]

    def _correction_metrics(self) -> tuple[str, ...]:
        """The rollout-correction metrics every train step reports (algorithm.rollout_correction)."""
        mode = self.algorithm.rollout_correction
        if mode == "none":
            return ()
        own = (("tis_weight_mean", "tis_truncated_frac") if mode == "tis"
               else ("mis_masked_frac", "mis_log_ratio_mean"))
        return ("mismatch_kl_k1", "mismatch_kl_k3", "mismatch_abs_log_ratio", *own)

    def _behaviour_logp(self, tensors: dict[str, torch.Tensor], like_BT: torch.Tensor) -> torch.Tensor:
        if "behaviour_logp" not in tensors:
            raise ValueError(f"algorithm.rollout_correction={self.algorithm.rollout_correction!r} needs the "
                             "engines' log-probs as tensors['behaviour_logp'] (rl.update_policy sends them)")
        return tensors["behaviour_logp"].to(like_BT.dtype)

    def _mis_keep(self, old_BT: torch.Tensor, tensors: dict[str, torch.Tensor], mask_BT: torch.Tensor,
                  num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """MIS's keep mask [B, T] of the engine's (behaviour) log-probs against the old ones, and its
        metrics (global means with the batch's counts before rejection)."""
        from hpcrl.algorithms.rollout_correction import mis_mask

        a = self.algorithm
        return mis_mask(old_BT, self._behaviour_logp(tensors, old_BT), mask_BT, a.mis_low, a.mis_high,
                        a.mis_level, num_seqs=num_seqs, num_tokens=num_tokens)

    def _mis_rejection(self, batch: TrainBatch, per_row: dict[str, torch.Tensor], on_policy: bool
                       ) -> tuple[torch.Tensor, tuple[int, int, int, int]]:
        """MIS over the whole batch before the step: the keep mask [B, T] and the counts (kept tokens,
        kept sequences, all tokens, all sequences) that the loss and the metrics divide by."""
        from hpcrl.algorithms.rollout_correction import kept_counts

        if on_policy:
            raise ValueError("algorithm.rollout_correction: mis counts the kept tokens before the step: "
                             "pass old_logp_BT (update() computes them)")
        response_BT = batch.response_mask_BT()
        all_tokens, all_seqs = max(batch.num_response_tokens(), 1), batch.batch_size
        tensors = {k[2:]: v for k, v in per_row.items() if k.startswith("t:")}
        keep_BT, _ = self._mis_keep(per_row["old_BT"], tensors, response_BT, all_tokens, all_seqs)
        kept_tokens, kept_seqs = kept_counts(response_BT, keep_BT)
        return keep_BT, (max(kept_tokens, 1), max(kept_seqs, 1), all_tokens, all_seqs)

    def _rollout_correction(self, old_BT: torch.Tensor, tensors: dict[str, torch.Tensor], mask_BT: torch.Tensor,
                            num_tokens: int, num_seqs: int) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """TIS's per-token weights of the engine's (behaviour) log-probs, tensors["behaviour_logp"],
        against the old ones (None for none and mis: MIS acts on the mask), and the metrics of the
        correction over the whole response mask; (None, {}) when off."""
        from hpcrl.algorithms.rollout_correction import mismatch_metrics, tis_weights

        a = self.algorithm
        if a.rollout_correction == "none":
            return None, {}
        mu_BT = self._behaviour_logp(tensors, old_BT)
        metrics = mismatch_metrics(old_BT, mu_BT, mask_BT, num_tokens)
        if a.rollout_correction == "mis":
            return None, {**metrics, **self._mis_keep(old_BT, tensors, mask_BT, num_tokens, num_seqs)[1]}
        weights_BT, own = tis_weights(old_BT, mu_BT, mask_BT, a.tis_cap, num_tokens)
        return weights_BT, {**metrics, **own}

    def _train_loss(self, policy_loss: Any, temperature: float, counts: tuple[int, int, int, int], scale: int,
                    mbd: dict[str, torch.Tensor], logits_BLv: torch.Tensor
                    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`counts`: the batch's (tokens, sequences) in the loss, then before MIS rejection."""
        from hpcrl.algorithms.losses import LossBatch, call_loss

        num_tokens, num_seqs, all_tokens, all_seqs = counts
        entropy_coef = self.algorithm.entropy_coef
        logp_BT, entropy_BT = _logp_and_entropy(logits_BLv, mbd["pos_BT"], mbd["tgt_BT"], temperature,
                                                entropy_grad=entropy_coef > 0)
        response_BT = mbd["mask_BT"]
        # MIS: the rejected tokens leave every term of the loss (and were left out of the counts)
        mask_BT = response_BT & (mbd["keep_BT"] > 0) if "keep_BT" in mbd else response_BT
        # On-policy (no old log-probs given): the weights that sampled the batch are the ones
        # being trained, so the old log-probs are this forward's, detached (ratio = 1).
        old_BT = mbd["old_BT"] if "old_BT" in mbd else logp_BT.detach()
        tensors = {k[2:]: v for k, v in mbd.items() if k.startswith("t:")}
        correction, rc_metrics = self._rollout_correction(old_BT, tensors, response_BT, all_tokens, all_seqs)
        loss, m = call_loss(policy_loss, LossBatch(logp_BT, old_BT, mbd.get("ref_BT"), mask_BT, num_tokens,
                                                   num_seqs, tensors, correction), self.algorithm)
        m = {**m, **rc_metrics}
        entropy = aggregate(entropy_BT, mask_BT, "token-mean", num_tokens)
        if entropy_coef > 0:  # the bonus: a global token mean, like the metric
            loss = loss - entropy_coef * entropy
        metrics = torch.stack([loss.detach(), entropy.detach(),
                               *(m[k].detach().to(loss.device) for k in (*policy_loss.metrics,
                                                                         *self._correction_metrics()))]).float()
        return loss * scale, {"metrics": metrics, "logp_BT": torch.where(response_BT, logp_BT.detach(), 0.0)}

    def update(self, batch: TrainBatch | None, advantages: torch.Tensor | None,
               ref_logp_BT: torch.Tensor | None = None, temperature: float = 1.0, loss: str = "grpo",
               tensors: dict[str, torch.Tensor] | None = None, epochs: int = 1,
               mini_batch_size: int = 0) -> dict[str, Any] | None:
        """PPO-style updates of a rollout batch: `epochs` passes over it in mini-batches of
        `mini_batch_size` rows (0: the whole batch), one optimizer step each; metrics on rank 0.

        One pass over the whole batch is the on-policy shortcut (`train_step(on_policy=True)`: the
        training forward gives the old log-probs; the same weights, bit for bit, as a separate
        forward, tests/megatron/test_policy_single_rank.py). Otherwise the old log-probs are computed
        once, before the first step, so the ratio moves and the clip acts from the second step on.
        Mini-batches are contiguous rows in batch order (the controller's groups stay together when
        the size is a multiple of the group size). Returns the mean of each metric over the steps,
        `num_updates`, and `logprobs_BT`: the log-probs before the first update. `router_agreement`
        (with the engine's routes on the batch) is that forward's, the one with the engine's weights:
        later steps route with updated weights, and r2's routes are the trainer's own.
        """
        if epochs < 1 or mini_batch_size < 0:
            raise ValueError(f"epochs={epochs}, mini_batch_size={mini_batch_size}: need >= 1 and >= 0")
        batch, t = self._share(batch, {"adv": advantages, "ref": ref_logp_BT})
        B = batch.batch_size
        size = mini_batch_size or B
        # MIS needs the old log-probs of the whole batch before the step, to count what it keeps
        if epochs == 1 and size >= B and self.algorithm.rollout_correction != "mis":
            return self.train_step(batch, t["adv"], None, t["ref"], temperature, on_policy=True, loss=loss,
                                   tensors=tensors)
        if self.routing_replay == "r2":  # this forward's routes, replayed in every training forward
            old, batch = self._recorded_routes(batch, temperature)
            agreement = None  # the engines return no routes under r2: nothing to compare with
        else:
            self.replay.take_agreement()  # count the old log-probs' forward only
            old = self.compute_logprobs(batch, temperature=temperature)
            # the forward with the engine's weights: the steps below route with updated ones
            agreement = self._agreement(batch)
        parts = batch.mini_batches(size)
        _, shared = self._share(batch, {"old": old, **{f"t:{k}": v for k, v in (tensors or {}).items()}})
        named = {"advantages": t["adv"], **{k[2:]: v for k, v in shared.items() if k.startswith("t:")}}
        sums: dict[str, float] = {}
        for _ in range(epochs):
            for rows, sub in parts:
                width = sub.response_width

                def cut(x: torch.Tensor | None) -> torch.Tensor | None:
                    return None if x is None else (x[rows] if x.dim() == 1 else x[rows, :width])

                sub_named = {k: cut(v) for k, v in named.items()}
                out = self.train_step(sub, sub_named.pop("advantages"), cut(shared["old"]), cut(t["ref"]),
                                      temperature, loss=loss, tensors=sub_named)
                if out is not None:
                    out.pop("logprobs_BT")
                    out.pop("router_agreement", None)
                    for k, v in out.items():
                        sums[k] = sums.get(k, 0.0) + v
        if self.rank != 0:
            return None
        steps = epochs * len(parts)
        routed = {} if agreement is None else {"router_agreement": agreement}
        return {**{k: v / steps for k, v in sums.items()}, **routed, "num_updates": float(steps),
                "logprobs_BT": old}

    def train_step(self, batch: TrainBatch | None, advantages_B: torch.Tensor | None,
                   old_logp_BT: torch.Tensor | None = None, ref_logp_BT: torch.Tensor | None = None,
                   temperature: float = 1.0, on_policy: bool = False, loss: str = "grpo",
                   tensors: dict[str, torch.Tensor | None] | None = None) -> dict[str, Any] | None:
        """One optimizer step of `loss` over the whole batch; metrics on rank 0.

        `loss` is a built-in policy loss or `package.module:function` (hpcrl/algorithms/losses.py);
        it receives `advantages_B` (or token-level [B, T] advantages) as tensors["advantages"], and
        every other named [B] or [B, T] tensor of `tensors` as it is.

        `old_logp_BT` / `ref_logp_BT` follow the [B, T] alignment of hpcrl/trainer/batch.py;
        `ref_logp_BT` is required when algorithm.kl_coef > 0. With `on_policy=True` no old
        log-probs are passed: the batch was sampled with the current weights, so this step's own
        forward gives them (one forward pass fewer; what TRL and verl do for one update per batch).
        Every rank passes the same inputs, or None on ranks other than 0 (then rank 0's are
        broadcast). Returns loss, entropy and the loss's declared metrics (grpo: pg_loss, kl,
        clip_frac; means over response tokens per algorithm.loss_agg), grad_norm (before clipping), aux_loss (Megatron's load-balancing loss
        without its coefficient, mean over layers and micro-batches) and `logprobs_BT` (this step's
        forward, before the update; 0 on padding) on rank 0; None elsewhere.
        """
        from megatron.core.transformer.moe.moe_utils import (clear_aux_losses_tracker,
                                                             get_moe_layer_wise_logging_tracker,
                                                             reduce_aux_losses_tracker_across_ranks)

        self._require_loaded("policy")
        if temperature <= 0:
            raise ValueError(f"temperature={temperature}; must be > 0")
        policy_loss = self._policy_loss(loss)
        named = {"advantages": advantages_B, **(tensors or {})}
        batch, t = self._share(batch, {"old_BT": old_logp_BT, "ref_BT": ref_logp_BT,
                                       **{f"t:{k}": v for k, v in named.items()}})
        B, T = batch.batch_size, batch.response_width
        for name, key, shapes in (("old_logp_BT", "old_BT", [(B, T)]), ("ref_logp_BT", "ref_BT", [(B, T)]),
                                  *((f"tensors[{k!r}]", f"t:{k}", [(B,), (B, T)]) for k in named)):
            v = t[key]
            if v is None and (key.startswith("t:") or (key == "old_BT" and not on_policy)):
                raise ValueError(f"{name} is None; pass a tensor of shape {shapes[0]}"
                                 + (" or on_policy=True" if key == "old_BT" else ""))
            if v is not None and key == "old_BT" and on_policy:
                raise ValueError("old_logp_BT given with on_policy=True; pass one or the other")
            if v is not None and tuple(v.shape) not in shapes:
                raise ValueError(f"{name} has shape {tuple(v.shape)}, expected {' or '.join(map(str, shapes))} "
                                 f"(B={B} rows, T={T} = max response length; see hpcrl/trainer/batch.py)")
        per_row = {f"t:{k}": t[f"t:{k}"].float() for k in named}
        if not on_policy:
            per_row["old_BT"] = t["old_BT"].float()
        if t["ref_BT"] is not None:
            per_row["ref_BT"] = t["ref_BT"].float()
        counts = (max(batch.num_response_tokens(), 1), B) * 2
        if self.algorithm.rollout_correction == "mis":  # the rejected tokens leave the loss and its counts
            per_row["keep_BT"], counts = self._mis_rejection(batch, per_row, on_policy)
        mbs, split = self._split(batch, per_row)
        n_mb = split.num_micro_batches

        if not self.ddp.training:  # train() walks every module: skip it when nothing changed
            self.ddp.train()
        self.ddp.zero_grad_buffer()
        self.optimizer.zero_grad()
        tracker = get_moe_layer_wise_logging_tracker()
        if tracker.get("load_balancing_loss", {}).get("values", torch.zeros(self.dims.num_layers)).numel() \
                != self.dims.num_layers:  # sized by another model of this process (one value per layer)
            del tracker["load_balancing_loss"]
        clear_aux_losses_tracker()
        loss_fn = partial(self._train_loss, policy_loss, temperature, counts, n_mb * self.dp_size)
        self.replay.take_agreement()  # count this training forward's routes only
        store = self._run(self.ddp, mbs, split, False, loss_fn)
        _, grad_norm, _ = self.optimizer.step()

        names = ("loss", "entropy", *policy_loss.metrics, *self._correction_metrics())
        local = torch.zeros(len(names), dtype=torch.float32)
        if self._counts_here():
            for d in store:
                local += d["metrics"].detach().cpu()
        aux = torch.zeros(1, dtype=torch.float32)
        # The tracker is process-global: a key left by another policy in this process says nothing
        # about this one, whose aux loss exists only with a coefficient.
        has_aux = self.aux_loss_coef > 0 and "load_balancing_loss" in tracker
        if has_aux:
            if dist.get_world_size() > 1:  # every group has one rank otherwise: all identities
                reduce_aux_losses_tracker_across_ranks(["load_balancing_loss"])
            values = tracker["load_balancing_loss"]["values"]
            aux[0] = float(values.sum()) / len(self.dims.moe_layers) / n_mb  # mean over the MoE layers
            clear_aux_losses_tracker()
        logprobs_BT = self._gather_rows(store, "logp_BT", split, batch)
        agreement = self._agreement(batch)
        summed = self._to_rank0(local)
        if summed is None:
            return None
        out: dict[str, Any] = {name: float(v) for name, v in zip(names, summed)}
        if agreement is not None:
            out["router_agreement"] = agreement
        out["logprobs_BT"] = logprobs_BT
        if grad_norm is not None:
            out["grad_norm"] = float(grad_norm)
        if has_aux:
            out["aux_loss"] = float(aux[0])
        return out
