"""Trainer-side checkpoint save and load through the HDF5 store (checkpoints/).

Every tensor is stored under its HF checkpoint name with the global box this rank holds
(`moe.hf_megatron.local_params` gives the Megatron-shard -> HF-box pieces), so a checkpoint saved
under one layout (TP/EP/PP/ETP/DP, any world size) loads under another: each rank reads only the
boxes it needs. Stored per tensor: `policy/<hf>`, `adam/exp_avg/<hf>`, `adam/exp_avg_sq/<hf>` and,
with a reference model, `ref/<hf>`; with PPO's critic (hpcrl/trainer/critic.py), its body as
`critic/<hf>` and `critic_adam/<moment>/<hf>` (no `lm_head`) and its value head as
`critic/value_head.{weight,bias}`, resharded on load the same way. Per rank: the RNG states (torch CPU/CUDA, Python, numpy) as a
blob; they are restored only when the world size is unchanged (else re-seeded deterministically).
"""

from __future__ import annotations

import io
import pickle
import random
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from checkpoints import CheckpointWriter, open_checkpoint
from moe.hf_megatron import local_params

ADAM_KEYS = ("exp_avg", "exp_avg_sq")



def _adam_states(optimizer: Any) -> dict[torch.nn.Parameter, dict]:
    """param -> the torch AdamW state dict of the sub-optimizer that owns it (Megatron chains one
    optimizer per param kind). The dicts are the optimizers' own, created empty if missing, so
    filling them restores the state."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    states: dict = {}
    for opt in inner:
        for group in opt.optimizer.param_groups:
            for p in group["params"]:
                states[p] = opt.optimizer.state[p]  # state is a defaultdict(dict)
    return states


def _rng_blob() -> bytes:
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
             "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    buf = io.BytesIO()
    pickle.dump(state, buf)
    return buf.getvalue()


def _set_rng(blob: bytes) -> None:
    state = pickle.loads(blob)
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save(policy: Any, ckpt_dir: str, step: int, attempt_id: str, keep: int,
         metadata: dict | None) -> float:
    """Collective over the trainer ranks: write this rank's slices and commit (rank 0 writes the
    manifest with `metadata`). Returns the bytes this rank wrote."""
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = CheckpointWriter(ckpt_dir, step, rank=rank, world_size=world, attempt_id=attempt_id,
                              keep_last=keep)
    shapes = policy.dims.hf_shapes()
    params = dict(policy.gpt.named_parameters())
    states = _adam_states(policy.optimizer)
    ref = dict(policy.ref.named_parameters()) if policy.ref is not None else {}
    adam_steps = set()
    nbytes = 0
    for lp in local_params(policy.dims, policy.coords):
        param = params[lp.name]
        sources = {"policy": param.detach()}
        st = states.get(param)
        if st and "exp_avg" in st:
            adam_steps.add(float(st["step"]))
            sources.update({f"adam/{k}": st[k] for k in ADAM_KEYS})
        if ref:
            sources["ref"] = ref[lp.name].detach()
        for prefix, tensor in sources.items():
            for pc in lp.pieces:
                part = tensor[pc.local_box.index].contiguous()
                writer.write(f"{prefix}/{pc.hf_name}", part, box=pc.hf_box, global_shape=shapes[pc.hf_name])
                nbytes += part.numel() * part.element_size()
    assert len(adam_steps) <= 1, f"params at different Adam steps: {adam_steps}"
    critic_steps: set[float] = set()
    for name, param, index, box, shape, st in _critic_pieces(policy, shapes):
        sources = {"critic": param.detach()}
        if st and "exp_avg" in st:
            critic_steps.add(float(st["step"]))
            sources.update({f"critic_adam/{k}": st[k] for k in ADAM_KEYS})
        for prefix, tensor in sources.items():
            part = tensor[index].contiguous()
            writer.write(f"{prefix}/{name}", part, box=box, global_shape=shape)
            nbytes += part.numel() * part.element_size()
    writer.write_blob("rng", _rng_blob())
    meta = None
    if rank == 0:
        meta = dict(metadata or {})
        meta["adam_step"] = adam_steps.pop() if adam_steps else 0.0
        if policy.critic is not None:
            meta["critic_adam_step"] = critic_steps.pop() if critic_steps else 0.0
    writer.commit(meta)
    writer.wait(for_commit=True)
    return float(nbytes)


def load(policy: Any, ckpt_dir: str, step: int) -> dict:
    """Collective: fill this rank's params, Adam moments and RNG from the checkpoint at `step`,
    reading only the boxes this rank holds. Returns the checkpoint's metadata."""
    with open_checkpoint(ckpt_dir, step) as reader:
        meta = reader.metadata
        has_ref = any(n.startswith("ref/") for n in reader.tensor_names())
        params = dict(policy.gpt.named_parameters())
        states = _adam_states(policy.optimizer)
        ref = dict(policy.ref.named_parameters()) if policy.ref is not None else {}
        adam_step = float(meta.get("adam_step", 0.0))
        with torch.no_grad():
            for lp in local_params(policy.dims, policy.coords):
                param = params[lp.name]
                targets: dict[str, torch.Tensor] = {"policy": param.data}
                if adam_step > 0:
                    st = states[param]
                    for k in ADAM_KEYS:
                        st.setdefault(k, torch.zeros_like(param.data))
                        targets[f"adam/{k}"] = st[k]
                    st["step"] = torch.tensor(adam_step, dtype=torch.float32)
                # A checkpoint without a reference model keeps the seed-initialised one (the
                # reference is the initial policy).
                if ref and has_ref:
                    targets["ref"] = ref[lp.name].data
                for prefix, target in targets.items():
                    for pc in lp.pieces:
                        part = reader.read(f"{prefix}/{pc.hf_name}", pc.hf_box)
                        target[pc.local_box.index] = part.to(target.dtype)
        if policy.critic is not None:
            _load_critic(policy, reader, float(meta.get("critic_adam_step", 0.0)))
        ranks = reader.blob_ranks("rng")
        if len(ranks) == dist.get_world_size() and dist.get_rank() in ranks:
            _set_rng(reader.blob("rng", rank=dist.get_rank()))
    policy._loaded["policy"] = True
    return meta



