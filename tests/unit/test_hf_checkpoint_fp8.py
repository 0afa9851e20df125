"""moe.hf_checkpoint on FP8 block-scaled directories in the official DeepSeek-V3 / Kimi-K2 format
(tests/fp8_quantize.py makes them from the tiny-qwen3-moe and tiny-deepseek-v3 presets and a fused
Mixtral saved with transformers' save_pretrained): every box read equals the element-wise
dequantized reference, scales are followed across shard files, the trainer's and the reference
engine's load paths get the dequantized weights, and each bad FP8 directory is refused by
`hpcrl validate` (exit 2) with one message naming the file, tensor or key, the value and the fix.

Exactness: a dequantized element is float32(fp8) * float32(scale_inv): the product of a 4-bit and a
24-bit significand has at most 28 bits, so it is exact in float64 and the float32 multiply rounds it
once, to the same float32 the reference gets by rounding the float64 product. Reads are therefore
compared with torch.equal, not a tolerance; a bf16 read is that float32 rounded once more.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fp8_quantize import (E4M3_MAX, Recorder, dequantize, dequantized_state_dict, is_quantized, quantization_config,
                          quantize_dir)
from hf_fixtures import model_dir, validate
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from moe.hf_checkpoint import CheckpointFormatError, HFCheckpoint, read_header
from moe.hf_megatron import HFModelDims, hf_fused_to_checkpoint
from moe.slices import Box

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"
BLOCK = (24, 40)  # tiles none of the tiny models' 64 / 32 dims: partial last blocks everywhere
INDEX = "model.safetensors.index.json"


def preset(name: str) -> dict:
    from hpcrl.models.presets import load_hf_config

    return load_hf_config(name, None)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8")
    qwen = model_dir(root / "qwen", config=preset("tiny-qwen3-moe"), seed=3, tokenizer=False)
    mixtral = model_dir(root / "mixtral", "mixtral", seed=4, fused=True, tokenizer=False)
    # MLA (q_a/q_b, kv_a_proj_with_mqa [kv_lora_rank + rope dim, H], kv_b), a dense first layer,
    # shared experts, a sigmoid router with its float32 e_score_correction_bias
    deepseek = model_dir(root / "deepseek", config=preset("tiny-deepseek-v3"), seed=5, tokenizer=False)
    return {"src": qwen, "qwen": quantize_dir(qwen, root / "qwen-fp8", BLOCK, shards=3),
            "qwen-128": quantize_dir(qwen, root / "qwen-fp8-128", (128, 128), shards=2),
            "qwen-16x32": quantize_dir(qwen, root / "qwen-fp8-16x32", (16, 32), shards=2),
            "mixtral": quantize_dir(mixtral, root / "mixtral-fp8", BLOCK, shards=3),
            "deepseek": quantize_dir(deepseek, root / "deepseek-fp8", BLOCK, shards=3)}


def dims_of(path: Path) -> HFModelDims:
    return HFModelDims.from_hf_config(json.loads((path / "config.json").read_text()))


def weight_map(path: Path) -> dict[str, str]:
    return json.loads((path / INDEX).read_text())["weight_map"]


def load_dir(path: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(set(weight_map(path).values())):
        out.update(load_file(str(path / f)))
    return out


# -- the helper writes the official format -------------------------------------------------------


def test_quantize_dir_writes_the_official_format(dirs: dict[str, Path]) -> None:
    src, fp8 = load_dir(dirs["src"]), dirs["qwen"]
    cfg = json.loads((fp8 / "config.json").read_text())
    assert cfg["quantization_config"] == {"activation_scheme": "dynamic", "fmt": "e4m3",
                                          "quant_method": "fp8", "weight_block_size": [24, 40]}
    files = sorted(p.name for p in fp8.glob("*.safetensors"))
    assert len(files) == 3 and sorted(set(weight_map(fp8).values())) == files
    headers = {n: m for f in files for n, m in read_header(fp8 / f).items() if n != "__metadata__"}
    assert set(headers) == set(weight_map(fp8))
    quantized = {n for n, t in src.items() if is_quantized(n, t)}
    # every attention and expert linear, and nothing else (embed, lm_head, norms, routers)
    assert quantized == {n for n in src if ".self_attn." in n and n.endswith("_proj.weight")
                         or ".experts." in n}
    assert {n for n, m in headers.items() if m["dtype"] == "F8_E4M3"} == quantized
    assert {n for n in headers if n.endswith("_scale_inv")} == {n + "_scale_inv" for n in quantized}
    stored = load_dir(fp8)
    for name, w in src.items():
        if name not in quantized:
            assert torch.equal(stored[name], w), name  # copied unchanged
            continue
        w8, s = stored[name], stored[name + "_scale_inv"]
        N, K = w.shape
        assert s.dtype == torch.float32 and s.shape == (-(-N // 24), -(-K // 40)), name
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                blk = w[i * 24:(i + 1) * 24, j * 40:(j + 1) * 40]  # partial at the edges
                assert s[i, j] == blk.abs().max() / E4M3_MAX, (name, i, j)
        # e4m3 rounds x = w / s (|x| <= 448) to within half a step: 2^-4 |x| for normals
        # (|x| >= 2^-6), half the subnormal step 2^-10 below; times s. The fp32 division and the
        # dequantizing product round once each (<= 2^-24 relative): 2^-22 |w| covers both.
        deq = dequantize(w8, s, (24, 40))
        s_NK = s.repeat_interleave(24, 0).repeat_interleave(40, 1)[:N, :K]
        x = w.abs() / s_NK
        bound = s_NK * torch.maximum(x * 2.0**-4, torch.full_like(x, 2.0**-10)) + w.abs() * 2.0**-22
        assert bool(((deq - w).abs() <= bound).all()), name
    wm = weight_map(fp8)
    apart = [n for n, f in wm.items() if n.endswith("_scale_inv") and wm[n[:-10]] != f]
    assert apart, "quantize_dir must put at least one scale in another file than its weight"


def test_the_format_is_transformers_finegrained_fp8(dirs: dict[str, Path]) -> None:
    """transformers 5.24's own FP8 integration agrees with the helper's files: its dequantization
    (Fp8Dequantize, what `from_pretrained(..., FineGrainedFP8Config(dequantize=True))` runs per
    tensor; it infers the block from the scale grid, so the directory's block divides every weight)
    gives the reference bit for bit, and its quantizer (Fp8Quantize, what it saves) names, shapes and
    types the same tensors, with scales within its two roundings (448 / amax, then 1 / that) of
    amax / 448 and FP8 codes at most one e4m3 step apart where that changes a rounding."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, Fp8Quantize

    path = dirs["qwen-16x32"]
    src, stored, ref = load_dir(dirs["src"]), load_dir(path), dequantized_state_dict(path)

    class Quantizer:
        quantization_config = FineGrainedFP8Config(weight_block_size=[16, 32])

    for name, w in src.items():
        if not is_quantized(name, w):
            continue
        w8, s = stored[name], stored[name + "_scale_inv"]
        theirs_deq = Fp8Dequantize(Quantizer())._dequantize_one(w8, s, output_dtype=torch.float32)
        assert torch.equal(theirs_deq, ref[name]), name
        theirs = Fp8Quantize(Quantizer())._quantize_one(name, w)
        assert sorted(theirs) == [name, name + "_scale_inv"]
        t8, ts = theirs[name], theirs[name + "_scale_inv"]
        assert (t8.dtype, t8.shape, ts.dtype, ts.shape) == (w8.dtype, w8.shape, s.dtype, s.shape), name
        assert bool(((ts - s).abs() <= 4 * 2.0**-24 * s).all()), name  # 3 roundings of amax / 448
        codes = (t8.view(torch.uint8).int() - w8.view(torch.uint8).int()).abs()
        assert int(codes.max()) <= 1, name  # same sign bit, adjacent magnitude codes


# -- reading -------------------------------------------------------------------------------------


def edge_boxes(shape: tuple[int, ...], block: tuple[int, int]) -> list[Box]:
    """Boxes of a 2-D tensor that start, end or straddle block edges, TP-like halves, one element,
    the last (partial) block alone, and the whole tensor."""
    N, K = shape
    bN, bK = block
    rows = [(0, N), (0, N // 2), (N // 2, N), (bN - 1, bN + 1), (bN, min(N, 2 * bN)), (N - 1, N),
            ((N - 1) // bN * bN, N), (1, N - 1)]
    cols = [(0, K), (K // 2, K), (bK - 1, min(K, bK + 3)), ((K - 1) // bK * bK, K), (3, 4), (1, K - 1)]
    return [Box((r0, c0), (r1 - r0, c1 - c0)) for r0, r1 in rows for c0, c1 in cols
            if 0 <= r0 < r1 <= N and 0 <= c0 < c1 <= K]


@pytest.mark.parametrize("which", ["qwen", "qwen-128", "mixtral", "deepseek"])
def test_every_tensor_and_edge_box_equals_the_dequantized_reference(dirs: dict[str, Path],
                                                                     which: str) -> None:
    path = dirs[which]
    dims = dims_of(path)
    ref = dequantized_state_dict(path)
    if which == "mixtral":  # fused [E, 2I, H] / [E, H, I] on disk: the checkpoint names are per expert
        ref = hf_fused_to_checkpoint(ref, dims)
    block = tuple(json.loads((path / "config.json").read_text())["quantization_config"]["weight_block_size"])
    with HFCheckpoint(path, dims) as ckpt:
        assert ckpt.weight_block_size == block and ckpt.fused == (which == "mixtral")
        assert list(ckpt.expected) == list(ref)
        # FP8: every linear of the layers (attention, MLA, dense, shared and routed experts)
        assert {n for n in ckpt.expected if ckpt.is_fp8(n)} == {
            n for n, t in ref.items() if n.startswith("model.layers.") and t.dim() == 2
            and not n.endswith(("norm.weight", ".gate.weight"))}
        for name, want in ref.items():
            got = ckpt.read(name)
            assert got.dtype == want.dtype and torch.equal(got, want), name
            assert ckpt.dtype_of(name) == str(want.dtype).removeprefix("torch."), name
            if not ckpt.is_fp8(name):
                continue
            assert ckpt.dtype_of(name) == "float32"
            for box in edge_boxes(tuple(want.shape), block):
                assert torch.equal(ckpt.read(name, box), want[box.index]), (name, box)
            box = edge_boxes(tuple(want.shape), block)[-1]
            bf16 = ckpt.read(name, box, dtype=torch.bfloat16)
            assert bf16.dtype == torch.bfloat16 and torch.equal(bf16, want[box.index].to(torch.bfloat16))
        unquantized = "model.layers.0.input_layernorm.weight"
        assert not ckpt.is_fp8(unquantized) and ckpt.dtype_of(unquantized) == "float32"


@pytest.mark.parametrize("which", ["qwen", "mixtral"])
def test_a_box_reads_only_its_fp8_bytes_and_overlapping_scale_blocks(dirs: dict[str, Path], which: str,
                                                                     monkeypatch) -> None:
    path = dirs[which]
    with HFCheckpoint(path, dims_of(path)) as ckpt:
        views: dict[str, Recorder] = {}
        real = ckpt._view
        monkeypatch.setattr(ckpt, "_view", lambda st: views.setdefault(st.name, Recorder(real(st))))
        # 24-row, 40-column blocks; columns 39..41 meet column blocks 0 and 1
        if which == "qwen":  # q_proj [64, 64]: rows 20..50 meet row blocks 0, 1, 2
            name = "model.layers.1.self_attn.q_proj.weight"
            ckpt.read(name, Box((20, 39), (30, 2)))
            assert views[name].asked == [(slice(20, 50), slice(39, 41))]
            assert views[name + "_scale_inv"].asked == [(slice(0, 3), slice(0, 2))]
        else:  # expert 2's up rows 5..25 are rows 37..57 of the fused gate_up_proj [4, 64, 64] (I = 32):
            # row blocks 1 and 2
            ckpt.read("model.layers.1.block_sparse_moe.experts.2.w3.weight", Box((5, 39), (20, 2)))
            fused = "model.layers.1.mlp.experts.gate_up_proj"
            assert views[fused].asked == [(slice(2, 3), slice(37, 57), slice(39, 41))]
            assert views[fused + "_scale_inv"].asked == [(slice(2, 3), slice(1, 3), slice(0, 2))]


def test_a_scale_in_another_file_than_its_weight(dirs: dict[str, Path]) -> None:
    path = dirs["qwen"]
    wm = weight_map(path)
    apart = sorted(n[:-10] for n in wm if n.endswith("_scale_inv") and wm[n] != wm[n[:-10]])
    assert apart == ["model.layers.0.mlp.experts.0.down_proj.weight"]
    name = apart[0]
    with safe_open(str(path / wm[name]), "pt") as f:
        assert name + "_scale_inv" not in f.keys()
    with HFCheckpoint(path, dims_of(path)) as ckpt:
        assert torch.equal(ckpt.read(name), dequantized_state_dict(path)[name])


# -- the load paths -------------------------------------------------------------------------------


def test_reference_engine_loads_the_fp8_directory(dirs: dict[str, Path]) -> None:
    from hpcrl.rollout.engine import ReferenceModel

    path = dirs["qwen"]
    cfg = json.loads((path / "config.json").read_text())
    engine = ReferenceModel(cfg, seed=123)
    ref = dequantized_state_dict(path)
    assert engine.load_model_dir(str(path)) == len(ref)
    for name, want in ref.items():
        assert torch.equal(engine.get_weight(name), want), name


def _trainer_worker(*paths: str) -> None:
    """In a fresh process (a one-rank gloo world): MegatronPolicy at fp32 and bf16 loads each FP8
    directory through its model.path route (load_hf_dir -> weight_init.hf_dir_source ->
    HFCheckpoint.read) and holds the dequantized weights, bf16 rounded once from them."""
    import datetime

    import torch.distributed as dist

    from hpcrl.config.schema import AlgorithmConfig, TrainerConfig
    from hpcrl.trainer.policy import MegatronPolicy
    from moe.digest import state_dict_digest

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=120))
    for path in paths:
        cfg = json.loads((Path(path) / "config.json").read_text())
        ref = dequantized_state_dict(path)
        fp8 = {n[: -len("_scale_inv")] for n in weight_map(Path(path)) if n.endswith("_scale_inv")}
        for dtype in (torch.float32, torch.bfloat16):
            dtype_name = str(dtype).removeprefix("torch.")
            name = f"{cfg['model_type']} {dtype_name}"
            policy = MegatronPolicy(cfg, TrainerConfig(), AlgorithmConfig(kl_coef=0.1), dtype=dtype_name)
            policy.load_hf_dir(path)
            got = policy.export_hf_state_dict()
            assert got is not None and list(got) == list(ref)
            for n, want in ref.items():
                assert torch.equal(got[n], want.to(got[n].dtype)), (name, n)
                assert n not in fp8 or got[n].dtype == dtype, (name, n, got[n].dtype)
            if dtype == torch.float32:
                assert policy.policy_sha256() == state_dict_digest(ref)
            print(f"trainer {name} OK", flush=True)


@pytest.mark.megatron
def test_trainer_loads_the_dequantized_weights(dirs: dict[str, Path]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    paths = (str(dirs["qwen"]), str(dirs["deepseek"]))
    code = (f"import sys; sys.path[:0] = [{str(TESTS)!r}, {str(TESTS / 'unit')!r}]; "
            f"from test_hf_checkpoint_fp8 import _trainer_worker; _trainer_worker(*{paths!r})")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=240,
                          cwd=REPO, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for family in ("qwen3_moe", "deepseek_v3"):
        assert f"trainer {family} float32 OK" in out and f"trainer {family} bfloat16 OK" in out, out


# -- bad FP8 directories: hpcrl validate exits 2 with one message ------------------------------


def edit_config(path: Path, **qc) -> None:
    cfg = json.loads((path / "config.json").read_text())
    if qc.pop("drop", False):
        del cfg["quantization_config"]
    else:
        cfg["quantization_config"].update(qc)
    (path / "config.json").write_text(json.dumps(cfg))


def drop_tensor(path: Path, name: str) -> Path:
    """Remove `name` from its file and the index; returns the file it was in."""
    index = json.loads((path / INDEX).read_text())
    file = path / index["weight_map"].pop(name)
    tensors = load_file(str(file))
    del tensors[name]
    save_file(tensors, str(file), metadata={"format": "pt"})
    (path / INDEX).write_text(json.dumps(index))
    return file


def test_the_fp8_directory_validates(dirs: dict[str, Path], tmp_path: Path) -> None:
    rc, out = validate(tmp_path, dirs["qwen-128"])
    assert rc == 0, out


def test_a_missing_scale(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = Path(shutil.copytree(dirs["qwen"], tmp_path / "m"))
    name = "model.layers.1.self_attn.o_proj.weight"
    drop_tensor(path, name + "_scale_inv")
    rc, out = validate(tmp_path, path)
    assert rc == 2 and "model.path=" in out, out
    assert f"{path / weight_map(path)[name]}: FP8 tensor '{name}' [64, 64] has no scale tensor" in out, out
    assert f"'{name}_scale_inv'" in out and "download every shard" in out, out


def test_a_block_size_that_does_not_tile_the_weights(dirs: dict[str, Path], tmp_path: Path) -> None:
    """The scales were made at [24, 40]; a config saying [32, 32] needs other grids."""
    path = Path(shutil.copytree(dirs["qwen"], tmp_path / "m"))
    edit_config(path, weight_block_size=[32, 32])
    rc, out = validate(tmp_path, path)
    assert rc == 2 and "model.path=" in out, out
    # the first FP8 tensor by name: layer 0's expert 0 down_proj [64, 32], scale grid [3, 1] at [24, 40]
    scale = "model.layers.0.mlp.experts.0.down_proj.weight_scale_inv"
    assert f"scale '{scale}' has shape [3, 1]" in out, out
    assert "[64, 32] at weight_block_size [32, 32] needs [2, 1]" in out, out
    assert str(path / weight_map(path)[scale]) in out and "does not match" in out, out


@pytest.mark.parametrize("key, value, fix", [
    ("quant_method", "gptq", "dequantize the checkpoint to bf16 first"),
    ("activation_scheme", "static", "use a checkpoint with dynamic activation scales"),
])
def test_an_unsupported_quantization(dirs: dict[str, Path], tmp_path: Path, key: str, value: str,
                                     fix: str) -> None:
    path = Path(shutil.copytree(dirs["qwen"], tmp_path / "m"))
    edit_config(path, **{key: value})
    rc, out = validate(tmp_path, path)
    assert rc == 2 and "model.path=" in out, out
    assert f"{path / 'config.json'}: quantization_config.{key} is {value!r}" in out and fix in out, out


def test_fp8_weights_without_quantization_config(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = Path(shutil.copytree(dirs["qwen"], tmp_path / "m"))
    edit_config(path, drop=True)
    rc, out = validate(tmp_path, path)
    assert rc == 2 and "model.path=" in out, out
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    assert f"{path / weight_map(path)[name]}: tensor '{name}' is FP8 but config.json has no " \
           "quantization_config" in out and "use the config.json that came with these weights" in out, out


def test_fp8_errors_are_checkpoint_format_errors(dirs: dict[str, Path], tmp_path: Path) -> None:
    """What the trainer and the engine get when they open a bad directory without validation."""
    path = Path(shutil.copytree(dirs["mixtral"], tmp_path / "m"))
    name = "model.layers.1.mlp.experts.down_proj"
    drop_tensor(path, name + "_scale_inv")
    with pytest.raises(CheckpointFormatError, match=f"FP8 tensor '{name}' \\[4, 64, 32\\] has no scale"):
        HFCheckpoint(path, dims_of(path))
    (path / "config.json").write_text("{")
    with pytest.raises(CheckpointFormatError, match="config.json: not a readable JSON file"):
        HFCheckpoint(path, dims_of(dirs["mixtral"]))


def test_quantization_config_helper_is_deepseeks() -> None:
    """The helper's config is DeepSeek-V3's published one (moe/configs/deepseek-v3.json) at [128, 128]."""
    published = json.loads((REPO / "moe" / "configs" / "deepseek-v3.json").read_text())
    assert quantization_config((128, 128)) == published["quantization_config"]

