"""Trainer-side checkpoint save and load through the HDF5 store (checkpoints/).

Every tensor is stored under its HF checkpoint name with the global box this rank holds
(`moe.hf_megatron.local_params` gives the Megatron-shard -> HF-box pieces), so a checkpoint saved
under one layout (TP/EP/PP/ETP/DP, any world size) loads under another: each rank reads only the
boxes it needs. Stored per tensor: `policy/<hf>`, `adam/exp_avg/<hf>`, `adam/exp_avg_sq/<hf>` and,
with a reference model, `ref/<hf>`. Per rank: the RNG states (torch CPU/CUDA, Python, numpy) as a
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
    writer.write_blob("rng", _rng_blob())
    meta = None
    if rank == 0:
        meta = dict(metadata or {})
        meta["adam_step"] = adam_steps.pop() if adam_steps else 0.0
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
        ranks = reader.blob_ranks("rng")
        if len(ranks) == dist.get_world_size() and dist.get_rank() in ranks:
            _set_rng(reader.blob("rng", rank=dist.get_rank()))
    policy._loaded["policy"] = True
    return meta
