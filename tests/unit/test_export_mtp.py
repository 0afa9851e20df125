"""`hpcrl export` of a DeepSeek-V3 run without a trainer: the run's model.path's MTP layer comes along
(unquantized tensors byte for byte, FP8 ones dequantized to model.dtype without their scales), the
router bias stays float32 in a bf16 run while config.json says bfloat16, the directory hashes to the
policy hash of exactly its tensors; the MTP tensors are read a block of rows at a time and shared
out over the trainer ranks; a source whose MTP layer cannot be read, or that is gone, is reported.
The trainer's own export of the same tensors is tested in tests/megatron/test_export.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch
from fp8_quantize import dequantized_state_dict, quantize_dir
from safetensors.torch import load_file, save_file

from checkpoints import CheckpointWriter
from checkpoints.hf_safetensors import INDEX, dir_digest
from hpcrl.config.errors import ConfigError
from hpcrl.export import export_checkpoint
from moe.digest import state_dict_digest

L = 3  # tiny-deepseek-v3's num_hidden_layers: its MTP layer is model.layers.3
BLOCK = (24, 40)  # tiles no dim below: partial scale blocks


def preset() -> dict:
    from hpcrl.models.presets import load_hf_config

    return load_hf_config("tiny-deepseek-v3", None)  # num_nextn_predict_layers 1, dtype float32


def source_tensors() -> dict[str, torch.Tensor]:
    """A main-model tensor (not to be copied: the checkpoint has the policy) and MTP tensors of every
    kind: a bf16 linear (FP8 in the quantized copy), a fused [E, 2I, H] expert tensor (FP8 there, a
    leading expert axis), a bf16 norm and the float32 router bias (never quantized)."""
    g = torch.Generator().manual_seed(3)

    def draw(*shape: int) -> torch.Tensor:
        return 0.3 * torch.randn(shape, generator=g) + 0.05

    return {"model.layers.2.input_layernorm.weight": draw(64).to(torch.bfloat16),
            f"model.layers.{L}.eh_proj.weight": draw(64, 128).to(torch.bfloat16),
            f"model.layers.{L}.mlp.experts.gate_up_proj": draw(8, 64, 64).to(torch.bfloat16),
            f"model.layers.{L}.enorm.weight": draw(64).to(torch.bfloat16),
            f"model.layers.{L}.mlp.gate.e_score_correction_bias": draw(8)}


def bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mtp")
    bf16 = root / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text(json.dumps(preset()))
    save_file(source_tensors(), str(bf16 / "model.safetensors"), metadata={"format": "pt"})
    (bf16 / "tokenizer.json").write_text("{}")
    return {"bf16": bf16, "fp8": quantize_dir(bf16, root / "fp8", BLOCK, shards=2)}


def policy_tensors() -> dict[str, torch.Tensor]:
    """What a bf16 run's checkpoint holds under policy/ (a part of it: the export copies names)."""
    g = torch.Generator().manual_seed(4)
    return {"model.embed_tokens.weight": torch.randn(64, 64, generator=g).to(torch.bfloat16),
            "model.layers.1.mlp.gate.e_score_correction_bias": torch.randn(8, generator=g)}


def make_run(tmp_path: Path, source: Path | str) -> Path:
    run = tmp_path / "run"
    w = CheckpointWriter(run / "checkpoints", 2, attempt_id="a")
    for name, t in policy_tensors().items():
        w.write(f"policy/{name}", t)
    w.commit({"step": 2})
    (run / "config.json").write_text(json.dumps({"checkpoint": {"dir": None},
                                                 "model": {"path": str(source), "dtype": "bfloat16"}}))
    (run / "model_config.json").write_text(json.dumps(preset()))
    return run


def weight_files(d: Path) -> list[str]:
    return (sorted(set(json.loads((d / INDEX).read_text())["weight_map"].values()))
            if (d / INDEX).exists() else ["model.safetensors"])


def exported_names(d: Path) -> list[str]:
    return [k for f in weight_files(d) for k in load_file(str(d / f))]


def exported(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for f in weight_files(out) for k, v in load_file(str(out / f)).items()}


@pytest.mark.parametrize("kind", ["bf16", "fp8"])
def test_export_carries_the_mtp_layer(sources: dict[str, Path], tmp_path: Path, kind: str) -> None:
    src = sources[kind]
    out = export_checkpoint(str(make_run(tmp_path, src)), 2, str(tmp_path / "out"), "20KB")
    got = exported(out)
    ref = dequantized_state_dict(src) if kind == "fp8" else load_file(str(src / "model.safetensors"))
    scaled = {n.removesuffix("_scale_inv") for n in exported_names(src) if n.endswith("_scale_inv")}
    assert (kind == "fp8") == bool(scaled)
    want = dict(policy_tensors())
    for name, t in ref.items():
        if name.startswith(f"model.layers.{L}."):  # the source's main-model tensors are not copied
            # FP8: dequantized exactly in float32, then rounded once to model.dtype (bf16)
            want[name] = t.to(torch.bfloat16) if name in scaled else t
    assert sorted(got) == sorted(want)  # no scales, no main-model tensor of the source
    for name, t in want.items():
        assert got[name].dtype == t.dtype and bits(got[name]) == bits(t), name
    config = json.loads((out / "config.json").read_text())
    # the weights' dtype, though the router biases are float32 and the source's config says float32
    assert config["dtype"] == "bfloat16" and "quantization_config" not in config
    assert config["num_nextn_predict_layers"] == 1
    assert dir_digest(out) == state_dict_digest(want)
    assert (out / "tokenizer.json").is_file()


