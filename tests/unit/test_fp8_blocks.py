"""moe.fp8_blocks on real safetensors files in DeepSeek-V3's block-scaled FP8 format.

Exactness: an e4m3 value has a 4-bit significand and a float32 scale 24 bits, so their product is
exact in float64 (28 < 53 bits) and float32(float64 product) is the correctly rounded float32
product, which is what a float32 multiply gives. So every dequantized element must equal the
reference bit for bit, and the tests compare with torch.equal, not a tolerance.
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_quantize import Recorder
from safetensors import safe_open
from safetensors.torch import save_file

from moe.fp8_blocks import (FP8FormatError, check_fp8_tensors, parse_quantization_config, read_box,
                            scale_shape)
from moe.hf_checkpoint import StoredTensor, read_header
from moe.slices import Box

BLOCK = (4, 8)
# name -> weight shape: dims not multiples of the block ([10, 20]: partial last row and column
# blocks), exact multiples ([8, 16]) and a fused expert stack ([3, 10, 20]).
SHAPES = {"a.weight": (10, 20), "b.weight": (8, 16), "experts.gate_up_proj": (3, 10, 20)}
OFFICIAL_QC = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
               "weight_block_size": [128, 128]}


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for name, shape in SHAPES.items():
        out[name] = (torch.randn(shape, generator=g) * 100).to(torch.float8_e4m3fn)
        s = scale_shape(shape, BLOCK)
        # powers of two times (1, 2): scales spread over orders of magnitude, none equal by accident
        out[name + "_scale_inv"] = (2.0 ** torch.randint(-12, 4, s, generator=g)
                                    * (1 + torch.rand(s, generator=g)))
    out["norm.weight"] = torch.ones(20, dtype=torch.bfloat16)
    return out


def _reference(w8: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """w[..., i, j] = float(w8[..., i, j]) * s[..., i // bN, j // bK], element by element in float64."""
    if w8.dim() == 3:
        return torch.stack([_reference(m, sm) for m, sm in zip(w8, s)])
    bN, bK = BLOCK
    w, sl = w8.double().tolist(), s.double().tolist()
    res = [[w[i][j] * sl[i // bN][j // bK] for j in range(len(w[0]))] for i in range(len(w))]
    return torch.tensor(res, dtype=torch.float64).to(torch.float32)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("fp8") / "model.safetensors"
    tensors = _tensors()
    save_file(tensors, str(path))
    return path, tensors


def _overlapping(lo: int, hi: int, block: int) -> slice:
    """The blocks b with [b * block, (b + 1) * block) meeting [lo, hi), from the definition."""
    hit = [b for b in range(hi // block + 2) if b * block < hi and (b + 1) * block > lo]
    return slice(hit[0], hit[-1] + 1)


def test_fp8_roundtrips_through_safetensors(ckpt) -> None:
    path, tensors = ckpt
    with safe_open(str(path), "pt") as f:
        view = f.get_slice("a.weight")
        assert view.get_dtype() == "F8_E4M3"
        got = view[2:5, 3:9]
    assert got.dtype == torch.float8_e4m3fn
    assert torch.equal(got.view(torch.uint8), tensors["a.weight"][2:5, 3:9].view(torch.uint8))


def _intervals(n: int) -> list[tuple[int, int]]:
    """Every non-empty [lo, hi) inside [0, n)."""
    return [(lo, hi) for lo in range(n) for hi in range(lo + 1, n + 1)]


@pytest.mark.parametrize("name", ["a.weight", "b.weight"])
def test_every_box_equals_the_reference_and_reads_only_its_blocks(ckpt, name: str) -> None:
    path, tensors = ckpt
    N, K = SHAPES[name]
    ref = _reference(tensors[name], tensors[name + "_scale_inv"])
    # every row interval x column intervals: whole, one column, first/last column, a block exactly,
    # ones crossing block edges, the partial last block alone and with its neighbour
    cols = [(0, K), (0, 1), (K - 1, K), (8, 16), (7, 9), (3, K - 3), (15, K), (16, K), (5, 6)]
    cols = [(c0, c1) for c0, c1 in cols if c1 > c0]  # b.weight's K = 16 has no column 16
    with safe_open(str(path), "pt") as f:
        for (r0, r1), (c0, c1) in itertools.product(_intervals(N), cols):
            box = Box((r0, c0), (r1 - r0, c1 - c0))
            w = Recorder(f.get_slice(name))
            s = Recorder(f.get_slice(name + "_scale_inv"))
            got = read_box(w, s, box, BLOCK)
            assert got.dtype == torch.float32 and torch.equal(got, ref[box.index]), box
            assert w.asked == [box.index], box
            assert s.asked == [(_overlapping(r0, r1, BLOCK[0]), _overlapping(c0, c1, BLOCK[1]))], box


def test_fused_expert_stack_boxes(ckpt) -> None:
    path, tensors = ckpt
    name = "experts.gate_up_proj"
    ref = _reference(tensors[name], tensors[name + "_scale_inv"])
    boxes = [Box.full(SHAPES[name]), Box((1, 3, 5), (1, 6, 12)), Box((2, 9, 19), (1, 1, 1)),
             Box((0, 0, 16), (3, 10, 4))]
    with safe_open(str(path), "pt") as f:
        for box in boxes:
            s = Recorder(f.get_slice(name + "_scale_inv"))
            got = read_box(f.get_slice(name), s, box, BLOCK)
            assert torch.equal(got, ref[box.index]), box
            r0, c0 = box.offsets[1:]
            r1, c1 = box.end[1:]
            assert s.asked == [(box.index[0], _overlapping(r0, r1, 4), _overlapping(c0, c1, 8))], box


def test_bf16_output_is_the_float32_output_rounded_once(ckpt) -> None:
    path, tensors = ckpt
    ref = _reference(tensors["a.weight"], tensors["a.weight_scale_inv"])
    box = Box((3, 5), (6, 14))
    with safe_open(str(path), "pt") as f:
        got = read_box(f.get_slice("a.weight"), f.get_slice("a.weight_scale_inv"), box, BLOCK, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, ref[box.index].to(torch.bfloat16))


def test_matches_transformers_dequantization(ckpt) -> None:
    """Reference implementations, both CPU torch code in the installed transformers:
    `integrations.finegrained_fp8._dequantize_fp8_weight` (FP8 linears' backward pass), which takes
    the block size and handles partial edge blocks, so it checks the ceil semantics; and
    `Fp8Dequantize._dequantize_one`, the op transformers runs when loading an FP8 checkpoint with
    dequantize=True, which infers the block from the grid and so only accepts divisible shapes."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

    path, tensors = ckpt
    with safe_open(str(path), "pt") as f:
        for name, shape in SHAPES.items():
            w8, s = tensors[name], tensors[name + "_scale_inv"]
            ours = read_box(f.get_slice(name), f.get_slice(name + "_scale_inv"), Box.full(shape), BLOCK)
            assert torch.equal(ours, _dequantize_fp8_weight(w8, s, list(BLOCK), torch.float32)), name
            if all(d % b == 0 for d, b in zip(shape[-2:], BLOCK)):
                theirs = Fp8Dequantize(None)._dequantize_one(w8, s, output_dtype=torch.float32)
                assert torch.equal(ours, theirs), name


# -- bad input ---------------------------------------------------------------------------------------


def test_quantization_config_accepted() -> None:
    configs = Path(__file__).resolve().parents[2] / "moe" / "configs"
    published = json.loads((configs / "deepseek-v3.json").read_text())  # DeepSeek-V3's own config.json
    assert parse_quantization_config(published) == (128, 128)
    assert parse_quantization_config(json.loads((configs / "qwen3-30b-a3b.json").read_text())) is None
    assert parse_quantization_config({}) is None
    assert parse_quantization_config({"quantization_config": OFFICIAL_QC}) == (128, 128)
    assert parse_quantization_config({"quantization_config": {"quant_method": "fp8"}}) == (128, 128)
    qc = {**OFFICIAL_QC, "weight_block_size": [4, 8], "scale_fmt": "ue8m0"}
    assert parse_quantization_config({"quantization_config": qc}) == (4, 8)
    qc = {**OFFICIAL_QC, "activation_scheme": "Dynamic"}  # transformers lower-cases the scheme
    assert parse_quantization_config({"quantization_config": qc}) == (128, 128)


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16])
def test_half_precision_scales_read_exactly(tmp_path: Path, scale_dtype: torch.dtype) -> None:
    """Some FP8 releases store bf16/fp16 scales. Widened to float32 they are exact, and a 4-bit e4m3
    significand times an 8- (bf16) or 11-bit (fp16) one fits float32's 24: every element equals the
    float64 reference of the stored scale, bit for bit."""
    tensors = {k: v.to(scale_dtype) if k.endswith("_scale_inv") else v for k, v in _tensors().items()}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    assert check_fp8_tensors(_stored(path), BLOCK) == {n: n + "_scale_inv" for n in SHAPES}
    with safe_open(str(path), "pt") as f:
        for name, shape in SHAPES.items():
            got = read_box(f.get_slice(name), f.get_slice(name + "_scale_inv"), Box.full(shape), BLOCK)
            assert torch.equal(got, _reference(tensors[name], tensors[name + "_scale_inv"])), name


@pytest.mark.parametrize("key, value, fix", [
    ("quant_method", "gptq", "dequantize the checkpoint to bf16"),
    ("fmt", "e5m2", "convert the weights to bf16"),
    ("activation_scheme", "static", "dynamic activation scales"),
    ("scale_fmt", "int8", "expected 'float' or 'ue8m0'"),
    ("weight_block_size", [128], "two positive integers"),
    ("weight_block_size", [0, 128], "two positive integers"),
    ("weight_block_size", [128.0, 128], "two positive integers"),
    ("weight_block_size", [True, 128], "two positive integers"),
    ("weight_block_size", "128", "two positive integers"),
])
def test_quantization_config_errors(key: str, value, fix: str) -> None:
    with pytest.raises(FP8FormatError) as err:
        parse_quantization_config({"quantization_config": {**OFFICIAL_QC, key: value}}, "m/config.json")
    msg = str(err.value)
    assert f"m/config.json: quantization_config.{key} is {value!r}" in msg and fix in msg


def _stored(path: Path) -> dict[str, StoredTensor]:
    return {n: StoredTensor(path, n, tuple(m["shape"]), m["dtype"])
            for n, m in read_header(path).items() if n != "__metadata__"}


def test_check_fp8_tensors_pairs_every_fp8_tensor(ckpt) -> None:
    path, _ = ckpt
    assert check_fp8_tensors(_stored(path), BLOCK) == {n: n + "_scale_inv" for n in SHAPES}


def _bad(tmp_path: Path, tensors: dict[str, torch.Tensor], block=BLOCK) -> str:
    path = tmp_path / "model-00001-of-00002.safetensors"
    save_file(tensors, str(path))
    with pytest.raises(FP8FormatError) as err:
        check_fp8_tensors(_stored(path), block)
    assert path.name in str(err.value)
    return str(err.value)


def test_missing_scale(tmp_path: Path) -> None:
    t = _tensors()
    del t["a.weight_scale_inv"]
    msg = _bad(tmp_path, t)
    assert "FP8 tensor 'a.weight' [10, 20] has no scale tensor 'a.weight_scale_inv'" in msg
    assert "download every shard" in msg


def test_scale_grid_that_does_not_tile_the_weight(tmp_path: Path) -> None:
    t = _tensors()
    t["a.weight_scale_inv"] = torch.ones(2, 2)  # floor(10/4), floor(20/8): the edge blocks are missing
    msg = _bad(tmp_path, t)
    assert "'a.weight_scale_inv' has shape [2, 2]" in msg and "'a.weight' [10, 20]" in msg
    assert "weight_block_size [4, 8] needs [3, 3]" in msg and "does not match" in msg
    # the right grids for another block size: the config's block is the one that is wrong
    assert "needs [1, 1]" in _bad(tmp_path, _tensors(), block=(128, 128))


def test_other_bad_tensors(tmp_path: Path) -> None:
    t = _tensors()
    t["a.weight_scale_inv"] = t["a.weight_scale_inv"].to(torch.float64)
    assert "has dtype F64; only floating (F32, BF16, F16) block scales" in _bad(tmp_path, t)
    t = _tensors()
    t["a.weight"] = t["a.weight"].to(torch.bfloat16)
    assert "scale 'a.weight_scale_inv' belongs to no FP8 tensor (its weight is BF16)" in _bad(tmp_path, t)
    t = _tensors()
    t["a.weight"] = t["a.weight"].to(torch.float8_e5m2)
    assert "'a.weight' has dtype F8_E5M2; only F8_E4M3" in _bad(tmp_path, t)
    t = {**_tensors(), "v": torch.ones(5).to(torch.float8_e4m3fn), "v_scale_inv": torch.ones(1)}
    assert "FP8 tensor 'v' has shape [5]; block-scaled FP8 tensors are matrices" in _bad(tmp_path, t)
    path = tmp_path / "x.safetensors"
    save_file(_tensors(), str(path))
    with pytest.raises(FP8FormatError, match="'a.weight' is FP8 but config.json has no quantization_config"):
        check_fp8_tensors(_stored(path), None)


def test_read_box_refuses_other_dtypes(ckpt) -> None:
    path, _ = ckpt
    with safe_open(str(path), "pt") as f, pytest.raises(ValueError, match="float32 or bfloat16"):
        read_box(f.get_slice("a.weight"), f.get_slice("a.weight_scale_inv"), Box.full((10, 20)), BLOCK,
                 torch.float16)


def test_validation_does_not_import_torch() -> None:
    """`hpcrl validate` parses configs and headers without torch; only read_box imports it."""
    code = ("import sys, moe.fp8_blocks as m; m.parse_quantization_config({}); "
            "assert 'torch' not in sys.modules, sorted(sys.modules)")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
