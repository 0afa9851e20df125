"""mpiexec worker for tests/megatron/test_policy_layouts.py: one MegatronPolicy run in one layout.

Usage: mpiexec -n N python _policy_worker.py --tp 1 --pp 1 --ep 1 --etp 1 --dispatcher alltoall \
           [--model-dir DIR] [--deepseek-dir DIR2] OUT.pt
The weights come from the HF model directory DIR (each rank reading its slices) or, without it, from
`init_from_seed(SEED)`; the test builds DIR from that same seed, so both give the same weights.
Rank 0 saves a dict with the batch, log-probs, metrics, exported HF weights and hashes to OUT.pt.
With DIR2 (a tiny-deepseek-v3 directory) the same ranks then build a DeepSeek-V3 policy in the same
layout (with PP, its 3 layers split 2 + 1: the dense layer on the first stage) and add its log-probs,
exports and one train step under `ds_*` keys; with --deepseek-fp8-dir (its FP8 block-quantized copy) it
then loads that and adds its export and log-probs. Both policies run with rollout.routing_replay r3 and
replay the routes a reference engine returned (`engine_replay`, under `engine_*` / `ds_engine_*`).
"""

from __future__ import annotations

import argparse

import torch

SEED = 11
NUM_ROWS = 12
MICRO_BATCH = 3
BATCH_SEED = 27
"""Rows whose routing under the seed's weights, and after the train steps, is clear of near-ties
(test_policy_layouts.py checks the margin): with seed 5 a token's top-2 experts at init were within
the rounding bound of the next one, so another summation order could send it elsewhere."""


def make_batch():  # -> TrainBatch
    """Rows with varied prompt/response lengths, one empty response, odd max length."""
    from hpcrl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(BATCH_SEED)
    prompts, responses = [], []
    for b in range(NUM_ROWS):
        p = int(torch.randint(1, 5, (1,), generator=g))
        r = 0 if b == 3 else int(torch.randint(1, 6, (1,), generator=g))
        prompts.append(torch.randint(3, 64, (p,), generator=g).tolist())
        responses.append(torch.randint(3, 64, (r,), generator=g).tolist())
    responses[0] = torch.randint(3, 64, (6,), generator=g).tolist()  # longest row: L = P0 + 6
    prompts[0] = prompts[0][:1]
    return TrainBatch.from_lists(prompts, responses)


