"""The trainer writes its policy as a HF model directory, each rank its own regions, no gather.

Collective over the trainer ranks (`MegatronPolicy.export_hf_dir` calls it):

    every rank: the same file plan (checkpoints.hf_safetensors.plan_shards over hf_shapes, sorted)
    rank 0:     remove an earlier export's safetensors, create the files (headers, final sizes)
    barrier
    every rank: for each (Megatron param, Piece) it is the first holder of (the policy's export
                plan): copy the piece to the CPU a block of rows at a time, pwrite it at its offsets
    barrier     (every rank has fsync'ed its writes)
    rank 0:     index (several files), config.json, the source directory's tokenizer files
    barrier     (the directory is complete when the call returns, on every rank)

Memory per rank: one block of rows of one piece (`BLOCK_BYTES`) besides the model itself. The
directory hashes (`checkpoints.hf_safetensors.dir_digest`) to `policy_sha256()`. The index is
written last, so a directory whose export died midway has no index (or a stale single file).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints._dtypes import dtype_name, to_storage
from checkpoints.hf_safetensors import ShardWriter, create_files, plan_shards, remove_stale, write_index
from hpcrl.trainer.model import weight_tensors
from moe.hf_megatron import HFModelDims, Piece
from moe.slices import Box

BLOCK_BYTES = 16 << 20  # rows copied to the CPU and written per pwrite batch


def config_at_dtype(hf_config: dict, dtypes: set[str]) -> str:
    """config.json's text for weights stored at `dtypes`: one dtype ("bfloat16") becomes `dtype`,
    which transformers reads (5.x; `torch_dtype` before) to choose what `from_pretrained(...,
    dtype="auto")` loads in; mixed dtypes leave the config as it is. An FP8 source's
    `quantization_config` is dropped: the export is never quantized, and transformers and SGLang
    would read its weights as FP8 by it."""
    hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if len(dtypes) != 1:
        return json.dumps(hf_config, indent=2) + "\n"
    clean = {k: v for k, v in hf_config.items() if k != "torch_dtype"}
    return json.dumps({**clean, "dtype": next(iter(dtypes))}, indent=2) + "\n"


def _row_blocks(box: Box, itemsize: int) -> list[tuple[int, int]]:
    """[r0, r1) ranges of axis 0 of `box` of about BLOCK_BYTES each (one range for a 0-d box)."""
    if not box.shape:
        return [(0, 1)]
    row_bytes = max(1, box.numel // max(1, box.shape[0]) * itemsize)
    step = max(1, BLOCK_BYTES // row_bytes)
    return [(r0, min(box.shape[0], r0 + step)) for r0 in range(0, box.shape[0], step)]


@torch.no_grad()
def export_hf_dir(gpt: torch.nn.Module, dims: HFModelDims, hf_config: dict,
                  mine: Sequence[tuple[str, Piece]], out_dir: str, max_shard_bytes: int,
                  source_dir: str | None = None) -> str | None:
    """Write the HF directory `out_dir` (see the module docstring); `mine` is this rank's part of
    the export plan: (Megatron param name, Piece) pairs, each HF region held by exactly one rank.
    Returns out_dir on rank 0, None elsewhere. Every rank must see `out_dir` (a shared file system)."""
    from hpcrl.export import copy_model_files

    rank = dist.get_rank()
    params: dict[str, Any] = weight_tensors(gpt)
    dtype = next(iter(params.values())).dtype
    shapes = dims.hf_shapes()
    plan = plan_shards([(name, dtype_name(dtype), shape) for name, shape in shapes.items()], max_shard_bytes)
    out = Path(out_dir)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        remove_stale(out)
        create_files(out, plan)
    dist.barrier()
    itemsize = torch.empty((), dtype=dtype).element_size()
    with ShardWriter(out, plan) as writer:
        for n, pc in mine:
            local = params[n].detach()[pc.local_box.index]
            for r0, r1 in _row_blocks(pc.hf_box, itemsize):
                if pc.hf_box.shape:
                    part = Box((pc.hf_box.offsets[0] + r0,) + pc.hf_box.offsets[1:],
                               (r1 - r0,) + pc.hf_box.shape[1:])
                    block = local[r0:r1]
                else:
                    part, block = pc.hf_box, local
                writer.write(pc.hf_name, part, to_storage(block.cpu()))
    dist.barrier()
    if rank == 0:
        write_index(out, plan)
        (out / "config.json").write_text(config_at_dtype(hf_config, {dtype_name(dtype)}))
        if source_dir is not None:
            copy_model_files(source_dir, out)
    dist.barrier()  # every rank returns once the directory is complete
    return str(out) if rank == 0 else None
