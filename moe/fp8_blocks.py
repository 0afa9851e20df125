"""FP8 block-scaled weights (DeepSeek-V3, Kimi-K2): read one global box and dequantize only that.

The format, as DeepSeek's official checkpoints store it (inference/kernel.py `weight_dequant`,
transformers' `FineGrainedFP8Config` and `integrations/finegrained_fp8.py`):
  * config.json carries `quantization_config` = {"quant_method": "fp8", "fmt": "e4m3",
    "activation_scheme": "dynamic", "weight_block_size": [bN, bK]} (usually [128, 128]);
  * a quantized tensor `<name>` (a linear `...proj.weight`, or a fused `...experts.gate_up_proj`) is
    float8_e4m3fn w8_NK, and beside it `<name>_scale_inv` is s_nk (float32; bf16/fp16 in some FP8
    releases, widened to float32 exactly) with
    n = ceil(N / bN), k = ceil(K / bK): the last row/column block of a dimension that bN/bK does not
    divide is a partial block with a scale of its own;
  * the real weight is w_NK[i, j] = float32(w8_NK[i, j]) * s_nk[i // bN, j // bK]. Leading axes
    (experts of a fused [E, N, K] tensor) are not blocked: the scale is [E, n, k].
Which tensors are FP8 is told by their stored dtype (F8_E4M3), not by name: in DeepSeek-V3 the
attention and MLP/expert linears are, while norms, embeddings, lm_head, the router `mlp.gate.weight`
and `e_score_correction_bias` stay bf16/float32 and have no scales.

`read_box(w8_view, s_view, box, block_NK)` reads only the FP8 bytes of `box` and only the scale
blocks that overlap it (so a rank holding one shard never materializes the full tensor), and returns
the dequantized box in float32, or in bfloat16 rounded once from that float32.
`parse_quantization_config` and `check_fp8_tensors` validate a directory's config and safetensors
headers; their `FP8FormatError` (a ValueError) names the file, key or tensor, the value and the fix.

Shape legend: N rows (output features), K columns (input features), n = ceil(N / bN) and
k = ceil(K / bK) scale blocks; a leading E is an expert axis; `_NK`/`_nk` suffixes mark which.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from moe.slices import Box

if TYPE_CHECKING:
    import torch  # read_box imports it when called: config/header validation stays torch-free

SCALE_SUFFIX = "_scale_inv"
DEFAULT_BLOCK_NK = (128, 128)  # transformers' FineGrainedFP8Config default when the key is absent
FP8_TAG = "F8_E4M3"  # safetensors dtype tag of float8_e4m3fn
SCALE_TAGS = ("F32", "BF16", "F16")
"""Scale dtypes read: DeepSeek-V3 and Kimi-K2 store float32 scales, some FP8 releases (Qwen's dense
ones) bf16 or fp16 ones, which transformers dequantizes too; each widens to float32 exactly."""


class FP8FormatError(ValueError):
    """An FP8 checkpoint hpcrl cannot read; the message names the file/key/tensor, value and fix."""


class SliceView(Protocol):
    """What safetensors' `safe_open(...).get_slice(name)` returns: indexable by a tuple of slices."""

    def __getitem__(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class HeaderTensor(Protocol):
    """A tensor as a safetensors header gives it (moe.hf_checkpoint.StoredTensor fits)."""

    @property
    def file(self) -> Any: ...
    @property
    def name(self) -> str: ...
    @property
    def shape(self) -> tuple[int, ...]: ...
    @property
    def dtype(self) -> str: ...


def scale_name(name: str) -> str:
    """The scale tensor of FP8 tensor `name` (`x.weight` -> `x.weight_scale_inv`)."""
    return name + SCALE_SUFFIX


def scale_shape(shape: tuple[int, ...], block_NK: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of a weight of `shape` (..., N, K): (..., ceil(N / bN), ceil(K / bK))."""
    *lead, N, K = shape
    bN, bK = block_NK
    return (*lead, -(-N // bN), -(-K // bK))


def parse_quantization_config(config: Mapping[str, Any], source: str = "config.json"
                              ) -> tuple[int, int] | None:
    """The FP8 block size (bN, bK) of a model config, or None when it has no quantization_config
    (a bf16/float32 directory, read as it is). Raises FP8FormatError for anything else than
    DeepSeek-style fp8/e4m3 block scaling with dynamic activation scales."""
    qc = config.get("quantization_config")
    if qc is None:
        return None
    where = f"{source}: quantization_config"
    if not isinstance(qc, Mapping):
        raise FP8FormatError(f"{where} is {qc!r}, not a JSON object; use the quantization_config of the "
                             "official checkpoint or remove it for bf16 weights")
    method = qc.get("quant_method")
    if method != "fp8":
        raise FP8FormatError(
            f"{where}.quant_method is {method!r}; hpcrl reads only 'fp8' (DeepSeek-style block-scaled "
            "e4m3) or unquantized weights: dequantize the checkpoint to bf16 first, or use the FP8 release")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FP8FormatError(f"{where}.fmt is {fmt!r}; only 'e4m3' (float8_e4m3fn weights) is supported: "
                             "convert the weights to bf16 first")
    scheme = qc.get("activation_scheme", "dynamic")
    if not isinstance(scheme, str) or scheme.lower() != "dynamic":  # transformers lower-cases it
        raise FP8FormatError(
            f"{where}.activation_scheme is {scheme!r}; only 'dynamic' is supported (a static scheme stores "
            "activation scales hpcrl does not use): use a checkpoint with dynamic activation scales")
    scale_fmt = qc.get("scale_fmt", "float")
    if scale_fmt not in ("float", "ue8m0"):
        raise FP8FormatError(f"{where}.scale_fmt is {scale_fmt!r}; expected 'float' or 'ue8m0' (the "
                             "stored scale tensors must be float32 either way)")
    block = qc.get("weight_block_size", list(DEFAULT_BLOCK_NK))
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise FP8FormatError(
            f"{where}.weight_block_size is {block!r}; it must be two positive integers [rows, cols] "
            "(DeepSeek-V3 and Kimi-K2 use [128, 128]); per-tensor FP8 scales are not supported")
    return int(block[0]), int(block[1])


def check_scale(weight: HeaderTensor, scale: HeaderTensor | None, block_NK: tuple[int, int]) -> None:
    """Check that FP8 `weight` has a floating scale tensor (SCALE_TAGS) whose grid tiles it at `block_NK`."""
    if scale is None:
        raise FP8FormatError(
            f"{weight.file}: FP8 tensor {weight.name!r} {list(weight.shape)} has no scale tensor "
            f"{scale_name(weight.name)!r}; the checkpoint is incomplete (download every shard listed "
            "in model.safetensors.index.json) or was not saved in the block-scaled FP8 format")
    if len(weight.shape) < 2:
        raise FP8FormatError(f"{weight.file}: FP8 tensor {weight.name!r} has shape {list(weight.shape)}; "
                             "block-scaled FP8 tensors are matrices [..., N, K]: convert it to bf16")
    want = scale_shape(weight.shape, block_NK)
    if tuple(scale.shape) != want:
        raise FP8FormatError(
            f"{scale.file}: scale {scale.name!r} has shape {list(scale.shape)}, but weight "
            f"{weight.name!r} {list(weight.shape)} at weight_block_size {list(block_NK)} needs "
            f"{list(want)} (ceil(N/bN), ceil(K/bK)); quantization_config.weight_block_size does not "
            "match how these weights were quantized, or the scale belongs to another weight")
    if scale.dtype not in SCALE_TAGS:
        raise FP8FormatError(f"{scale.file}: scale {scale.name!r} has dtype {scale.dtype}; only floating "
                             f"({', '.join(SCALE_TAGS)}) block scales are supported: convert the weights "
                             "to bf16")


def check_fp8_tensors(stored: Mapping[str, HeaderTensor], block_NK: tuple[int, int] | None
                      ) -> dict[str, str]:
    """Check a directory's header tensors (name -> tensor) for the FP8 format and return
    {FP8 tensor name: its scale's name}. `block_NK` None (no quantization_config) allows no FP8
    tensor and no scale. Every F8_E4M3 tensor needs its scale, every scale its FP8 tensor."""
    pairs: dict[str, str] = {}
    for name, st in sorted(stored.items()):
        if name.endswith(SCALE_SUFFIX):
            w = stored.get(name[: -len(SCALE_SUFFIX)])
            if w is None or w.dtype != FP8_TAG:
                raise FP8FormatError(
                    f"{st.file}: scale {name!r} belongs to no FP8 tensor (its weight is "
                    f"{'missing' if w is None else w.dtype}); the checkpoint is incomplete or mixed")
        elif st.dtype.startswith("F8_"):
            if st.dtype != FP8_TAG:
                raise FP8FormatError(f"{st.file}: tensor {name!r} has dtype {st.dtype}; only {FP8_TAG} "
                                     "(float8_e4m3fn) FP8 weights are supported: convert them to bf16")
            if block_NK is None:
                raise FP8FormatError(
                    f"{st.file}: tensor {name!r} is FP8 but config.json has no quantization_config; "
                    "use the config.json that came with these weights (it gives weight_block_size)")
            check_scale(st, stored.get(scale_name(name)), block_NK)
            pairs[name] = scale_name(name)
    return pairs


def _blocks(lo: int, hi: int, block: int) -> tuple[int, int]:
    """[first, last + 1) of the blocks of size `block` that overlap [lo, hi)."""
    return lo // block, -(-hi // block)


def read_box(w8_view: SliceView, s_view: SliceView, box: Box, block_NK: tuple[int, int],
             dtype: torch.dtype | None = None) -> torch.Tensor:
    """`dequant(w8)[box]` of an FP8 tensor (..., N, K) in `dtype` (None: float32; or bfloat16,
    rounded once from float32), reading `w8_view[box.index]` and only the scale blocks overlapping
    `box` (`s_view` is the scale tensor's view; `block_NK` from `parse_quantization_config`)."""
    import torch

    dtype = dtype or torch.float32
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype {dtype}: read_box returns float32 or bfloat16")
    assert len(box.shape) >= 2, box
    bN, bK = block_NK
    (r0, c0), (r1, c1) = box.offsets[-2:], box.end[-2:]
    n0, n1 = _blocks(r0, r1, bN)
    k0, k1 = _blocks(c0, c1, bK)
    lead = box.index[:-2]
    w8_NK = w8_view[box.index]
    assert w8_NK.dtype == torch.float8_e4m3fn, (w8_NK.dtype, box)  # check_fp8_tensors pairs only FP8
    w_NK = w8_NK.to(torch.float32)
    s_nk = s_view[(*lead, slice(n0, n1), slice(k0, k1))].to(torch.float32)
    if w_NK.numel() == 0:
        return w_NK.to(dtype)
    # Expand the scales over rows only (box rows x k), then scale each column block in place, so
    # no second box-sized tensor is made.
    row_block = torch.arange(r0, r1) // bN - n0
    s_Nk = s_nk.index_select(-2, row_block)
    for kb in range(k0, k1):
        lo, hi = max(kb * bK, c0) - c0, min((kb + 1) * bK, c1) - c0
        w_NK[..., lo:hi].mul_(s_Nk[..., kb - k0: kb - k0 + 1])
    return w_NK.to(dtype)
