"""mpiexec worker for tests/megatron/test_bf16_training.py: a bfloat16 MegatronPolicy (bf16
parameters, fp32 main parameters in Megatron's distributed optimizer) trains, checkpoints and resumes.

Usage: mpiexec -n N python _bf16_worker.py [--ep E] [--dtype float32] [--resume CKPT_DIR] CKPT_DIR OUT.pt
Without --resume: init from SEED, two GRPO steps, save the checkpoint at step 2 into CKPT_DIR, a
third step; then load step 2 back and take the third step again (resume), and once more after
resetting the main parameters from the bf16 ones (what a resume that lost them would do).
With --resume: load step 2 of that directory (saved under another layout), save it again into
CKPT_DIR, then take the third step; `--dtype float32` builds a float32 policy for that. Rank 0 saves
hashes, metrics and checks to OUT.pt.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from _policy_worker import SEED, make_batch


def main_matches_params(policy) -> bool:
    """Whether every fp32 main shard this rank owns rounds to the bf16 parameter it belongs to,
    and each main shard is fp32 while the parameters are bf16. Collective."""
    import torch.distributed as dist

    from hpcrl.trainer.checkpoint_io import _main_params

    ok, owned = True, 0
    for param, main in _main_params(policy.ddp, policy.optimizer).items():
        ok &= param.dtype == torch.bfloat16
        if main.shard is not None:
            owned += main.shard.numel()
            ok &= main.shard.dtype == torch.float32
            ok &= torch.equal(main.shard.to(torch.bfloat16), param.detach().view(-1)[main.flat])
    total = torch.tensor([owned, int(ok)], dtype=torch.int64)
    dist.all_reduce(total[:1])
    dist.all_reduce(total[1:], op=dist.ReduceOp.MIN)
    return bool(total[1]) and int(total[0]) > 0


def held_bytes(policy) -> dict[str, list[int]]:
    """Bytes this build holds per rank, [sum, max] over the trainer ranks: bf16 parameters, the DDP
    grad buffers (fp32, padded for the distributed optimizer), fp32 main shards, Adam moments, the
    reference model. Collective."""
    import torch.distributed as dist

    from hpcrl.trainer.checkpoint_io import ADAM_KEYS, _main_params

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    owned = [m for m in _main_params(policy.ddp, policy.optimizer).values() if m.shard is not None]
    buffers = [*policy.ddp.buffers, *policy.ddp.expert_parallel_buffers]
    held = {"params": nbytes(policy.gpt.parameters()), "grads": nbytes(b.grad_data for b in buffers),
            "main": nbytes(m.shard for m in owned), "adam": nbytes(m.state[k] for m in owned for k in ADAM_KEYS),
            "reference": nbytes(policy.ref.parameters())}
    local = torch.tensor(list(held.values()), dtype=torch.int64)
    total, most = local.clone(), local.clone()
    dist.all_reduce(total)
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return {k: [int(total[i]), int(most[i])] for i, k in enumerate(held)}


def every_expert(hf_config: dict) -> dict:
    """The preset with every token routed to all its experts (same parameters, so the same bytes):
    a top-k choice made from bf16-rounded router logits could flip where it is a near-tie, a jump no
    rounding bound covers, and bf16 rounding is coarse enough to reach the preset's narrowest top-2
    margins (1.6e-4 of the router logits here)."""
    return {**hf_config, "num_experts_per_tok": hf_config["num_experts"]}


def spread_weights(hf_config: dict, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """Checkpoint-named bf16 weights: the seed's init plus N(0, scale) noise (norms included), so that
    a wrong weight moves the logits by a fair part of their size (at init, std 0.02, a swapped
    expert moves them by less than bf16 rounding's worst case). The same on every rank."""
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_fused_to_checkpoint

    dims = HFModelDims.from_hf_config(hf_config)
    sd = hf_fused_to_checkpoint(build_hf_model(hf_config, SEED).state_dict(), dims)
    g = torch.Generator().manual_seed(SEED)
    return {k: (v + scale * torch.randn(v.shape, generator=g)).to(torch.bfloat16) for k, v in sd.items()}


def spread_logprobs(hf_config: dict, trainer, algorithm, dtype: str, batch) -> tuple:
    """Log-probs of the batch under a second policy of this dtype holding `spread_weights`, and those
    weights (the test compares with HF's fp32 forward on them)."""
    from hpcrl.trainer.policy import MegatronPolicy

    probe = MegatronPolicy(hf_config, trainer, algorithm, dtype=dtype)
    sd = spread_weights(hf_config)
    probe.load_hf_state_dict(sd, model="both")
    return probe.compute_logprobs(batch), sd


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("ckpt")
    ap.add_argument("out")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed

    init_torch_distributed(MPI.COMM_WORLD, "gloo")
    import torch.distributed as dist

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer import checkpoint_io
    from hpcrl.trainer.lr_schedule import LRSchedule
    from hpcrl.trainer.policy import MegatronPolicy

    trainer = TrainerConfig(ep=args.ep, num_procs=dist.get_world_size(), micro_batch_size=3, seed=3)
    algorithm = AlgorithmConfig(lr=1e-2, kl_coef=0.05, grad_clip=0.5, aux_loss_coef=0.01, adam_eps=1e-6)
    hf_config = every_expert(load_hf_config("tiny-qwen3-moe", None))
    policy = MegatronPolicy(hf_config, trainer, algorithm, dtype=args.dtype)
    policy.init_from_seed(SEED)
    rank0 = dist.get_rank() == 0
    batch = make_batch()
    adv = torch.linspace(-1.0, 1.0, batch.batch_size)
    out: dict = {"sha0": policy.policy_sha256(), "main_ok0": main_matches_params(policy)}
    ref = policy.compute_logprobs(batch, "ref")

    def step() -> dict | None:
        m = policy.train_step(batch, adv, None, ref, on_policy=True)
        if m is not None:
            m.pop("logprobs_BT")
        return m

    if args.resume:
        out["meta"] = checkpoint_io.load(policy, args.resume, 2)
        out["sha2"] = policy.policy_sha256()
        checkpoint_io.save(policy, args.ckpt, 2, "resaved", 2, {"resaved": 1})
        out["m3"] = step()
        out["sha3"] = policy.policy_sha256()
    else:
        out["logp0"], out["ref0"] = policy.compute_logprobs(batch), ref
        out["sd0"] = policy.export_hf_state_dict()
        out["logp_spread"], out["sd_spread"] = spread_logprobs(hf_config, trainer, algorithm, args.dtype,
                                                               batch)
        out["m1"], out["m2"] = step(), step()
        out["sha2"] = policy.policy_sha256()
        out["logp2"] = policy.compute_logprobs(batch)
        out["main_ok2"] = main_matches_params(policy)
        out["held"] = held_bytes(policy)
        checkpoint_io.save(policy, args.ckpt, 2, "first", 2, {"step": 2})
        out["m3"] = step()
        out["sha3"] = policy.policy_sha256()
        out["sd3"] = policy.export_hf_state_dict()
        checkpoint_io.load(policy, args.ckpt, 2)
        out["sha2_loaded"] = policy.policy_sha256()
        out["m3_resumed"] = step()
        out["sha3_resumed"] = policy.policy_sha256()
        checkpoint_io.load(policy, args.ckpt, 2)
        policy.weights_changed()  # main parameters from the bf16 ones: fp32 precision lost
        step()
        out["sha3_main_lost"] = policy.policy_sha256()
        # An lr schedule's lr reaches the distributed optimizer's inner Adam: its warmup step (lr 0)
        # leaves every weight as it was, the next step (the peak lr) moves them.
        schedule = LRSchedule(policy.optimizer, algorithm.lr, 0.0, dataclasses.replace(
            algorithm, lr_schedule="linear", lr_warmup_steps=1, num_steps=3))
        out["sha_before_lr0"] = policy.policy_sha256()
        for s in (0, 1):
            out[f"lr_at{s}"] = schedule.at(s)
            step()
            out[f"sha_lr{s}"] = policy.policy_sha256()
    if rank0:
        torch.save(out, args.out)
    dist.barrier()


if __name__ == "__main__":
    from hpcrl.worker_main import finalize_and_exit

    main()
    finalize_and_exit(0)  # as hpcrl's ranks end: no gloo/Megatron teardown at interpreter exit
