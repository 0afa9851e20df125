"""FP8 block-scaled copies of small HF model directories, in the format of the official DeepSeek-V3 /
Kimi-K2 releases, for the tests of reading such checkpoints (nothing is downloaded).

    quantize_dir(src, dst, block=(128, 128), shards=3)   # dst: FP8 weights + scales, sharded, index
    dequantized_state_dict(dst)                           # the reference: every weight, dequantized

Which tensors are quantized: every tensor of `model.layers.*` with two or more dimensions except
norms (`*norm.weight`), routers (`*.gate.weight`), and an MTP layer's embedding / head copies
(`*embed_tokens.weight`, `*shared_head.head.weight`); for a per-expert directory that is every
linear `*.weight` of the layers, for a fused one also `experts.gate_up_proj` / `experts.down_proj`
[E, ...] (a leading expert axis is not blocked). Embeddings, lm_head, norms, routers and
`e_score_correction_bias` are copied unchanged.

A quantized tensor w_NK becomes float8_e4m3fn w8_NK plus float32 `<name>_scale_inv` s_nk, with
n = ceil(N / bN), k = ceil(K / bK) (the last block of a dimension the block does not divide is a
partial block with a scale of its own): s = amax(|w| over the block) / 448 (448 = e4m3's largest
finite value; an all-zero block gets s = 1), w8 = e4m3(clamp(w / s, -448, 448)) rounded to nearest,
and the real weight is float32(w8) * s element-wise. config.json gets DeepSeek-V3's
`quantization_config` with `weight_block_size` [bN, bK].
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

E4M3_MAX = 448.0
INDEX_FILE = "model.safetensors.index.json"
_KEEP = re.compile(r".*(norm\.weight|\.gate\.weight|embed_tokens\.weight|shared_head\.head\.weight)$")


def quantization_config(block: tuple[int, int]) -> dict:
    """config.json's `quantization_config` of the official DeepSeek-V3 release, at `block`."""
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
            "weight_block_size": [block[0], block[1]]}


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether `quantize_dir` stores this tensor as FP8 (see the module docstring)."""
    return name.startswith("model.layers.") and tensor.dim() >= 2 and not _KEEP.match(name)


def quantize_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(w8, scale_inv) of a weight (..., N, K): per (bN, bK) block, scale_inv = amax / 448 and
    w8 = e4m3(w / scale_inv); partial edge blocks are scaled by their own elements only."""
    bN, bK = block
    *lead, N, K = w.shape
    n, k = -(-N // bN), -(-K // bK)
    w32 = w.to(torch.float32)
    padded = torch.zeros(*lead, n * bN, k * bK)  # zeros do not change a block's amax
    padded[..., :N, :K] = w32
    amax = padded.reshape(*lead, n, bN, k, bK).abs().amax(dim=(-3, -1))
    scale_inv = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax)).to(torch.float32)
    s_NK = scale_inv.repeat_interleave(bN, -2).repeat_interleave(bK, -1)[..., :N, :K]
    w8 = (w32 / s_NK).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return w8, scale_inv


def dequantize(w8: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The reference dequantization, one element at a time: float32(w8[..., i, j]) *
    scale_inv[..., i // bN, j // bK] computed in float64 (exact: a 4-bit times a 24-bit
    significand fits in 53 bits) and rounded once to float32."""
    if w8.dim() > 2:
        return torch.stack([dequantize(m, s, block) for m, s in zip(w8, scale_inv)])
    bN, bK = block
    w, s = w8.double().tolist(), scale_inv.double().tolist()
    rows = [[w[i][j] * s[i // bN][j // bK] for j in range(len(w[i]))] for i in range(len(w))]
    return torch.tensor(rows, dtype=torch.float64).reshape(w8.shape).to(torch.float32)


def _load_dir(src: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = src / INDEX_FILE
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file()
             else ["model.safetensors"])
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(src / f)))
    return tensors


def quantize_dir(src_dir: str | Path, dst_dir: str | Path, block: tuple[int, int] = (128, 128),
                 shards: int = 3) -> Path:
    """Write an FP8 copy of the HF directory `src_dir` (bf16/fp32 safetensors) into `dst_dir` and
    return it: `shards` safetensors files with an index, each scale in its weight's file except
    the first quantized weight's (by name), whose scale is put in another file on purpose (a
    reader must follow the index per tensor). Other files (tokenizer, generation_config) are copied;
    config.json gains `quantization_config`."""
    from safetensors.torch import save_file

    src, dst = Path(src_dir), Path(dst_dir)
    if shards < 2:
        raise ValueError(f"shards={shards}: at least 2, so that a scale can sit apart from its weight")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in (INDEX_FILE, "config.json"):
            shutil.copyfile(f, dst / f.name)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config(block)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

    groups: list[list[tuple[str, torch.Tensor]]] = []  # a weight and its scale stay together
    for name, t in sorted(_load_dir(src).items()):
        if is_quantized(name, t):
            w8, s = quantize_blocks(t, block)
            groups.append([(name, w8), (name + "_scale_inv", s)])
        else:
            groups.append([(name, t.contiguous())])
    per = -(-len(groups) // shards)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    where = {name: files[min(g // per, shards - 1)] for g, grp in enumerate(groups) for name, _ in grp}
    apart = next(grp[1][0] for grp in groups if len(grp) == 2)
    where[apart] = files[-1] if where[apart] != files[-1] else files[0]
    tensors = {name: t for grp in groups for name, t in grp}
    for f in files:
        save_file({n: tensors[n] for n in sorted(tensors) if where[n] == f}, str(dst / f),
                  metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / INDEX_FILE).write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(where.items()))}, indent=2) + "\n")
    return dst


def dequantized_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an FP8 directory written by `quantize_dir` under its name (scales folded in):
    quantized weights dequantized element-wise in float32 (`dequantize`), the others as stored."""
    path = Path(model_dir)
    block = tuple(json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"])
    tensors = _load_dir(path)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else dequantize(t, scale, block)  # type: ignore[arg-type]
    return dict(sorted(out.items()))


class Recorder:
    """A safetensors slice view that records every index it is asked for."""

    def __init__(self, view) -> None:
        self.view, self.asked = view, []

    def __getitem__(self, index):
        self.asked.append(index)
        return self.view[index]
