"""The policy's weights as HuggingFace sees them, without a gather: the export plan (each HF region
from the lowest rank that holds it), the full state dict on rank 0 (debug sizes and tests), the
layout-independent policy hash (docs/policy_hash.md) and the sharded HF directory export
(hpcrl/trainer/hf_export.py). A mixin of `MegatronPolicy` (hpcrl/trainer/policy.py), whose `dims`,
`gpt`, `rank`, `device`, `hf_config` and `_export_plan` it reads; every method is collective over
the trainer ranks.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.distributed as dist

from hpcrl.trainer.model import weight_tensors
from moe.hf_megatron import RankCoords, local_params


class PolicyExport:
    """Export plan, HF state dict, policy hash and HF directory of a `MegatronPolicy`."""

    def _make_export_plan(self, all_coords: list[RankCoords]) -> list[list[tuple[str, Any]]]:
        """Per global rank, the (param name, Piece) it sends to rank 0: each HF region once,
        from the lowest rank that holds it."""
        seen: set[tuple[str, Any]] = set()
        plan: list[list[tuple[str, Any]]] = []
        for coords in all_coords:
            mine = []
            for p in local_params(self.dims, coords):
                for pc in p.pieces:
                    if (pc.hf_name, pc.hf_box) not in seen:
                        seen.add((pc.hf_name, pc.hf_box))
                        mine.append((p.name, pc))
            plan.append(mine)
        covered = sum(pc.hf_box.numel for mine in plan for _, pc in mine)
        assert covered == sum(math.prod(s) for s in self.dims.hf_shapes().values()), covered
        return plan

    @torch.no_grad()
    def export_hf_state_dict(self) -> dict[str, torch.Tensor] | None:
        """Full HF checkpoint-named policy tensors (CPU, sorted by name) on trainer rank 0, at the
        export's dtypes (hpcrl.trainer.hf_export.export_dtypes: model.dtype, the router biases
        float32); None elsewhere. No MTP tensors (the trainer holds none). Collective: every rank
        sends rank 0 the regions it is the first holder of, one flat message per dtype."""
        from hpcrl.trainer.hf_export import export_dtypes

        params = weight_tensors(self.gpt)
        dtypes = export_dtypes(self.dims, next(self.gpt.parameters()).dtype)
        order = sorted(set(dtypes.values()), key=str)  # the messages' order, the same on every rank
        mine = self._export_plan[self.rank]
        if self.rank != 0:
            for dtype in order:
                flat = [params[n][pc.local_box.index].reshape(-1) for n, pc in mine
                        if dtypes[pc.hf_name] == dtype]
                if flat:
                    dist.send(torch.cat(flat).contiguous(), dst=0)
            return None
        out = {name: torch.empty(shape, dtype=dtypes[name]) for name, shape in self.dims.hf_shapes().items()}
        for n, pc in mine:
            out[pc.hf_name][pc.hf_box.index] = params[n][pc.local_box.index].cpu()
        for src in range(1, len(self._export_plan)):
            for dtype in order:
                pieces = [pc for _, pc in self._export_plan[src] if dtypes[pc.hf_name] == dtype]
                if not pieces:
                    continue
                flat = torch.empty(sum(pc.hf_box.numel for pc in pieces), dtype=dtype, device=self.device)
                dist.recv(flat, src=src)
                flat, offset = flat.cpu(), 0
                for pc in pieces:
                    out[pc.hf_name][pc.hf_box.index] = flat[offset: offset + pc.hf_box.numel].view(
                        pc.hf_box.shape)
                    offset += pc.hf_box.numel
        return out

    @torch.no_grad()
    def policy_sha256(self, source_dir: str | None = None) -> str | None:
        """The layout-independent policy hash (docs/policy_hash.md) of the tensors
        `export_hf_dir(..., source_dir)` writes, each at its export dtype, on rank 0; None elsewhere.
        `source_dir` (model.path) adds its MTP tensors (DeepSeek-V3), as the export carries them.
        Collective, no gather: each rank digests, where they live, the HF regions it is the first
        holder of (the export plan) and streams the MTP tensors it would write; one all-reduce of
        LANES int64 per tensor."""
        from hpcrl.trainer.hf_export import (export_dtypes, export_entries, mtp_blocks, plan_loads,
                                             sharded_digest)
        from hpcrl.trainer.mtp_tensors import MTPSource, assign_owners

        params = weight_tensors(self.gpt)
        model_dtype = next(self.gpt.parameters()).dtype
        pieces = [(pc.hf_name, params[n].detach()[pc.local_box.index], pc.hf_box)
                  for n, pc in self._export_plan[self.rank]]
        with MTPSource(source_dir, self.dims, model_dtype) as mtp:
            owners = assign_owners(mtp.tensors, plan_loads(self._export_plan, export_dtypes(self.dims,
                                                                                            model_dtype)))
            return sharded_digest(export_entries(self.dims, model_dtype, mtp),
                                  itertools.chain(pieces, mtp_blocks(mtp, owners, self.rank)), self.device)

    def sharded_hash(self, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, pieces: Any) -> str | None:
        """The policy hash's definition over the tensors `shapes` (name -> global shape, in that
        order) of `dtype`, from `pieces`: (name, local tensor, its global box) that this rank
        contributes, each region of each tensor by exactly one rank (the policy and PPO's critic).
        Collective; the hash on rank 0, None elsewhere."""
        from moe.digest import LANES, digest_box, dtype_name, policy_hash

        row = {name: k for k, name in enumerate(shapes)}
        lanes = torch.zeros(len(shapes), LANES, dtype=torch.int64, device=self.device)
        for name, tensor, box in pieces:
            lanes[row[name]] += digest_box(name, tensor, box, shapes[name])
        if dist.get_world_size() > 1:
            dist.all_reduce(lanes)  # int64 sums wrap: the uint64 lanes add mod 2^64
        if self.rank != 0:
            return None
        lanes = lanes.cpu()
        dtype_str = dtype_name(dtype)
        return policy_hash((name, dtype_str, shape, lanes[row[name]]) for name, shape in shapes.items())

    def export_hf_dir(self, out_dir: str, max_shard_bytes: int, source_dir: str | None = None) -> str | None:
        """Write the policy as a HF model directory (sharded safetensors, index, config.json; the
        tokenizer files and DeepSeek's MTP tensors of `source_dir`, model.path, if given); see
        hpcrl/trainer/hf_export.py. Collective, no gather: each rank writes the regions it is the
        first holder of and the MTP tensors it is given. Returns out_dir on rank 0. The directory
        hashes (dir_digest) to `policy_sha256(source_dir)`."""
        from hpcrl.trainer.hf_export import export_hf_dir

        return export_hf_dir(self.gpt, self.dims, self.hf_config, self._export_plan, out_dir,
                             max_shard_bytes, source_dir)
