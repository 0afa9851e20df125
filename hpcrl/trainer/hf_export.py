"""The trainer writes its policy as a HF model directory, each rank its own regions, no gather.

Collective over the trainer ranks (`MegatronPolicy.export_hf_dir` calls it):

    every rank: the same file plan (checkpoints.hf_safetensors.plan_shards over `export_entries`:
                the policy's tensors sorted by name, then the source directory's MTP tensors)
    rank 0:     remove an earlier export's safetensors, create the files (headers, final sizes)
    barrier
    every rank: for each (Megatron param, Piece) it is the first holder of (the policy's export
                plan): copy the piece to the CPU a block of rows at a time, pwrite it at its offsets;
                then the MTP tensors `mtp_tensors.assign_owners` gives it, streamed from the source
                directory a block of rows at a time (hpcrl/trainer/mtp_tensors.py)
    barrier     (every rank has fsync'ed its writes)
    rank 0:     index (several files), config.json, the source directory's tokenizer files
    barrier     (the directory is complete when the call returns, on every rank)

Dtypes, per tensor (`export_dtypes`): model.dtype, except DeepSeek-V3's router score-correction
biases (`...mlp.gate.e_score_correction_bias`), which the trainer keeps in float32 in every run and
the export stores in float32, as HF checkpoints do; MTP tensors as mtp_tensors.py says.

Memory per rank: one block of rows of one piece (`BLOCK_BYTES`) besides the model itself. The
directory hashes (`checkpoints.hf_safetensors.dir_digest`) to `policy_sha256(source_dir)`, the
policy hash over the same tensors (`sharded_digest`, docs/policy_hash.md). The index is written
last, so a directory whose export died midway has no index (or a stale single file).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from checkpoints._dtypes import dtype_name, to_storage
from checkpoints.hf_safetensors import (EXPORT_TAG, ShardWriter, create_files, plan_shards, remove_stale,
                                        write_index)
from hpcrl.trainer.model import weight_tensors
from hpcrl.trainer.mtp_tensors import MTPSource, assign_owners, exported_config
from moe.hf_megatron import HFModelDims, Piece, is_router_bias
from moe.slices import Box

BLOCK_BYTES = 16 << 20  # rows copied to the CPU and written per pwrite batch

ExportPlan = Sequence[Sequence[tuple[str, Piece]]]
"""Per trainer rank, the (Megatron param name, Piece) pairs it exports: each HF region once."""


def config_at_dtype(hf_config: dict, dtypes: set[str]) -> str:
    """config.json's text for weights stored at `dtypes`: one dtype ("bfloat16") becomes `dtype`,
    which transformers reads (5.x; `torch_dtype` before) to choose what `from_pretrained(...,
    dtype="auto")` loads in; mixed dtypes leave the config as it is. Callers pass the dtype of the
    weights (model.dtype), not the float32 router biases, which transformers keeps in float32
    whatever `dtype` says. An FP8 source's `quantization_config` is dropped: the export is never
    quantized, and transformers and SGLang would read its weights as FP8 by it."""
    hf_config = {k: v for k, v in hf_config.items() if k != "quantization_config"}
    if len(dtypes) != 1:
        return json.dumps(hf_config, indent=2) + "\n"
    clean = {k: v for k, v in hf_config.items() if k != "torch_dtype"}
    return json.dumps({**clean, "dtype": next(iter(dtypes))}, indent=2) + "\n"


def export_dtypes(dims: HFModelDims, model_dtype: torch.dtype) -> dict[str, torch.dtype]:
    """HF name -> the dtype the export stores it at (and the policy hash reads), for every tensor
    the trainer holds: `model_dtype`, except the router score-correction biases, float32 in every
    run (the trainer keeps them so: hpcrl.trainer.model.keep_expert_bias_fp32)."""
    return {name: torch.float32 if is_router_bias(name) else model_dtype for name in dims.hf_shapes()}


def export_entries(dims: HFModelDims, model_dtype: torch.dtype, mtp: MTPSource
                   ) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of every tensor of the export, in file order: the policy's sorted by
    name, then the MTP tensors of the source (sorted by name)."""
    dtypes = export_dtypes(dims, model_dtype)
    return [(n, dtypes[n], s) for n, s in dims.hf_shapes().items()] + mtp.entries()


def plan_loads(plan: ExportPlan, dtypes: Mapping[str, torch.dtype]) -> list[int]:
    """Bytes of the policy each rank writes under `plan` (what MTP tensors are balanced against)."""
    return [sum(pc.hf_box.numel * dtypes[pc.hf_name].itemsize for _, pc in mine) for mine in plan]


