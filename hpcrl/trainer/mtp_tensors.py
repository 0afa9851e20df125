"""DeepSeek's MTP tensors of a source model directory, streamed into exports and the policy hash.

A DeepSeek-V3 directory stores its `num_nextn_predict_layers` multi-token-prediction layers after
the decoder, `model.layers.{L + k}.*` (L = num_hidden_layers): embed_tokens, enorm, hnorm, eh_proj,
shared_head.{norm,head} and a whole decoder layer each. The trainer never builds them (they are not
trained); every export of the policy carries them from the directory the run started from
(model.path), so SGLang can still use them for speculative decoding:

    unquantized (bf16, float32, ...)   the stored bytes, byte for byte, at the stored dtype
    FP8 block-scaled (F8_E4M3)         dequantized (moe.fp8_blocks.read_box: exact in float32),
                                       rounded once to the export's dtype (model.dtype); the
                                       `<name>_scale_inv` tensor is not exported

`MTPSource.blocks` reads one block of rows (about BLOCK_BYTES, at least one row: one expert of a
fused [E, ...] tensor) at a time, so a 671B model's ~11 GB MTP layer is never held at once. In the
trainer's collective export each MTP tensor is written (and digested for the policy hash) by one
trainer rank, `assign_owners`: largest tensor first, to the rank with the fewest bytes to write so
far, counting the policy regions each rank writes; the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from math import prod
from pathlib import Path

import torch

from moe.fp8_blocks import FP8FormatError, check_fp8_tensors, read_box
from moe.hf_checkpoint import (CheckpointFormatError, SafetensorsFiles, StoredTensor, stored_tensors,
                               weight_block_size, weight_files)
from moe.hf_megatron import HFModelDims, mtp_names
from moe.slices import Box

BLOCK_BYTES = 16 << 20  # bytes of rows read, converted and written (or digested) at a time
# safetensors dtype tag -> torch dtype (the tags hf_safetensors.DTYPES writes; FP8 only with scales)
_TORCH = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn}


@dataclass(frozen=True, slots=True)
class MTPTensor:
    """One exported MTP tensor: its name, the dtype it is exported at, its shape, where it is stored
    and, for an FP8 tensor, its scale."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    stored: StoredTensor
    scale: StoredTensor | None

    @property
    def nbytes(self) -> int:
        return prod(self.shape) * self.dtype.itemsize


def exported_config(hf_config: dict, mtp: MTPSource) -> dict:
    """config.json of an export that carries `mtp`'s tensors: num_nextn_predict_layers 0 when it
    carries none (no source directory, or one that stores none), so SGLang's MTP speculative decoding
    says the directory has no MTP layer instead of failing on tensors it lacks."""
    if int(hf_config.get("num_nextn_predict_layers") or 0) and not mtp.tensors:
        return {**hf_config, "num_nextn_predict_layers": 0}
    return hf_config


class MTPSource(SafetensorsFiles):
    """The MTP tensors of `model_dir` for a model of `dims`, exported with FP8 ones at `export_dtype`
    (float32 or bfloat16). Reads only the index and the headers of the files holding MTP tensors;
    none when `model_dir` or `dims` is None or the model has no MTP layers (`dims.mtp_layers` 0),
    and none when the directory stores none (transformers' save_pretrained writes no MTP layer).
    CheckpointFormatError (naming file, tensor and fix) for an FP8 MTP tensor without its scale or
    with a scale grid that does not tile it, or a dtype an export cannot hold."""

    def __init__(self, model_dir: str | Path | None, dims: HFModelDims | None,
                 export_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.tensors: list[MTPTensor] = []
        self._block: tuple[int, int] | None = None
        if model_dir is None or dims is None or dims.mtp_layers == 0:
            return
        root = Path(model_dir)
        files = weight_files(root)
        stored = stored_tensors(files, set(mtp_names(files, dims.num_layers, dims.mtp_layers)))
        self._block = weight_block_size(root) if stored else None
        try:
            scales = check_fp8_tensors(stored, self._block)
        except FP8FormatError as exc:
            raise CheckpointFormatError(str(exc)) from None
        scale_names = set(scales.values())
        for name, st in sorted(stored.items()):
            if name in scale_names:
                continue
            if st.dtype not in _TORCH:
                raise CheckpointFormatError(
                    f"{st.file.name}: MTP tensor {name!r} has dtype {st.dtype}, which an export cannot "
                    f"hold (known: {sorted(_TORCH)}); convert the MTP layer to bf16")
            scale = stored[scales[name]] if name in scales else None
            dtype = export_dtype if scale is not None else _TORCH[st.dtype]
            self.tensors.append(MTPTensor(name, dtype, st.shape, st, scale))

    def entries(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(name, export dtype, shape) of every MTP tensor, sorted by name."""
        return [(t.name, t.dtype, t.shape) for t in self.tensors]

    def blocks(self, t: MTPTensor, block_bytes: int = BLOCK_BYTES) -> Iterator[tuple[Box, torch.Tensor]]:
        """(global box, its values at `t.dtype` on the CPU) for consecutive blocks of rows (axis 0)
        of `t` covering it once; a block reads about `block_bytes` (float32 bytes for an FP8
        tensor, which is dequantized in float32), at least one row."""
        if not t.shape:  # only unquantized tensors are 0-d (FP8 ones are matrices)
            yield Box.full(()), self._handle(t.stored.file).get_tensor(t.stored.name)
            return
        view = self._view(t.stored)
        item = 4 if t.scale is not None else _TORCH[t.stored.dtype].itemsize
        step = max(1, block_bytes // max(1, prod(t.shape[1:]) * item))
        for r0 in range(0, t.shape[0], step):
            box = Box((r0,) + (0,) * (len(t.shape) - 1), (min(t.shape[0], r0 + step) - r0,) + t.shape[1:])
            if t.scale is None:
                yield box, view[box.index]
            else:
                assert self._block is not None  # check_fp8_tensors pairs scales only with a block size
                yield box, read_box(view, self._view(t.scale), box, self._block, t.dtype)


def assign_owners(tensors: Sequence[MTPTensor], loads: Sequence[int]) -> dict[str, int]:
    """MTP tensor name -> the rank that writes (and digests) it: largest first (ties by name) to the
    rank with the fewest bytes so far (ties: the lowest rank), starting from `loads[r]`, the bytes
    rank r writes of the policy itself. Deterministic: every rank computes the same owners."""
    held = list(loads)
    owners: dict[str, int] = {}
    for t in sorted(tensors, key=lambda t: (-t.nbytes, t.name)):
        rank = min(range(len(held)), key=lambda r: (held[r], r))
        owners[t.name] = rank
        held[rank] += t.nbytes
    return owners
