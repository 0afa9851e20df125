"""mpiexec worker for tests/megatron/test_load_memory.py: what loading and exporting weights add to a
trainer rank's peak RSS, beyond its own Megatron model, and what each rank's built model holds.

Usage: mpiexec -n 4 python _memory_worker.py MODEL_DIR OUT_DIR DS_DIR DS_OUT_DIR RESULT.json
Qwen3-MoE, the `small` preset at EP4: each rank builds its policy, then, each phase measured with the
kernel's RSS high-water mark (hpcrl.memwatch): loads MODEL_DIR (its slices only), draws the sharded
random init, exports to OUT_DIR, builds PPO's critic from MODEL_DIR (its rise less the critic's own
params and grad buffers), hashes it and takes a train step.
DeepSeek-V3 (DS_DIR, a small MLA model with shared experts) at EP4 in the same ranks, after the Qwen
models are dropped: loads DS_DIR, draws the sharded init and exports to DS_OUT_DIR, each phase
measured the same way, then takes a train step and records the bytes its model holds (`held_bytes`).
Then, rebuilding Megatron's model-parallel groups for each, the tiny-deepseek-v3 preset with a
reference model in the `LAYOUTS` below (bf16 with the distributed optimizer among them): a train step
each, and the bytes held. Rank 0 writes every rank's rises, held bytes and the digests to RESULT.json.
"""

from __future__ import annotations

import ctypes
import gc
import json
import sys

import torch

EP = 4
# tiny-deepseek-v3 on 4 ranks: (name, TrainerConfig fields, model.dtype)
LAYOUTS = [
    ("tp2-dp2-ep2-bf16", dict(tp=2, ep=2), "bfloat16"),   # MLA's TP split, experts sharded over edp 2
    ("tp2-pp2-ep2", dict(tp=2, pp=2, ep=2, last_stage_layers=1), "float32"),  # stages of 2 + 1 layers
]


def held_bytes(policy) -> dict:
    """What this rank's MegatronPolicy holds after a train step: its model's weights (parameters and
    frozen expert-bias buffers), the DDP grad buffers (and the elements of the parameters in them,
    without padding), the fp32 main shards and Adam moments (`step` scalars left out), the reference
    model's weights, and per DDP buffer (parameters, buckets, DP size): what bounds the distributed
    optimizer's padding."""
    from hpcrl.trainer.checkpoint_io import _main_params
    from hpcrl.trainer.model import weight_tensors

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    buffers = [*policy.ddp.buffers, *policy.ddp.expert_parallel_buffers]
    optimizers = getattr(policy.optimizer, "chained_optimizers", [policy.optimizer])
    states = [v for o in optimizers for st in o.optimizer.state.values() for k, v in st.items()
              if k != "step"]
    mains = [m.shard for m in _main_params(policy.ddp, policy.optimizer).values() if m.shard is not None]
    ref = policy.ref
    return {"params": nbytes(weight_tensors(policy.gpt).values()),
            "grads": nbytes(b.grad_data for b in buffers),
            "grad_elements": sum(p.numel() for b in buffers for p in b.params),
            "main": nbytes(mains), "adam": nbytes(states),
            "reference": nbytes(weight_tensors(ref).values()) if ref is not None else 0,
            "ddp_buffers": [[len(b.params), len(b.buckets), b.data_parallel_world_size] for b in buffers]}


def step_batch(vocab: int):  # -> (TrainBatch, advantages)
    from hpcrl.trainer.batch import TrainBatch

    g = torch.Generator().manual_seed(0)
    prompts = [[1, *torch.randint(3, vocab, (7,), generator=g).tolist()] for _ in range(8)]
    responses = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(8)]
    return TrainBatch.from_lists(prompts, responses), torch.linspace(-1.0, 1.0, 8)