def mtp_blocks(mtp: MTPSource, owners: Mapping[str, int], rank: int
               ) -> Iterable[tuple[str, torch.Tensor, Box]]:
    """(name, block on the CPU, its global box) of the MTP tensors `rank` owns, a block of rows at
    a time (the source is read while this is iterated)."""
    for t in mtp.tensors:
        if owners[t.name] == rank:
            for box, block in mtp.blocks(t, BLOCK_BYTES):
                yield t.name, block, box


def sharded_digest(entries: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                   pieces: Iterable[tuple[str, torch.Tensor, Box]], device: torch.device) -> str | None:
    """The policy hash (moe/digest.py, docs/policy_hash.md) of the tensors `entries` (name, dtype,
    global shape) from `pieces`: (name, values, global box) that this rank contributes, each region
    of each tensor by exactly one rank. Pieces are digested on `device`. Collective (one all-reduce
    of LANES int64 per tensor); the hash on rank 0, None elsewhere."""
    from moe.digest import LANES, digest_box, policy_hash

    shapes = {name: shape for name, _, shape in entries}
    dtypes = {name: dtype for name, dtype, _ in entries}
    row = {name: k for k, name in enumerate(shapes)}
    lanes = torch.zeros(len(entries), LANES, dtype=torch.int64, device=device)
    for name, tensor, box in pieces:
        assert tensor.dtype == dtypes[name], (name, tensor.dtype, dtypes[name])  # the line names its dtype
        lanes[row[name]] += digest_box(name, tensor.to(device), box, shapes[name])
    if dist.get_world_size() > 1:
        dist.all_reduce(lanes)  # int64 sums wrap: the uint64 lanes add mod 2^64
    if dist.get_rank() != 0:
        return None
    lanes = lanes.cpu()
    return policy_hash((name, dtype_name(dtype), shape, lanes[row[name]]) for name, dtype, shape in entries)


def _row_blocks(box: Box, itemsize: int) -> list[tuple[int, int]]:
    """[r0, r1) ranges of axis 0 of `box` of about BLOCK_BYTES each (one range for a 0-d box)."""
    if not box.shape:
        return [(0, 1)]
    row_bytes = max(1, box.numel // max(1, box.shape[0]) * itemsize)
    step = max(1, BLOCK_BYTES // row_bytes)
    return [(r0, min(box.shape[0], r0 + step)) for r0 in range(0, box.shape[0], step)]


@torch.no_grad()
def export_hf_dir(gpt: torch.nn.Module, dims: HFModelDims, hf_config: dict, plan: ExportPlan,
                  out_dir: str, max_shard_bytes: int, source_dir: str | None = None) -> str | None:
    """Write the HF directory `out_dir` (see the module docstring); `plan[r]` is rank r's part of
    the export plan: (Megatron param name, Piece) pairs, each HF region held by exactly one rank.
    `source_dir` (model.path) gives the tokenizer files and the MTP tensors; without it the export
    has neither. Returns out_dir on rank 0, None elsewhere. Every rank must see `out_dir` and
    `source_dir` (a shared file system)."""
    from hpcrl.export import copy_model_files

    rank = dist.get_rank()
    params: dict[str, Any] = weight_tensors(gpt)
    model_dtype = next(gpt.parameters()).dtype
    dtypes = export_dtypes(dims, model_dtype)
    out = Path(out_dir)
    with MTPSource(source_dir, dims, model_dtype) as mtp:
        entries = export_entries(dims, model_dtype, mtp)
        files = plan_shards([(n, dtype_name(d), s) for n, d, s in entries], max_shard_bytes,
                            {EXPORT_TAG: "trainer"})
        owners = assign_owners(mtp.tensors, plan_loads(plan, dtypes))
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            remove_stale(out)
            create_files(out, files)
        dist.barrier()
        with ShardWriter(out, files) as writer:
            for n, pc in plan[rank]:
                local = params[n].detach()[pc.local_box.index]
                assert local.dtype == dtypes[pc.hf_name], (n, local.dtype, dtypes[pc.hf_name])
                for r0, r1 in _row_blocks(pc.hf_box, local.element_size()):
                    if pc.hf_box.shape:
                        part = Box((pc.hf_box.offsets[0] + r0,) + pc.hf_box.offsets[1:],
                                   (r1 - r0,) + pc.hf_box.shape[1:])
                        block = local[r0:r1]
                    else:
                        part, block = pc.hf_box, local
                    writer.write(pc.hf_name, part, to_storage(block.cpu()))
            for name, block, box in mtp_blocks(mtp, owners, rank):
                writer.write(name, box, to_storage(block))
        hf_config = exported_config(hf_config, mtp)
    dist.barrier()
    if rank == 0:
        write_index(out, files)
        (out / "config.json").write_text(config_at_dtype(hf_config, {dtype_name(model_dtype)}))
        if source_dir is not None:
            copy_model_files(source_dir, out)
    dist.barrier()  # every rank returns once the directory is complete
    return str(out) if rank == 0 else None