def _critic_pieces(policy: Any, shapes: dict[str, tuple[int, ...]]):
    """(checkpoint name, param, index of the piece in the param, its global box, global shape, the
    param's Adam state) of each piece of the critic this rank holds: the body under the policy's HF
    names, and on the last stage the value head whole (replicated). Nothing without a critic."""
    from moe.slices import Box

    critic = policy.critic
    if critic is None:
        return
    params = dict(critic.gpt.named_parameters())
    states = _adam_states(critic.optimizer)
    for lp in local_params(policy.dims, policy.coords):
        if lp.name.startswith("output_layer.") or lp.name not in params:  # the head replaces lm_head
            continue
        param = params[lp.name]
        for pc in lp.pieces:
            yield pc.hf_name, param, pc.local_box.index, pc.hf_box, shapes[pc.hf_name], states.get(param)
    head = critic.head()
    if head is not None:
        from hpcrl.trainer.critic import HEAD_NAMES

        for name, param in zip(HEAD_NAMES, (head.weight, head.bias)):
            full = Box.full(tuple(param.shape))
            yield name, param, full.index, full, tuple(param.shape), states.get(param)


def _load_critic(policy: Any, reader: Any, adam_step: float) -> None:
    """Fill this rank's critic pieces and their Adam moments from the checkpoint."""
    if not any(n.startswith("critic/") for n in reader.tensor_names()):
        raise ValueError("this checkpoint has no critic (it was saved by a run without one, e.g. not ppo); "
                         "resume it with its own algorithm, or start the ppo run fresh from its export "
                         "(model.path)")
    with torch.no_grad():
        for name, param, index, box, _, st in _critic_pieces(policy, policy.dims.hf_shapes()):
            targets = {"critic": param.data}
            if adam_step > 0:
                st = _adam_states(policy.critic.optimizer)[param]
                for k in ADAM_KEYS:
                    st.setdefault(k, torch.zeros_like(param.data))
                    targets[f"critic_adam/{k}"] = st[k]
                st["step"] = torch.tensor(adam_step, dtype=torch.float32)
            for prefix, target in targets.items():
                target[index] = reader.read(f"{prefix}/{name}", box).to(target.dtype)
