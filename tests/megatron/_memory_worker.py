"""mpiexec worker for tests/megatron/test_load_memory.py: what loading and exporting weights add to a
trainer rank's peak RSS, beyond its own Megatron model.

Usage: mpiexec -n 4 python _memory_worker.py MODEL_DIR OUT_DIR RESULT.json
The `small` preset at EP4: each rank builds its policy, then, each phase measured with the kernel's
RSS high-water mark (hpcrl.memwatch): loads MODEL_DIR (its slices only), draws the sharded random
init, exports to OUT_DIR, builds PPO's critic from MODEL_DIR (its rise less the critic's own params
and grad buffers) and hashes it. Rank 0 writes every rank's rises and the digests to RESULT.json.
"""

from __future__ import annotations

import json
import sys

import torch

EP = 4


def main() -> None:
    model_dir, out_dir, result = sys.argv[1:4]
    torch.set_num_threads(1)
    from mpi4py import MPI

    from hpcrl.dist import init_torch_distributed

    init_torch_distributed(MPI.COMM_WORLD, "gloo")
    import torch.distributed as dist

    from checkpoints.hf_safetensors import dir_digest
    from hpcrl.config.schema import AlgorithmConfig, CriticConfig, TrainerConfig
    from hpcrl.memwatch import peak_rss
    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.batch import TrainBatch
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
    g = torch.Generator().manual_seed(0)
    vocab = int(policy.hf_config["vocab_size"])
    prompts = [[1, *torch.randint(3, vocab, (7,), generator=g).tolist()] for _ in range(8)]
    responses = [torch.randint(3, vocab, (8,), generator=g).tolist() for _ in range(8)]
    batch = TrainBatch.from_lists(prompts, responses)
    advantages = torch.linspace(-1.0, 1.0, 8)
    policy.train_step(batch, advantages, on_policy=True)
    dist.barrier()
    with peak_rss() as m:
        policy.train_step(batch, advantages, on_policy=True)
    rises["train_step"] = m.rise_bytes
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"rises": rises, "own_param_bytes": own})
    if dist.get_rank() == 0:
        out = {"ranks": everyone, "loaded_sha": loaded, "dir_sha": dir_digest(model_dir),
               "drawn_sha": drawn, "exported_sha": dir_digest(out_dir), "critic_sha": critic_sha}
        with open(result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    from hpcrl.worker_main import finalize_and_exit

    main()
    finalize_and_exit(0)  # as hpcrl's ranks end: no gloo/Megatron teardown at interpreter exit
