"""A trainer rank: serves the controller's phases with a Megatron-core policy.

Every trainer rank runs every phase (Megatron's collectives need all of them); results that are
global (log-probs, metrics, hashes) come back from trainer rank 0, the others answer None.
Weight sync (`rollout.weight_sync`): "shard" -- every trainer rank sends its shards straight to the
engines along a moe plan (hpcrl/trainer/shard_sync.py); "broadcast" -- SGLang's weight-update groups,
full HF tensors broadcast in buckets from several trainer sources in turns (hpcrl/trainer/broadcast_sync.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
from contextlib import contextmanager
from pathlib import Path

from hpcrl.config.schema import JobConfig, critic_enabled, weight_sync_mode


def deterministic_cuda() -> None:
    """Bit-reproducible CUDA kernels in this process (trainer.deterministic), before its first CUDA
    call: cuBLAS with a fixed workspace (CUBLAS_WORKSPACE_CONFIG, unless the user set one) and torch's
    deterministic algorithms. Megatron then combines expert outputs with index_add_ (moe_utils.unpermute)
    instead of scatter_add_, whose float atomics sum a token's top-k (k > 2) in any order. warn_only:
    an op without a deterministic kernel warns instead of stopping the run. Uninitialised memory is
    not filled with NaN (deterministic mode's default, a write pass over every torch.empty)."""
    import os

    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = False


def _preload_megatron() -> BaseException | None:
    """Import (and patch) Megatron now, while the controller is still starting, so that start-up
    overlaps instead of queueing behind it; a failure is returned and raised by `init`."""
    try:
        from hpcrl.trainer import megatron_compat
        from hpcrl.trainer.policy import MegatronPolicy  # noqa: F401 - the import is the point

        megatron_compat.apply()
    except Exception as exc:  # noqa: BLE001 - reported through the controller by init
        return exc
    return None


@contextmanager
def _perturbed(policy):
    """The final norm's weight scaled by 1.5 on every rank holding it, then restored bit for bit
    (tests: a push that carries one wrong tensor)."""
    import torch

    params = [p for n, p in policy.gpt.named_parameters() if n == "decoder.final_layernorm.weight"]
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.mul_(1.5)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, old in zip(params, saved):
                p.copy_(old)


def trainer_handlers(job: JobConfig, run_dir: Path, world) -> dict:
    state: dict = {}
    is_leader = world.role_comm.Get_rank() == 0
    import_error = _preload_megatron()

    def init(cmd):
        import torch

        from hpcrl.config.schema import rollout_correction
        from hpcrl.dist import init_torch_distributed
        from hpcrl.trainer.policy import MegatronPolicy

        if import_error is not None:  # megatron_compat.apply() ran in _preload_megatron
            raise import_error
        torch.set_num_threads(job.resources.cpus_per_rank)
        device = job.resources.device
        gpu = None
        if device == "cuda":  # before NCCL starts: its communicators bind to the current device
            from hpcrl.rollout.placement import rank_gpus

            if job.trainer.deterministic:
                deterministic_cuda()
            gpu = rank_gpus(world, job)[0]
            torch.cuda.set_device(gpu)
        init_torch_distributed(world.role_comm, "nccl" if device == "cuda" else "gloo",
                               job.resources.timeout_s)
        hf_config = json.loads((run_dir / "model_config.json").read_text())
        # Dr. GRPO's constant defaults to the generation budget (algorithm.loss_agg_norm: 0)
        # and an asynchronous run's loss corrects for its stale samples (decoupled PPO: docs/async.md)
        algorithm = dataclasses.replace(job.algorithm,
                                        loss_agg_norm=job.algorithm.loss_agg_norm or job.rollout.max_new_tokens,
                                        rollout_correction=rollout_correction(job))
        policy = MegatronPolicy(hf_config, job.trainer, algorithm, device=device, gpu=gpu, dtype=job.model.dtype,
                                routing_replay=job.rollout.routing_replay)
        if job.model.path:
            policy.load_hf_dir(job.model.path)  # each rank reads only its slices
        else:
            policy.init_from_seed(job.trainer.seed, job.model.random_init)
        if critic_enabled(job):  # PPO's value model, from the policy's weights (hpcrl/trainer/critic.py)
            from hpcrl.trainer.critic import MegatronCritic

            policy.critic = MegatronCritic(policy, dataclasses.replace(job.critic, lr=job.critic.lr or algorithm.lr),
                                           algorithm)
        state["policy"] = policy
        return None

    def connect(cmd):
        from hpcrl.rollout.client import EngineClient

        clients = [EngineClient(url, timeout_s=job.resources.timeout_s) for url in cmd.payload] if is_leader \
            else None
        if weight_sync_mode(job) == "shard":
            from hpcrl.trainer.shard_sync import ShardSync

            sync = ShardSync(state["policy"], job, clients, job.resources.timeout_s)
            sync.connect()
            state["weight_sync"] = sync
            print(f"weight sync: shard, {len(sync.plan)} transfers in {sync.plan.num_rounds} rounds, "
                  f"{int(sync.plan.sent_bytes()[sync.rank])} bytes sent by this rank", flush=True)
            return sync.engine_request() if is_leader else None  # the controller writes the requests
        from hpcrl.trainer.broadcast_sync import BroadcastSync

        sync = BroadcastSync.for_policy(state["policy"], job, cmd.payload, job.resources.timeout_s)
        sync.connect()
        state["weight_sync"] = sync
        print(f"weight sync: broadcast, {sync.describe()}", flush=True)
        return None

    def batch_of(payload):
        from hpcrl.trainer.batch import TrainBatch

        return TrainBatch.from_lists(payload["prompt_ids"], payload["response_ids"], payload.get("routes"))

    def ref_logprobs(cmd):
        p = cmd.payload
        ref = state["policy"].compute_logprobs(batch_of(p), model="ref", temperature=p["temperature"])
        return ref.numpy() if is_leader else None

    def values(cmd):
        values_BT = state["policy"].critic.values(batch_of(cmd.payload))
        return values_BT.numpy() if is_leader else None

    def train_critic(cmd):
        import numpy as np
        import torch

        p = cmd.payload
        lr = state["policy"].critic.lr_schedule.at(cmd.step)
        out = state["policy"].critic.update(batch_of(p), torch.from_numpy(np.asarray(p["returns"])),
                                            torch.from_numpy(np.asarray(p["old_values"])), epochs=p["epochs"],
                                            mini_batch_size=p["mini_batch_size"])
        if out is not None and not math.isfinite(out["vf_loss"]):
            raise FloatingPointError(f"algorithm {job.algorithm.name!r}, step {cmd.step}: the critic's value "
                                     f"loss is {out['vf_loss']}; check the returns")
        return None if out is None else {**out, "lr": lr}

    def train(cmd):
        import numpy as np
        import torch

        p = cmd.payload
        ref = None if p["ref_logprobs"] is None else torch.from_numpy(p["ref_logprobs"])
        tensors = {k: torch.from_numpy(np.asarray(v)) for k, v in p.get("tensors", {}).items()}
        loss = p.get("loss", "grpo")
        lr = state["policy"].lr_schedule.at(cmd.step)
        out = state["policy"].update(batch_of(p), torch.from_numpy(np.asarray(p["advantages"])), ref,
                                     temperature=p["temperature"], loss=loss, tensors=tensors,
                                     epochs=p.get("epochs", 1), mini_batch_size=p.get("mini_batch_size", 0))
        if out is None:
            return None
        if not math.isfinite(out["loss"]):
            raise FloatingPointError(f"algorithm {job.algorithm.name!r}, step {cmd.step}: loss {loss!r} is "
                                     f"{out['loss']}; check the advantages and the loss function")
        logprobs = out.pop("logprobs_BT").numpy()
        return {"metrics": {**out, "lr": lr}, "logprobs": logprobs}

    def sync(cmd):
        from hpcrl import faults

        version = cmd.payload["weight_version"]
        fault = faults.planned_sync(version)  # tests only
        if fault == "skip":
            return {"bytes": 0.0, "seconds": 0.0} if is_leader else None
        if fault == "perturb":
            with _perturbed(state["policy"]):
                return state["weight_sync"].push(version)
        return state["weight_sync"].push(version)

    def save(cmd):
        from hpcrl.trainer import checkpoint_io

        p = cmd.payload
        checkpoint_io.save(state["policy"], p["dir"], cmd.step, p["attempt_id"], p["keep"],
                           p["metadata"] if is_leader else None, p.get("blobs") if is_leader else None)
        return None

    def load(cmd):
        from hpcrl.trainer import checkpoint_io

        meta = checkpoint_io.load(state["policy"], cmd.payload["dir"], cmd.step)
        return meta if is_leader else None

    def sha256(cmd):  # the export's hash: model.path's MTP tensors (DeepSeek-V3) included
        return state["policy"].policy_sha256(job.model.path)

    def critic_sha256(cmd):
        return state["policy"].critic.sha256()

    def shutdown(cmd):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        return None

    return {"init": init, "connect": connect, "ref_logprobs": ref_logprobs, "values": values,
            "train_critic": train_critic, "train": train, "sync": sync,
            "save": save, "load": load, "sha256": sha256, "critic_sha256": critic_sha256, "shutdown": shutdown}
