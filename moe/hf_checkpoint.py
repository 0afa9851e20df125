"""A local HuggingFace model directory's weights, read by slices: what a trainer rank needs and no more.

`HFCheckpoint(dir, dims)` reads only the safetensors headers (JSON at the front of each file) and
checks them against the model's config: every tensor present, nothing unexpected, every shape
right. `read(name, box)` then returns one global box of one tensor under its *checkpoint* name
(`moe.hf_megatron.HFModelDims.hf_shapes()`), read with safetensors' `get_slice`, so a rank touches
only the bytes of its own shards: at EP8 a rank reads 1/8 of the experts.

Two on-disk expert layouts are accepted:
  * per expert, what checkpoints on the hub hold and `save_pretrained` writes by default:
    `model.layers.{i}.mlp.experts.{e}.gate_proj.weight` [I, H] (Mixtral: `block_sparse_moe.experts.{e}.w1`);
  * fused, what transformers 5.x writes with `save_original_format=False`: per layer
    `model.layers.{i}.mlp.experts.gate_up_proj` [E, 2I, H] (gate rows first), `...experts.down_proj`
    [E, H, I] and the router at `model.layers.{i}.mlp.gate.weight` for both families.
A box of a per-expert name is then a box of the fused tensor at expert e (up rows offset by I).

FP8 block-scaled checkpoints (the official DeepSeek-V3 / Kimi-K2 releases; format in
`moe.fp8_blocks`) are read as they are stored: config.json's `quantization_config` gives the block
size, a float8_e4m3fn tensor needs its float32 `<name>_scale_inv` (which may sit in another file of
the index), and `read(name, box)` reads only the box's FP8 bytes and the scale blocks overlapping it
and returns the box dequantized (float32 by default: each element is one fp8 x fp32 product, exact
before the one rounding to float32; a bf16 caller gets that value rounded once).

Errors are `CheckpointFormatError` (a ValueError) naming the directory, file, tensor, what was
expected and found, and the fix. Shape legend: E experts, I expert FFN size, H hidden.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

from moe.fp8_blocks import FP8_TAG, FP8FormatError, check_fp8_tensors, parse_quantization_config, read_box
from moe.hf_megatron import HFModelDims, expert_names, layers_past, mtp_names, router_name
from moe.slices import Box

if TYPE_CHECKING:
    import torch

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Buffers some older checkpoints carry; transformers recomputes them and ignores the stored ones.
_IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointFormatError(ValueError):
    """A model directory that cannot be loaded; the message names the file or tensor and the fix."""


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where a tensor lives on disk: file, on-disk name, shape and safetensors dtype tag."""

    file: Path
    name: str
    shape: tuple[int, ...]
    dtype: str


_Where = tuple[StoredTensor, int | None, int, StoredTensor | None]
"""(stored tensor, expert index in a fused tensor or None, row offset, its FP8 scale or None)."""

_ITEM_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4,
               "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


def read_header(file: Path) -> dict[str, Any]:
    """The JSON header of a safetensors file ({name: {dtype, shape, data_offsets}, __metadata__}),
    after checking that the file holds exactly the bytes the header describes: a file cut short by an
    interrupted download or copy (or with bytes appended) is refused here, naming the file, instead of
    failing deep inside the first read of a tensor (safetensors refuses such a file as a whole)."""
    try:
        with file.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > 100 << 20:
                raise ValueError(f"header length {length}")
            header = json.loads(f.read(length))
            size = file.stat().st_size
    except (OSError, ValueError, struct.error) as exc:
        raise CheckpointFormatError(f"{file}: not a readable safetensors file ({exc}); re-download it") \
            from None
    _check_extent(file, header, 8 + length, size)
    return header