def shard_boxes_match(policy, args) -> bool:
    """Whether moe's TrainerLayout gives every rank exactly the HF boxes its Megatron shards hold
    (what the shard-to-shard weight sync relies on). Collective."""
    import torch.distributed as dist

    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.shard_sync import LocalHFShards
    from hpcrl.rollout.reshard_route import spec_at_dtype
    from moe.layouts import TrainerLayout

    spec = spec_at_dtype(load_hf_config("tiny-qwen3-moe", None), "float32")
    layout = TrainerLayout(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp,
                           dp=dist.get_world_size() // (args.tp * args.pp), vocab_divisible_by=1)
    local = LocalHFShards(dict(policy.gpt.named_parameters()), policy.dims, policy.coords, torch.float32)
    same = {n: b for n, (b, _) in local.shards.items()} == dict(layout.shards(spec, dist.get_rank()))
    flag = torch.tensor([int(same)])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def replicas_agree(policy) -> bool:
    """Whether every HF box held by several ranks (TP replicas of norms and router, DP replicas of
    everything) holds the same bytes on all of them: a gradient that is not all-reduced over the
    ranks sharing a parameter (e.g. a sequence-parallel norm's over TP) leaves them apart. Collective."""
    import hashlib

    import torch.distributed as dist

    from hpcrl.trainer.shard_sync import LocalHFShards

    local = LocalHFShards(dict(policy.gpt.named_parameters()), policy.dims, policy.coords, torch.float32)
    mine = {(name, box.offsets, box.shape): hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()
            for name, (box, t) in local.refresh().items()}
    every: list[dict] = [{} for _ in range(dist.get_world_size())]
    dist.all_gather_object(every, mine)
    seen: dict = {}
    return all(seen.setdefault(key, digest) == digest for held in every for key, digest in held.items())


ENGINE_SEED = 41
ENGINE_ROUTER_NOISE = 0.5
"""The engine of `engine_batch` moves its routers' weights by ENGINE_ROUTER_NOISE times their std of
noise (ENGINE_SEED): it then routes about a third of the batch's (token, MoE layer) pairs to other
experts than the trainer's routers would (measured 40 and 50 of 118 for Qwen3-MoE and DeepSeek-V3),
so a replay that does not take the engine's routes fails the test. With the trainer's own weights
(in bf16 or fp32) its routes equal the trainer's on every pair of these 12 rows: nothing to tell apart."""


def engine_batch(cfg: dict, sd: dict | None, batch) -> tuple:  # -> (TrainBatch, raw routes)
    """The batch's prompts completed to its response lengths (ignore_eos, seeded sampling) by a
    reference engine on `sd` (rank 0's export of the policy: the weights a run's first push gives it)
    in fp32 with its routers moved (ENGINE_ROUTER_NOISE), asked for its routes; the routes then take
    the run's way: the reference server's `encode_routed_experts` into meta_info, the controller's
    `RouteFormat.decode`, the trainer worker's `TrainBatch.from_lists`. Rank 0 generates, every rank
    gets the batch; the engine's int32 routes [P + R - 1, layers, K] per row come back on rank 0."""
    import torch.distributed as dist

    from hpcrl.controller.routes import RouteFormat
    from hpcrl.rollout.engine import ReferenceModel
    from hpcrl.rollout.reference_server import encode_routed_experts
    from hpcrl.trainer.batch import TrainBatch
    from moe.hf_megatron import HFModelDims

    payload: list = [None]
    if dist.get_rank() == 0:
        engine = ReferenceModel(cfg)
        engine.load_weights(sd.items())
        g = torch.Generator().manual_seed(ENGINE_SEED)
        with torch.no_grad():
            for _, gate in engine.routers:
                noise = torch.randn(gate.weight.shape, generator=g)
                gate.weight.add_(noise * gate.weight.std() * ENGINE_ROUTER_NOISE)
        prompts = [row[:p] for row, p in zip(batch.tokens_BL.tolist(), batch.prompt_lens_B.tolist())]
        params = [{"max_new_tokens": n, "temperature": 1.0, "sampling_seed": ENGINE_SEED + b,
                   "ignore_eos": True} for b, n in enumerate(batch.response_lens_B.tolist())]
        outs = engine.generate(prompts, params, return_routes=True)
        fmt = RouteFormat.of(HFModelDims.from_hf_config(cfg))
        routes = [fmt.decode({"routed_experts": encode_routed_experts(o["routed_experts"])},
                             len(p) + len(o["output_ids"]), f"completion {i}")
                  for i, (p, o) in enumerate(zip(prompts, outs))]
        payload = [(prompts, [o["output_ids"] for o in outs], routes, [o["routed_experts"] for o in outs])]
    dist.broadcast_object_list(payload, src=0)
    prompts, responses, routes, raw = payload[0]
    return TrainBatch.from_lists(prompts, responses, routes), raw if dist.get_rank() == 0 else None


def replayed_routes(policy, batch) -> list | None:
    """Replay `batch`'s routes (rollout.routing_replay r3) in one compute_logprobs and collect, on rank
    0, what every rank's routers used: [(dp_rank, tp_rank, moe layer j, [bool maps per micro-batch])]
    from all ranks (the test puts them back together)."""
    import torch.distributed as dist

    policy.replay.observe()
    policy.compute_logprobs(batch)
    mine = [(policy.dp_rank, policy.coords.tp_rank, j, maps) for j, maps in policy.replay.observed_routes().items()]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return [x for part in every for x in part] if dist.get_rank() == 0 else None


def engine_replay(policy, cfg: dict, sd: dict | None, batch, prefix: str) -> dict:
    """`engine_batch`'s routes replayed by `policy` (r3) under this layout, and the routes its routers
    take by themselves on the same tokens (r2's record: every rank's put together), which the test
    shows differ from the engine's. Rank 0's values under `prefix` keys (None elsewhere)."""
    from hpcrl.trainer.batch import TrainBatch

    routed, raw = engine_batch(cfg, sd, batch)
    plain = TrainBatch(routed.tokens_BL, routed.prompt_lens_B, routed.response_lens_B)
    own = policy._recorded_routes(plain, 1.0)[1].routes_BLNK
    return {f"{prefix}_batch": routed, f"{prefix}_raw": raw, f"{prefix}_own": own,
            f"{prefix}_replayed": replayed_routes(policy, routed)}


VARIANTS = {"none": ({}, 0.01), "full": ({"recompute_granularity": "full"}, 0.01),
            "moe": ({"recompute_granularity": "selective", "recompute_modules": ["moe"]}, 0.01),
            # the load-balancing loss is a function of each micro-batch's tokens: off where the split differs
            "none_no_aux": ({}, 0.0), "tokens": ({"max_tokens_per_micro_batch": 16}, 0.0)}
"""name -> (trainer settings, algorithm.aux_loss_coef) of `variant_steps`."""


def variant_steps(cfg: dict, model_dir: str | None, trainer_kw: dict, batch, names=VARIANTS,
                  prefix: str = "variant") -> dict:
    """`batch`'s engine routes replayed (r3) in one on-policy step of `cfg`'s policy (from `model_dir`, or
    the seed), with each of the VARIANTS `names`: the step's metrics and the weights' hash after it
    (rank 0's; None elsewhere), and the micro-batch lengths of the last one's split. Under PP the
    schedule runs a stage's next forward before the backward that recomputes the last one, so a
    recomputed router must replay its own micro-batch's routes, not the latest set; the split by tokens
    sends micro-batches of several shapes between the stages and through sequence parallelism."""
    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.trainer.policy import MegatronPolicy

    out = {}
    for name in names:
        settings, aux = VARIANTS[name]
        policy = MegatronPolicy(cfg, TrainerConfig(**trainer_kw, **settings),
                                AlgorithmConfig(lr=1e-2, aux_loss_coef=aux, adam_eps=1e-2), routing_replay="r3")
        if model_dir:
            policy.load_hf_dir(model_dir)
        else:
            policy.init_from_seed(SEED)
        step = policy.train_step(batch, torch.linspace(-1.0, 1.0, batch.batch_size), on_policy=True)
        out[f"{prefix}_{name}"] = (step, policy.policy_sha256())
    out[f"{prefix}_lengths"] = [m.seq_len for m in policy._plan(batch).ranks[0]]
    return out


def deepseek_run(args, trainer_kw: dict, algorithm, batch) -> dict:
    """The DeepSeek-V3 policy of `args.deepseek_dir` in this layout: log-probs, export, hash, one
    train step and the export after it (rank 0's values; None elsewhere)."""
    import json
    from pathlib import Path

    from hpcrl.config.schema import TrainerConfig
    from hpcrl.trainer.policy import MegatronPolicy

    cfg = json.loads((Path(args.deepseek_dir) / "config.json").read_text())
    out: dict = {}
    trainer = TrainerConfig(**trainer_kw, last_stage_layers=1 if args.pp == 2 else 0)
    policy = MegatronPolicy(cfg, trainer, algorithm, routing_replay="r3")
    policy.load_hf_dir(args.deepseek_dir)
    out["ds_recorded"] = policy._recorded_routes(batch, 1.0)[1].routes_BLNK  # r2's record, put together
    out.update({"ds_sd0": policy.export_hf_state_dict(), "ds_sha0": policy.policy_sha256()})
    out.update(engine_replay(policy, cfg, out["ds_sd0"], batch, "ds_engine"))
    if args.pp > 1:  # DeepSeek's MoE layers recomputed under PP: shared experts, group-limited routes
        out.update(variant_steps(cfg, args.deepseek_dir, {**trainer_kw, "last_stage_layers": 1},
                                 out["ds_engine_batch"], ("none", "full", "moe"), "ds_variant"))
    out["ds_logp"] = logp = policy.compute_logprobs(batch)
    out["ds_m1"] = policy.train_step(batch, torch.linspace(-1.0, 1.0, batch.batch_size), logp)
    if out["ds_m1"] is not None:
        out["ds_m1"].pop("logprobs_BT", None)
    out["ds_sd1"] = policy.export_hf_state_dict()
    if args.deepseek_plain_dir:  # DeepSeek-V2-Lite's attention: plain q_proj, plain RoPE
        plain = json.loads((Path(args.deepseek_plain_dir) / "config.json").read_text())
        other = MegatronPolicy(plain, trainer, algorithm)
        other.load_hf_dir(args.deepseek_plain_dir)
        out["dsp_sd0"], out["dsp_logp"] = other.export_hf_state_dict(), other.compute_logprobs(batch)
    if args.deepseek_fp8_dir:  # its FP8 copy: each rank dequantizes only its slices
        policy.load_hf_dir(args.deepseek_fp8_dir)
        out["ds_fp8_sd"], out["ds_fp8_logp"] = policy.export_hf_state_dict(), policy.compute_logprobs(batch)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    for axis in ("tp", "pp", "ep", "etp"):
        ap.add_argument(f"--{axis}", type=int, default=1)
    ap.add_argument("--dispatcher", default="alltoall")
    ap.add_argument("--model-dir", default=None)
    ap.add_argument("--deepseek-dir", default=None)
    ap.add_argument("--deepseek-fp8-dir", default=None)
    ap.add_argument("--deepseek-plain-dir", default=None)
    ap.add_argument("out")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed

    init_torch_distributed(MPI.COMM_WORLD, "gloo")
    import torch.distributed as dist

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.policy import MegatronPolicy

    trainer_kw = dict(tp=args.tp, pp=args.pp, ep=args.ep, etp=args.etp, dispatcher=args.dispatcher,
                      num_procs=dist.get_world_size(), micro_batch_size=MICRO_BATCH, seed=3)
    trainer = TrainerConfig(**trainer_kw)
    # adam_eps = lr: Adam's update lr * m / (sqrt(v) + eps) then moves at most 1.25 * lr / eps = 1.25 times
    # any change of the gradient (at eps << |g| it is lr * sign(g), and fp32 reordering noise in a
    # gradient near zero flips it: weights 1e-5 apart after two steps with eps 1e-6, on AVX-512), so
    # the layouts' weights stay within the rounding bound test_policy_layouts.py derives.
    algorithm = AlgorithmConfig(lr=1e-2, kl_coef=0.05, grad_clip=0.5, aux_loss_coef=0.01, adam_eps=1e-2,
                                entropy_coef=0.05)  # the entropy gradient through the TP vocab split
    cfg = load_hf_config("tiny-qwen3-moe", None)
    # r3: batches without routes (all but engine_replay's) route freely, as without replay
    policy = MegatronPolicy(cfg, trainer, algorithm, routing_replay="r3")
    if args.model_dir:
        policy.load_hf_dir(args.model_dir)
    else:
        policy.init_from_seed(SEED)
    out_boxes = shard_boxes_match(policy, args)
    rank0 = dist.get_rank() == 0
    out: dict = {"sd0": policy.export_hf_state_dict(), "sha0": policy.policy_sha256(),
                 "shard_boxes_match": out_boxes}

    batch = make_batch()
    out.update(engine_replay(policy, cfg, out["sd0"], batch, "engine"))
    if args.pp > 1 or args.tp > 1:
        out.update(variant_steps(cfg, args.model_dir, trainer_kw, out["engine_batch"]))
    logp = policy.compute_logprobs(batch)
    out["logp"], out["ref"] = logp, policy.compute_logprobs(batch, "ref")
    if args.pp > 1 or args.tp > 1:  # the log-prob forward in one micro-batch of every row (trainer.logprob_*)
        whole = MegatronPolicy(cfg, TrainerConfig(**trainer_kw, logprob_micro_batch_size=batch.batch_size), algorithm)
        if args.model_dir:
            whole.load_hf_dir(args.model_dir)
        else:
            whole.init_from_seed(SEED)
        out["logp_whole"] = whole.compute_logprobs(batch)
        out["whole_micro_batches"] = [whole._plan(batch, forward_only=True).num_micro_batches,
                                      whole._plan(batch).num_micro_batches]
        del whole
    out["logp_t07"] = policy.compute_logprobs(batch, temperature=0.7)
    adv = torch.linspace(-1.0, 1.0, batch.batch_size)
    # Ranks other than 0 pass None for rank-0-only results: the policy broadcasts rank 0's.
    out["m1"] = policy.train_step(batch, adv, logp, out["ref"])
    out["logp_m1"] = out["m1"].pop("logprobs_BT") if rank0 else None
    out["sd1"] = policy.export_hf_state_dict()

    # export -> load -> export is bit-identical
    payload = [out["sd1"]]
    dist.broadcast_object_list(payload, src=0)
    policy.load_hf_state_dict(payload[0])
    out["sha_reloaded"] = policy.policy_sha256()
    out["logp_sd1"] = policy.compute_logprobs(batch)

    # Second step: Adam state carries over; stale old log-probs make the ratio (and clip) active.
    out["m2"] = policy.train_step(batch, adv, logp, out["ref"])
    if rank0:
        del out["m2"]["logprobs_BT"]
    out["sd2"] = policy.export_hf_state_dict()

    # Third step on-policy: the training forward supplies the old log-probs (no separate pass).
    out["logp_sd2"] = policy.compute_logprobs(batch)
    out["m3"] = policy.train_step(batch, adv, None, out["ref"], on_policy=True)
    out["logp_m3"] = out["m3"].pop("logprobs_BT") if rank0 else None
    out["sd3"] = policy.export_hf_state_dict()
    out["replicas_agree"] = replicas_agree(policy)

    # PPO's critic on the same ranks: its body starts as the policy (sd3), its head is fresh.
    from hpcrl.config.schema import CriticConfig
    from hpcrl.trainer.critic import MegatronCritic

    policy.critic = MegatronCritic(policy, CriticConfig(lr=1e-3, value_clip=0.05, grad_clip=0.5), algorithm)
    head = policy.critic.head()
    out["head"] = None if head is None else (head.weight.detach().clone(), head.bias.detach().clone())
    out["critic_sha0"] = policy.critic.sha256()
    out["v0"] = policy.critic.values(batch)
    returns = torch.linspace(-1.0, 2.0, batch.batch_size * batch.response_width).view(batch.batch_size, -1)
    returns = torch.where(batch.response_mask_BT(), returns, 0.0)
    out["cm1"] = policy.critic.train_step(batch, returns, out["v0"])
    out["v1"] = policy.critic.values(batch)
    out["cm2"] = policy.critic.train_step(batch, returns, out["v0"])  # clipped: V moved past 0.05
    out["v2"] = policy.critic.values(batch)
    out["policy_after_critic"] = policy.export_hf_state_dict()
    if args.deepseek_dir:
        out.update(deepseek_run(args, trainer_kw, AlgorithmConfig(lr=1e-2, grad_clip=0.5, aux_loss_coef=0.01,
                                                                  adam_eps=1e-2), batch))
    if rank0:
        out["batch"] = batch
        torch.save(out, args.out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hpcrl.worker_main import finalize_and_exit

    main()
    finalize_and_exit(0)  # as hpcrl's ranks end: no gloo/Megatron teardown at interpreter exit
