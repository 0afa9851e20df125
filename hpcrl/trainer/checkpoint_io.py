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
from dataclasses import dataclass
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


@dataclass
class _Model:
    """One model's part of a checkpoint: its tensors under `prefix/<name>`, its Adam moments (if it
    trains) under `adam_prefix/<moment>/<name>` at the step recorded as metadata[`step_key`]."""

    prefix: str
    pieces: list[tuple[str, torch.nn.Parameter, Any, Any, tuple[int, ...]]]  # name, param, index, box, shape
    optimizer: Any = None
    adam_prefix: str = ""
    step_key: str = ""


def _models(policy: Any) -> list[_Model]:
    """The policy, its frozen reference (if any) and PPO's critic (if any), each as the pieces this
    rank holds: HF-named boxes of the Megatron shards (`local_params`); the critic has no `lm_head`
    and, on the last stage, its value head whole (replicated)."""
    from moe.slices import Box

    shapes = policy.dims.hf_shapes()
    local = local_params(policy.dims, policy.coords)

    def pieces(gpt: torch.nn.Module, names: set[str]) -> list:
        params = dict(gpt.named_parameters())
        return [(pc.hf_name, params[lp.name], pc.local_box.index, pc.hf_box, shapes[pc.hf_name])
                for lp in local if lp.name in names for pc in lp.pieces]

    everything = {lp.name for lp in local}
    models = [_Model("policy", pieces(policy.gpt, everything), policy.optimizer, "adam", "adam_step")]
    if policy.ref is not None:
        models.append(_Model("ref", pieces(policy.ref, everything)))
    critic = policy.critic
    if critic is not None:
        from hpcrl.trainer.critic import HEAD_NAMES

        # the value head replaces lm_head (and an untied critic has no tied copy of the embedding)
        own = {n for n, _ in critic.gpt.named_parameters() if not n.startswith("output_layer.")}
        body = pieces(critic.gpt, everything & own)
        head = critic.head()
        if head is not None:
            for name, param in zip(HEAD_NAMES, (head.weight, head.bias)):
                full = Box.full(tuple(param.shape))
                body.append((name, param, full.index, full, tuple(param.shape)))
        models.append(_Model("critic", body, critic.optimizer, "critic_adam", "critic_adam_step"))
    return models


def save(policy: Any, ckpt_dir: str, step: int, attempt_id: str, keep: int,
         metadata: dict | None) -> float:
    """Collective over the trainer ranks: write this rank's slices and commit (rank 0 writes the
    manifest with `metadata`). Returns the bytes this rank wrote."""
    rank, world = dist.get_rank(), dist.get_world_size()
    writer = CheckpointWriter(ckpt_dir, step, rank=rank, world_size=world, attempt_id=attempt_id,
                              keep_last=keep)
    adam_steps: dict[str, float] = {}
    nbytes = 0
    for m in _models(policy):
        states = _adam_states(m.optimizer) if m.optimizer is not None else {}
        steps = set()
        for name, param, index, box, shape in m.pieces:
            sources = {m.prefix: param.detach()}
            st = states.get(param)
            if st and "exp_avg" in st:
                steps.add(float(st["step"]))
                sources.update({f"{m.adam_prefix}/{k}": st[k] for k in ADAM_KEYS})
            for prefix, tensor in sources.items():
                part = tensor[index].contiguous()
                writer.write(f"{prefix}/{name}", part, box=box, global_shape=shape)
                nbytes += part.numel() * part.element_size()
        assert len(steps) <= 1, f"{m.prefix} params at different Adam steps: {steps}"
        if m.step_key:
            adam_steps[m.step_key] = steps.pop() if steps else 0.0
    writer.write_blob("rng", _rng_blob())
    writer.commit({**(metadata or {}), **adam_steps} if rank == 0 else None)
    writer.wait(for_commit=True)
    return float(nbytes)


def load(policy: Any, ckpt_dir: str, step: int) -> dict:
    """Collective: fill this rank's params, Adam moments and RNG from the checkpoint at `step`,
    reading only the boxes this rank holds. Returns the checkpoint's metadata."""
    with open_checkpoint(ckpt_dir, step) as reader:
        meta = reader.metadata
        saved = {n.split("/", 1)[0] for n in reader.tensor_names()}
        for m in _models(policy):
            if m.prefix == "ref" and "ref" not in saved:
                continue  # keep the seed-initialised reference (the reference is the initial policy)
            if m.prefix not in saved:
                raise ValueError(f"this checkpoint has no {m.prefix} (it was saved by a run without one, "
                                 "e.g. not ppo); resume it with its own algorithm, or start the run fresh "
                                 "from its export (model.path)")
            _load_model(m, reader, float(meta.get(m.step_key, 0.0)) if m.step_key else 0.0)
        ranks = reader.blob_ranks("rng")
        if len(ranks) == dist.get_world_size() and dist.get_rank() in ranks:
            _set_rng(reader.blob("rng", rank=dist.get_rank()))
    policy._loaded["policy"] = True
    return meta


@torch.no_grad()
def _load_model(m: _Model, reader: Any, adam_step: float) -> None:
    """Fill the pieces of `m` this rank holds, and their Adam moments when the checkpoint has them."""
    states = _adam_states(m.optimizer) if adam_step > 0 else {}
    for name, param, index, box, _ in m.pieces:
        targets = {m.prefix: param.data}
        if adam_step > 0:
            st = states[param]
            for k in ADAM_KEYS:
                st.setdefault(k, torch.zeros_like(param.data))
                targets[f"{m.adam_prefix}/{k}"] = st[k]
            st["step"] = torch.tensor(adam_step, dtype=torch.float32)
        for prefix, target in targets.items():
            target[index] = reader.read(f"{prefix}/{name}", box).to(target.dtype)
