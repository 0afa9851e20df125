"""Where a trainer rank's starting weights come from. Every source fills only this rank's shards.

    HF model directory  -- each rank reads the slices it holds (moe.hf_checkpoint, safetensors get_slice)
    sharded random init -- each rank draws its own slices (moe.sharded_init), for any model size
    transformers' init  -- trainer rank 0 draws the full HF model (debug sizes only) and broadcasts
                           it one tensor at a time; every rank keeps only its slices of each

All three are layout-independent: the same job gives the same weights under every TP/PP/EP/ETP.
`load(policy, source, which)` walks `moe.hf_megatron.local_params` and copies `source(name, box)`
into each local parameter piece; a source returns the box in any dtype (converted here).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.config.validate import HF_INIT_MAX_PARAMS
from hpcrl.trainer.model import weight_tensors
from moe.hf_megatron import HFModelDims, local_params
from moe.slices import Box

Source = Callable[[str, Box], torch.Tensor]
"""(HF checkpoint name, global box) -> that region of the tensor."""

def resolve_random_init(mode: str, dims: HFModelDims) -> str:
    """`model.random_init` with auto decided: "hf" or "sharded" (validation refused an explicit "hf"
    above HF_INIT_MAX_PARAMS)."""
    if mode != "auto":
        return mode
    return "hf" if dims.num_params() <= HF_INIT_MAX_PARAMS else "sharded"


@torch.no_grad()
def load(policy: Any, source: Source, modules: list[torch.nn.Module], skip: str | None = None) -> None:
    """Copy `source` into this rank's shards of every module in `modules` (policy, ref or critic),
    leaving out the Megatron params whose names start with `skip` (the critic's value head)."""
    targets = [weight_tensors(m) for m in modules]
    for lp in local_params(policy.dims, policy.coords):
        if skip is not None and lp.name.startswith(skip):
            continue
        for pc in lp.pieces:
            part = source(pc.hf_name, pc.hf_box)
            for params in targets:
                if skip is not None and lp.name not in params:  # e.g. a tied embedding's last-stage copy
                    continue
                dst = params[lp.name].data[pc.local_box.index]
                dst.copy_(part.to(dtype=dst.dtype))


def hf_dir_source(model_dir: str, dims: HFModelDims) -> tuple[Source, Any]:
    """A source reading a HF model directory by slices, and the checkpoint to close afterwards."""
    from moe.hf_checkpoint import HFCheckpoint

    ckpt = HFCheckpoint(model_dir, dims)
    return ckpt.read, ckpt


def sharded_source(seed: int, dims: HFModelDims, std: float) -> Source:
    from moe.sharded_init import init_box

    shapes = dims.hf_shapes()

    def read(name: str, box: Box) -> torch.Tensor:
        return torch.from_numpy(init_box(seed, name, shapes[name], box, std))

    return read


@torch.no_grad()
def load_transformers_init(policy: Any, seed: int, modules: list[torch.nn.Module]) -> None:
    """transformers' own init under `seed`: rank 0 builds the full HF model (debug sizes), then every
    tensor is broadcast in turn and each rank copies its slices of it (no rank keeps a full copy
    beyond rank 0's model)."""
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import hf_fused_to_checkpoint

    rank = dist.get_rank()
    full: dict[str, torch.Tensor] = {}
    if rank == 0:
        full = hf_fused_to_checkpoint(build_hf_model(policy.hf_config, seed).state_dict(), policy.dims)
    wanted: dict[str, list] = {}
    for lp in local_params(policy.dims, policy.coords):
        for pc in lp.pieces:
            wanted.setdefault(pc.hf_name, []).append((lp.name, pc))
    targets = [weight_tensors(m) for m in modules]
    for name, shape in policy.dims.hf_shapes().items():
        t = full.pop(name).contiguous() if rank == 0 else torch.empty(shape, dtype=torch.float32)
        t = t.to(policy.device)
        if dist.get_world_size() > 1:
            dist.broadcast(t, src=0)
        for param_name, pc in wanted.get(name, ()):
            for params in targets:
                params[param_name].data[pc.local_box.index].copy_(t[pc.hf_box.index])
