"""hpcrl's FP8 block-scaled reader (moe/fp8_blocks.py `read_box`, which every FP8 checkpoint load goes
through) against SGLang 0.5.23's own code, run from the wheel: its dequantization
(srt/layers/quantization/fp8_utils.py `block_quant_dequant`, what its model code uses to unpack
block-scaled weights) of tensors its quantizer made (srt/layers/quantization/mxfp8_block_convert.py
`bf16_to_block_fp8_128`, DeepSeek-V3's contract: 128 x 128 blocks, scale = amax / 448), with partial
edge blocks and an expert axis. Both functions are pure torch; fp8_utils.py itself does not import on
CPU, so its function is compiled alone from the file's AST. Equal bit for bit: both compute
float32(w8) * scale, one multiply per element. Also: hpcrl's test quantizer (tests/fp8_quantize.py,
which makes every FP8 fixture) gives SGLang's bytes and scales on blocks that are not all zero."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import pytest
import torch
from fp8_quantize import quantize_blocks

from moe.fp8_blocks import read_box
from moe.slices import Box

BLOCK = 128


def _sglang_function(root: Path, relative: str, name: str):
    """`name` from the wheel's file, compiled alone (with torch and typing's names in scope)."""
    path = root / "src" / "sglang" / relative
    fn = next(n for n in ast.walk(ast.parse(path.read_text()))
              if isinstance(n, ast.FunctionDef) and n.name == name)
    scope = {"torch": torch, "List": list, "Tuple": tuple}
    exec(compile(ast.Module(body=[fn], type_ignores=[]), str(path), "exec"), scope)  # noqa: S102
    return scope[name]


@pytest.fixture(scope="module")
def sglang_fp8(sglang_root):
    return (_sglang_function(sglang_root, "srt/layers/quantization/mxfp8_block_convert.py",
                             "bf16_to_block_fp8_128"),
            _sglang_function(sglang_root, "srt/layers/quantization/fp8_utils.py", "block_quant_dequant"))


def test_hpcrls_reader_dequantizes_as_sglang(sglang_fp8):
    quantize, dequant = sglang_fp8
    gen = torch.Generator().manual_seed(0)
    # [E, N, K] expert stacks and [N, K] linears, with partial last blocks in either dimension
    w8s, scales = [], []
    for _ in range(3):
        w8, s = quantize(torch.randn(300, 200, generator=gen) * 0.02, BLOCK)
        w8s.append(w8)
        scales.append(s)
    w8_ENK, s_Enk = torch.stack(w8s), torch.stack(scales)
    assert w8_ENK.dtype == torch.float8_e4m3fn and s_Enk.shape == (3, 3, 2)
    want = dequant(w8_ENK, s_Enk, [BLOCK, BLOCK], torch.float32)
    for box in (Box.full((3, 300, 200)), Box((1, 0, 0), (1, 300, 200)), Box((0, 127, 100), (3, 2, 57)),
                Box((2, 256, 128), (1, 44, 72)), Box((1, 5, 199), (2, 290, 1))):
        got = read_box(w8_ENK, s_Enk, box, (BLOCK, BLOCK))
        assert torch.equal(got, want[box.index]), box
    w8, s = w8_ENK[0], s_Enk[0]
    for (r0, r1), (c0, c1) in itertools.product([(0, 300), (120, 140), (256, 300)], [(0, 200), (127, 129)]):
        box = Box((r0, c0), (r1 - r0, c1 - c0))
        assert torch.equal(read_box(w8, s, box, (BLOCK, BLOCK)),
                           dequant(w8, s, [BLOCK, BLOCK], torch.float32)[box.index]), box
    got_bf16 = read_box(w8, s, Box.full((300, 200)), (BLOCK, BLOCK), torch.bfloat16)
    assert torch.equal(got_bf16, dequant(w8, s, [BLOCK, BLOCK], torch.bfloat16))


def test_the_fixtures_quantizer_gives_sglangs_blocks(sglang_fp8):
    quantize, _ = sglang_fp8
    gen = torch.Generator().manual_seed(1)
    for shape in ((256, 384), (300, 200), (130, 7)):
        w = torch.randn(*shape, generator=gen).to(torch.bfloat16)
        ours_w8, ours_s = quantize_blocks(w, (BLOCK, BLOCK))
        theirs_w8, theirs_s = quantize(w, BLOCK)
        assert torch.equal(ours_s, theirs_s), shape
        assert torch.equal(ours_w8.view(torch.uint8), theirs_w8.view(torch.uint8)), shape