def test_mtp_tensors_stream_by_blocks_of_rows(sources: dict[str, Path]) -> None:
    """A block is at most `block_bytes` of rows (float32 bytes for FP8, dequantized in float32), at
    least one row; the blocks cover each tensor once, in order."""
    from hpcrl.trainer.mtp_tensors import MTPSource
    from moe.hf_megatron import HFModelDims

    dims = HFModelDims.from_hf_config(preset())
    for kind in ("bf16", "fp8"):
        with MTPSource(sources[kind], dims, torch.bfloat16) as mtp:
            assert [t.name for t in mtp.tensors] == sorted(n for n in source_tensors() if f".{L}." in n)
            for t in mtp.tensors:
                row = (4 if t.scale is not None else t.dtype.itemsize) * math.prod(t.shape[1:])
                boxes = list(mtp.blocks(t, 3 * row - 1))  # two rows fit, three do not
                rows = [box.shape[0] for box, _ in boxes]
                assert max(rows) == 2, (kind, t.name, rows)
                assert [box.offsets[0] for box, _ in boxes] == [sum(rows[:k]) for k in range(len(rows))]
                assert sum(rows) == t.shape[0] and all(b.dtype == t.dtype for _, b in boxes)


def test_mtp_owners_balance_bytes() -> None:
    """Largest first to the rank with the fewest bytes so far (ties: the lower rank), starting from
    each rank's policy bytes [0, 50]: a (40) to rank 0 (0 -> 40); b (30) to rank 0 (40 < 50; -> 70);
    c (20) to rank 1 (50 < 70; -> 70); d (10) at the tie 70 = 70 to rank 0."""
    from hpcrl.trainer.mtp_tensors import MTPTensor, assign_owners

    def tensor(name: str, nbytes: int) -> MTPTensor:
        return MTPTensor(name, torch.uint8, (nbytes,), None, None)  # type: ignore[arg-type]

    ts = [tensor("d", 10), tensor("a", 40), tensor("c", 20), tensor("b", 30)]
    assert assign_owners(ts, [0, 50]) == {"a": 0, "b": 0, "c": 1, "d": 0}
    assert assign_owners(ts, [0]) == {"a": 0, "b": 0, "c": 0, "d": 0}


def test_export_refuses_an_unreadable_mtp_layer(sources: dict[str, Path], tmp_path: Path) -> None:
    """An FP8 MTP tensor whose scale is missing: exit 2 naming model.path, the tensor and the fix."""
    import shutil
    import subprocess

    bad = tmp_path / "bad"
    shutil.copytree(sources["fp8"], bad)
    index = json.loads((bad / INDEX).read_text())
    name = f"model.layers.{L}.eh_proj.weight"
    file = bad / index["weight_map"].pop(name + "_scale_inv")
    tensors = load_file(str(file))
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    (bad / INDEX).write_text(json.dumps(index))
    run = make_run(tmp_path, bad)
    with pytest.raises(ConfigError, match=r"model\.path=.*eh_proj\.weight.*has no scale tensor"):
        export_checkpoint(str(run), 2, str(tmp_path / "out"))
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", "export", str(run), "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "model.path=" in proc.stderr and "Traceback" not in proc.stderr


def test_export_warns_when_the_source_is_gone(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = make_run(tmp_path, tmp_path / "gone")
    out = export_checkpoint(str(run), 2, str(tmp_path / "out"))
    assert sorted(exported(out)) == sorted(policy_tensors())
    assert "1 MTP layer(s)" in capsys.readouterr().err
    # no MTP tensors came along: config.json says so (SGLang's MTP speculative decoding would fail
    # on tensors the directory lacks); with them it keeps the model's count
    assert json.loads((Path(out) / "config.json").read_text())["num_nextn_predict_layers"] == 0


def test_export_warns_when_the_source_lost_its_weights(sources: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture) -> None:
    """model.path kept with config.json and the tokenizer, its safetensors deleted after the run (the
    FP8 release of a 671B model is ~700 GB): exported as when the directory is gone, the tokenizer
    copied (it was exit 2 without a way to export)."""
    import shutil

    src = Path(shutil.copytree(sources["fp8"], tmp_path / "src"))
    for f in [*src.glob("*.safetensors"), src / INDEX]:
        f.unlink()
    out = export_checkpoint(str(make_run(tmp_path, src)), 2, str(tmp_path / "out"))
    assert sorted(exported(out)) == sorted(policy_tensors())
    assert "no *.safetensors any more; its 1 MTP layer(s)" in capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert (out / "tokenizer.json").is_file()


def test_export_refuses_the_runs_own_model_path_as_out(sources: dict[str, Path], tmp_path: Path) -> None:
    """A run that started from an earlier export, exported back into it: the export deleted the files
    it then read the MTP layer from (written as zeros), then copying the tokenizer onto itself raised
    SameFileError. Refused before a file changes."""
    import shutil

    src = Path(shutil.copytree(sources["bf16"], tmp_path / "src"))
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    run = make_run(tmp_path, src)
    with pytest.raises(ConfigError, match=r"--out=.*is the run's model\.path"):
        export_checkpoint(str(run), 2, str(tmp_path / "." / "src"))
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before