def _check_extent(file: Path, header: dict[str, Any], data_start: int, size: int) -> None:
    """Each tensor's byte range matches its shape and dtype; the ranges end where the file does."""
    end = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            begin, stop = (int(x) for x in meta["data_offsets"])
            numel = 1
            for d in meta["shape"]:
                numel *= int(d)
        except (KeyError, TypeError, ValueError):
            raise CheckpointFormatError(f"{file}: tensor {name!r} has a malformed header entry {meta!r}; "
                                        "re-download the file") from None
        item = _ITEM_BYTES.get(meta.get("dtype"))
        if item is not None and stop - begin != numel * item:
            raise CheckpointFormatError(
                f"{file}: tensor {name!r} ({meta['dtype']} {list(meta['shape'])}) spans bytes {begin}-{stop} "
                f"of the data, {stop - begin} bytes where its shape needs {numel * item}; the file is "
                "corrupt: re-download it")
        end = max(end, stop)
    if size != data_start + end:
        what = "truncated" if size < data_start + end else "longer than its header says"
        raise CheckpointFormatError(
            f"{file}: {what}: the header's tensors end at byte {data_start + end} but the file has {size} "
            f"bytes (an interrupted download or copy?); re-download or copy the file again")


def weight_files(model_dir: Path) -> dict[str, Path]:
    """On-disk tensor name -> file, from the index (sharded) or the single model.safetensors."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointFormatError(f"{index}: not a safetensors index with a 'weight_map' ({exc!r})") \
                from None
        files = {f: model_dir / f for f in sorted(set(weight_map.values()))}
        missing = [f for f, p in files.items() if not p.is_file()]
        if missing:
            raise CheckpointFormatError(
                f"{index} names {len(missing)} file(s) that are not in {model_dir}, e.g. {missing[0]!r}; "
                "the download is incomplete: fetch the missing *.safetensors files")
        return {name: files[f] for name, f in weight_map.items()}
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {name: single for name in read_header(single) if name != "__metadata__"}
    found = sorted(p.name for p in model_dir.glob("*.safetensors"))
    hint = (f"it has {found} but no {INDEX_FILE}; restore the index" if found else
            "download the model's *.safetensors files, or use model.config_path for a random-init model")
    raise CheckpointFormatError(f"{model_dir} has no weights ({SINGLE_FILE} or {INDEX_FILE}): {hint}")


def stored_tensors(files: Mapping[str, Path],
                   names: Collection[str] | None = None) -> dict[str, StoredTensor]:
    """On-disk name -> StoredTensor for every tensor of `files` (`weight_files`), or only for `names`
    when given, read from the headers of the files that hold them (each tensor from the file the
    index places it in)."""
    wanted = set(files.values()) if names is None else {files[n] for n in names}
    stored: dict[str, StoredTensor] = {}
    for file in sorted(wanted):
        for name, meta in read_header(file).items():
            if name != "__metadata__" and files.get(name) == file and (names is None or name in names):
                stored[name] = StoredTensor(file, name, tuple(meta["shape"]), meta["dtype"])
    return stored


class SafetensorsFiles:
    """safetensors handles of the files a reader touches, each opened once and kept until close()
    (a context manager)."""

    def __init__(self) -> None:
        self._handles: dict[Path, Any] = {}

    def _handle(self, file: Path) -> Any:
        handle = self._handles.get(file)
        if handle is None:
            from safetensors import safe_open

            handle = self._handles[file] = safe_open(str(file), framework="pt")
        return handle

    def _view(self, st: StoredTensor) -> Any:
        """safetensors' lazy slice of a stored tensor."""
        return self._handle(st.file).get_slice(st.name)

    def close(self) -> None:
        self._handles.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def weight_block_size(model_dir: Path) -> tuple[int, int] | None:
    """The FP8 block size (bN, bK) that `model_dir/config.json`'s quantization_config gives, or None
    for unquantized weights (no quantization_config, or no config.json). CheckpointFormatError for a
    quantization method hpcrl cannot read."""
    path = model_dir / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointFormatError(f"{path}: not a readable JSON file ({exc}); restore the model's "
                                    "config.json") from None
    if not isinstance(cfg, dict):
        raise CheckpointFormatError(f"{path}: holds {type(cfg).__name__}, not a JSON object; restore the "
                                    "model's config.json")
    try:
        return parse_quantization_config(cfg, str(path))
    except FP8FormatError as exc:
        raise CheckpointFormatError(str(exc)) from None


def has_weights(model_dir: Path) -> bool:
    return (model_dir / INDEX_FILE).is_file() or (model_dir / SINGLE_FILE).is_file()


def score_shapes(hidden: int) -> dict[str, tuple[int, ...]]:
    """A one-label reward model's head (transformers' ...ForSequenceClassification, num_labels 1)."""
    return {"score.weight": (1, hidden), "score.bias": (1,)}