def release_freed_memory() -> None:
    """Drop garbage and hand freed heap pages back to the kernel (glibc malloc_trim), so that a later
    phase's RSS rise is not hidden by pages an earlier phase freed but the process kept."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def qwen_phases(model_dir: str, out_dir: str) -> dict:
    import torch.distributed as dist

    from checkpoints.hf_safetensors import dir_digest
    from hpcrl.config.schema import AlgorithmConfig, CriticConfig, TrainerConfig
    from hpcrl.memwatch import peak_rss
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.critic import MegatronCritic
    from hpcrl.trainer.policy import MegatronPolicy

    trainer = TrainerConfig(ep=EP, num_procs=dist.get_world_size(), dispatcher="alltoall")
    policy = MegatronPolicy(load_hf_config("small-qwen3-moe", None), trainer, AlgorithmConfig())
    rises: dict[str, int] = {}
    dist.barrier()
    with peak_rss() as m:
        policy.load_hf_dir(model_dir)
    rises["load_hf_dir"] = m.rise_bytes
    loaded = policy.policy_sha256()
    dist.barrier()
    with peak_rss() as m:
        policy.init_from_seed(5, "sharded")
    rises["sharded_init"] = m.rise_bytes
    drawn = policy.policy_sha256()
    dist.barrier()
    with peak_rss() as m:
        policy.export_hf_dir(out_dir, 32 << 20)
    rises["export_hf_dir"] = m.rise_bytes
    own = sum(p.numel() * p.element_size() for p in policy.gpt.parameters())
    dist.barrier()
    with peak_rss() as m:
        critic = MegatronCritic(policy, CriticConfig(path=model_dir), AlgorithmConfig())
    critic_own = sum(p.numel() * p.element_size() for p in critic.gpt.parameters())
    critic_grads = sum(b.grad_data.numel() * b.grad_data.element_size()
                       for b in critic.ddp.buffers + critic.ddp.expert_parallel_buffers)
    rises["critic_from_dir"] = m.rise_bytes - critic_own - critic_grads
    dist.barrier()
    with peak_rss() as m:
        critic_sha = critic.sha256()
    rises["critic_sha256"] = m.rise_bytes
    # A train step once Adam's state exists (the first step allocates it): what the step itself
    # holds at its peak -- activations, the grads (patch 17 keeps an fp32 parameter's autograd grad
    # until the grad sync folds it into main_grad: at most one more set of the rank's own parameters,
    # 16-18 MiB measured here) and the optimizer's temporaries.
    batch, advantages = step_batch(int(policy.hf_config["vocab_size"]))
    policy.train_step(batch, advantages, on_policy=True)
    dist.barrier()
    with peak_rss() as m:
        policy.train_step(batch, advantages, on_policy=True)
    rises["train_step"] = m.rise_bytes
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rises": rises, "own_param_bytes": own})
    return {"ranks": everyone, "loaded_sha": loaded, "dir_sha": dir_digest(model_dir), "drawn_sha": drawn,
            "exported_sha": dir_digest(out_dir), "critic_sha": critic_sha}


def deepseek_phases(ds_dir: str, out_dir: str) -> dict:
    """The small DeepSeek-V3 of `ds_dir` at EP4 (the model-parallel groups the Qwen policy made)."""
    import torch.distributed as dist

    from checkpoints.hf_safetensors import dir_digest
    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.memwatch import peak_rss
    from hpcrl.trainer.policy import MegatronPolicy

    with open(f"{ds_dir}/config.json") as f:
        cfg = json.load(f)
    trainer = TrainerConfig(ep=EP, num_procs=dist.get_world_size(), dispatcher="alltoall")
    policy = MegatronPolicy(cfg, trainer, AlgorithmConfig())
    rises: dict[str, int] = {}
    release_freed_memory()
    dist.barrier()
    with peak_rss() as m:
        policy.load_hf_dir(ds_dir)
    rises["load_hf_dir"] = m.rise_bytes
    loaded = policy.policy_sha256()
    release_freed_memory()
    dist.barrier()
    with peak_rss() as m:
        policy.init_from_seed(5, "sharded")
    rises["sharded_init"] = m.rise_bytes
    drawn = policy.policy_sha256()
    release_freed_memory()
    dist.barrier()
    with peak_rss() as m:
        policy.export_hf_dir(out_dir, 32 << 20)
    rises["export_hf_dir"] = m.rise_bytes
    policy.train_step(*step_batch(int(cfg["vocab_size"])), on_policy=True)
    mine = {"rises": rises, "held": held_bytes(policy)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    return {"ranks": everyone, "loaded_sha": loaded, "dir_sha": dir_digest(ds_dir), "drawn_sha": drawn,
            "exported_sha": dir_digest(out_dir)}


def layout_held(fields: dict, dtype: str) -> list:
    """Every rank's `held_bytes` of the tiny-deepseek-v3 policy (kl_coef > 0: with a reference model)
    after one train step in a new model-parallel layout."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.policy import MegatronPolicy

    parallel_state.destroy_model_parallel()
    trainer = TrainerConfig(**fields, num_procs=dist.get_world_size(), micro_batch_size=4)
    policy = MegatronPolicy(load_hf_config("tiny-deepseek-v3", None), trainer, AlgorithmConfig(kl_coef=0.05),
                            dtype=dtype)
    policy.init_from_seed(3)
    batch, advantages = step_batch(64)
    policy.train_step(batch, advantages, None, policy.compute_logprobs(batch, "ref"), on_policy=True)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, held_bytes(policy))
    return everyone


def main() -> None:
    model_dir, out_dir, ds_dir, ds_out_dir, result = sys.argv[1:6]
    torch.set_num_threads(1)
    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed

    init_torch_distributed(MPI.COMM_WORLD, "gloo")
    import torch.distributed as dist

    out = {"qwen": qwen_phases(model_dir, out_dir)}
    out["deepseek"] = deepseek_phases(ds_dir, ds_out_dir)
    out["layouts"] = {name: layout_held(fields, dtype) for name, fields, dtype in LAYOUTS}
    if dist.get_rank() == 0:
        with open(result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hpcrl.worker_main import finalize_and_exit

    main()
    finalize_and_exit(0)  # as hpcrl's ranks end: no gloo/Megatron teardown at interpreter exit