class HFCheckpoint(SafetensorsFiles):
    """The weights of a HF model directory, checked against `dims`, readable by global boxes."""

    def __init__(self, model_dir: str | Path, dims: HFModelDims, score_head: bool = False) -> None:
        """`score_head`: the directory may also be a reward model of the architecture (transformers'
        ...ForSequenceClassification with one label): `score.weight` [1, hidden] (and `score.bias`
        [1] if it has one) in place of `lm_head.weight`; `self.score_names` lists them (else empty)."""
        super().__init__()
        self.dir = Path(model_dir)
        self.dims = dims
        self.weight_block_size = weight_block_size(self.dir)
        """The FP8 block size (bN, bK) of config.json's quantization_config; None: unquantized."""
        stored = stored_tensors(weight_files(self.dir))
        self.fused = any(n.endswith(".mlp.experts.gate_up_proj") for n in stored)
        self.expected = dims.hf_shapes()
        score = {n: s for n, s in score_shapes(dims.hidden_size).items() if n in stored}
        self.score_names: list[str] = []
        if score_head and "score.weight" in score and "lm_head.weight" not in stored:
            st = stored["score.weight"]
            if st.shape != score["score.weight"]:
                raise CheckpointFormatError(
                    f"{st.file.name}: the reward model's head 'score.weight' has shape {list(st.shape)}: "
                    f"{st.shape[0]} labels; a critic's value head starts from a one-label head "
                    f"[1, {dims.hidden_size}] (num_labels: 1), or use a directory with lm_head.weight")
            self.expected = {n: s for n, s in self.expected.items() if n != "lm_head.weight"}
            self.expected.update(score)
            self.score_names = sorted(score)
        self._where = self._locate(stored)

    # -- checking --------------------------------------------------------------------------------

    def _fused_name(self, name: str) -> tuple[str, int, int] | None:
        """(on-disk fused name, expert, row offset) of a per-expert checkpoint name, or None."""
        m = _EXPERT.match(name)
        if m is None:
            return None
        layer, expert, proj = int(m.group(1)), int(m.group(3)), m.group(4)
        gate, up, down = (n.rsplit(".", 2)[-2] for n in expert_names(self.dims, layer, expert))
        prefix = f"model.layers.{layer}.mlp.experts."
        if proj == down:
            return prefix + "down_proj", expert, 0
        return prefix + "gate_up_proj", expert, 0 if proj == gate else self.dims.moe_ffn_size

    def _locate(self, stored: dict[str, StoredTensor]) -> dict[str, _Where]:
        """checkpoint name -> (stored tensor, expert index in a fused tensor or None, row offset, its
        FP8 scale or None); raises CheckpointFormatError for a missing, unexpected or misshapen
        tensor, and for an FP8 tensor without its scale, with a scale grid that does not tile it at
        the config's block size, or in a directory whose config.json has no quantization_config."""
        try:
            scales = check_fp8_tensors(stored, self.weight_block_size)
        except FP8FormatError as exc:
            raise CheckpointFormatError(str(exc)) from None
        where: dict[str, _Where] = {}
        used: set[str] = set()
        E, I, H = self.dims.num_experts, self.dims.moe_ffn_size, self.dims.hidden_size
        routers = {router_name(self.dims, i): f"model.layers.{i}.mlp.gate.weight"
                   for i in range(self.dims.num_layers)}  # fused files keep the in-memory router name
        for name, shape in self.expected.items():
            fused = self._fused_name(name) if self.fused else None
            disk = fused[0] if fused else (routers.get(name, name) if self.fused else name)
            want = shape if fused is None else ((E, 2 * I, H) if disk.endswith("gate_up_proj") else (E, H, I))
            st = stored.get(disk)
            if st is None:
                raise CheckpointFormatError(
                    f"{self.dir}: tensor {disk!r} (shape {list(want)}) is missing from the checkpoint; is "
                    f"config.json ({self.dims.family}, {self.dims.num_layers} layers, {E} experts) the one "
                    "these weights were saved with?")
            if st.shape != tuple(want):
                raise CheckpointFormatError(
                    f"{st.file.name}: tensor {disk!r} has shape {list(st.shape)}, but config.json gives "
                    f"{list(want)}; the weights do not belong to this config.json (check hidden_size, "
                    f"num_experts, moe_intermediate_size/intermediate_size, vocab_size, head_dim)")
            scale = stored[scales[disk]] if disk in scales else None
            if scale is None and st.dtype not in _SAFETENSORS_DTYPES:
                raise CheckpointFormatError(
                    f"{st.file.name}: tensor {disk!r} has dtype {st.dtype}; only "
                    f"{sorted(_SAFETENSORS_DTYPES)} weights, or {FP8_TAG} ones with block scales, are "
                    "supported: convert it to bf16")
            where[name] = (st, None, 0, scale) if fused is None else (st, fused[1], fused[2], scale)
            used.add(disk)
            if scale is not None:
                used.add(scale.name)
        # DeepSeek's MTP layers (and their FP8 scales) are not loaded; exports carry them unchanged
        mtp = set(mtp_names(stored, self.dims.num_layers, self.dims.mtp_layers))
        extra = sorted(n for n in stored if n not in used and not _IGNORED.match(n)
                       and not (n == "lm_head.weight" and self.dims.tied_embeddings) and n not in mtp)
        if extra:
            st = stored[extra[0]]
            raise CheckpointFormatError(
                f"{st.file.name}: unexpected tensor {extra[0]!r} (shape {list(st.shape)}; {len(extra)} in "
                f"all) that a {self.dims.family} model of this config.json does not have; "
                f"{self._extra_hint(extra)}")
        return where

    def _extra_hint(self, extra: list[str]) -> str:
        """Why a checkpoint holds tensors the config's model does not: layers past num_hidden_layers
        (DeepSeek's MTP layers, which config.json's num_nextn_predict_layers must count), or weights
        of another architecture."""
        past = layers_past(extra, self.dims.num_layers)
        if past and self.dims.mla:
            return (f"they are layers {past} after config.json's num_hidden_layers={self.dims.num_layers}, "
                    f"DeepSeek's multi-token-prediction layers, which config.json's num_nextn_predict_layers "
                    f"(now {self.dims.mtp_layers}) must count: set it to {past[-1] - self.dims.num_layers + 1}")
        if past:
            return (f"they are layers {past} after config.json's num_hidden_layers={self.dims.num_layers}: "
                    "the weights belong to a deeper model; use its config.json")
        shape_hint = "" if self.dims.mla else " (e.g. shared experts or dense MLP layers are not supported)"
        return f"the weights belong to another architecture or config{shape_hint}"

    # -- reading ---------------------------------------------------------------------------------

    def is_fp8(self, name: str) -> bool:
        """Whether a checkpoint-named tensor is stored as block-scaled FP8 (read() dequantizes it)."""
        return self._where[name][3] is not None

    def dtype_of(self, name: str) -> str:
        """The dtype `read(name)` returns without a dtype, as a torch dtype name ("bfloat16", ...):
        the stored one, or "float32" for an FP8 weight (its exact dequantized values; the trainer
        casts every tensor to model.dtype, so a bf16 trainer gets them rounded once)."""
        st, _, _, scale = self._where[name]
        return "float32" if scale is not None else _SAFETENSORS_DTYPES[st.dtype]

    def read(self, name: str, box: Box | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`hf[name][box]` (the whole tensor when box is None) in `dtype` (None: `dtype_of(name)`),
        reading only that region's bytes; for an FP8 weight, the box's FP8 bytes and the scale
        blocks overlapping it, dequantized in float32 (then cast to `dtype`). KeyError for a name
        the model does not have."""
        st, expert, row0, scale = self._where[name]
        box = box or Box.full(self.expected[name])
        if expert is not None:  # a per-expert name inside a fused [E, rows, cols] tensor
            box = Box((expert, box.offsets[0] + row0, box.offsets[1]), (1, *box.shape))
        view = self._view(st)
        if scale is None:
            out = view[box.index]
        else:
            assert self.weight_block_size is not None  # check_fp8_tensors pairs scales only with a block
            out = read_box(view, self._view(scale), box, self.weight_block_size)
        if expert is not None:
            out = out[0]
        return out if dtype is None else out.to(dtype)
