"""moe.hf_checkpoint against directories written by transformers' save_pretrained (both expert
layouts, Qwen3-MoE and Mixtral), the sharded random init's box independence, the reference engine
loading a directory, and every bad model directory `hpcrl validate` must refuse with one message."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hf_fixtures import model_dir, reward_model_dir, validate

from moe.hf_checkpoint import CheckpointFormatError, HFCheckpoint
from moe.hf_megatron import HFModelDims, hf_fused_to_checkpoint
from moe.sharded_init import init_box
from moe.slices import Box

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {"qwen3_moe": model_dir(root / "qwen", "qwen3_moe", seed=1),
            "mixtral-fused": model_dir(root / "mixtral", "mixtral", seed=2, fused=True, tokenizer=False)}


def dims_of(path: Path) -> HFModelDims:
    return HFModelDims.from_hf_config(json.loads((path / "config.json").read_text()))


@pytest.mark.parametrize("which", ["qwen3_moe", "mixtral-fused"])
def test_reads_every_tensor_and_box_as_transformers_loads_it(dirs: dict[str, Path], which: str) -> None:
    from transformers import AutoModelForCausalLM

    path = dirs[which]
    dims = dims_of(path)
    expected = hf_fused_to_checkpoint(
        AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).state_dict(), dims)
    with HFCheckpoint(path, dims) as ckpt:
        assert ckpt.fused == which.endswith("fused")
        assert list(ckpt.expected) == list(expected)
        for name, tensor in expected.items():
            assert torch.equal(ckpt.read(name), tensor), name
            if tensor.dim() == 2:  # an inner box: rows and columns cut, as TP/ETP shards are
                box = Box((1, 3), (tensor.shape[0] - 2, tensor.shape[1] - 5))
                assert torch.equal(ckpt.read(name, box), tensor[box.index]), name


def test_reference_engine_loads_the_directory(dirs: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from hpcrl.rollout.engine import ReferenceModel

    path = dirs["qwen3_moe"]
    cfg = json.loads((path / "config.json").read_text())
    engine = ReferenceModel(cfg, seed=123)  # other random weights first: the directory must replace all
    assert engine.load_model_dir(str(path)) == len(dims_of(path).hf_shapes())
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.tensor([[5, 17, 40, 2, 99, 300]])
    with torch.no_grad():
        want = torch.log_softmax(hf(ids).logits.float(), -1)
        got = torch.log_softmax(engine.model(ids).logits.float(), -1)
    # The engine's model is transformers' class with the directory's weights: the same kernels on the
    # same inputs in this process, so the same bits (a wrong or missing tensor changes them).
    assert torch.equal(want, got)


def test_sharded_init_boxes_equal_the_whole_tensor() -> None:
    shape = (12, 10)
    whole = init_box(7, "w", shape, Box.full(shape), 0.02)
    for box in (Box((0, 0), (6, 10)), Box((6, 5), (6, 5)), Box((3, 2), (1, 1))):
        assert np.array_equal(init_box(7, "w", shape, box, 0.02), whole[box.index])
    assert not np.array_equal(init_box(8, "w", shape, Box.full(shape), 0.02), whole)  # the seed matters
    assert not np.array_equal(init_box(7, "v", shape, Box.full(shape), 0.02), whole)  # so does the name
    assert abs(float(whole.std()) - 0.02) < 0.005
    assert np.array_equal(init_box(7, "norm", (10,), Box((2,), (3,)), 0.02), np.ones(3, np.float32))


# -- bad model directories: hpcrl validate exits 2 with one message ------------------------------


def broken_copy(dirs: dict[str, Path], tmp: Path, which: str = "qwen3_moe") -> Path:
    out = tmp / "model"
    shutil.copytree(dirs[which], out)
    return out


def rewrite_file(path: Path, drop: str | None = None, reshape: str | None = None,
                 add: str | None = None) -> None:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path))
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:-1].clone()
    if add:
        tensors[add] = torch.zeros(3, 3)
    save_file(tensors, str(path), metadata={"format": "pt"})


def file_of(path: Path, name: str) -> Path:
    index = json.loads((path / "model.safetensors.index.json").read_text())
    return path / index["weight_map"][name]


def test_good_directories_validate(dirs: dict[str, Path], tmp_path: Path) -> None:
    for path in dirs.values():
        rc, out = validate(tmp_path, path)
        assert rc == 0, out


def test_a_directory_without_weights(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(dirs, tmp_path)
    for f in path.glob("*.safetensors*"):
        f.unlink()
    rc, out = validate(tmp_path, path)
    assert rc == 2 and "model.path=" in out and "has no weights" in out, out


def test_an_index_naming_a_missing_file(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(dirs, tmp_path)
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    rc, out = validate(tmp_path, path)
    assert rc == 2 and victim.name in out and "incomplete" in out, out


def test_a_tensor_whose_shape_disagrees_with_config(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(dirs, tmp_path)
    name = "model.layers.1.self_attn.o_proj.weight"
    rewrite_file(file_of(path, name), reshape=name)
    rc, out = validate(tmp_path, path)
    assert rc == 2 and name in out and "[63, 64]" in out and "[64, 64]" in out, out


def test_a_missing_and_an_unexpected_tensor(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(dirs, tmp_path)
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    rewrite_file(file_of(path, name), drop=name)
    rc, out = validate(tmp_path, path)
    assert rc == 2 and name in out and "missing" in out, out

    path2 = tmp_path / "again"
    path2.mkdir()
    path2 = broken_copy(dirs, path2)
    first = file_of(path2, "model.norm.weight")
    rewrite_file(first, add="model.layers.0.mlp.shared_expert.gate_proj.weight")
    index = json.loads((path2 / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.shared_expert.gate_proj.weight"] = first.name
    (path2 / "model.safetensors.index.json").write_text(json.dumps(index))
    rc, out = validate(tmp_path, path2)
    assert rc == 2 and "unexpected tensor 'model.layers.0.mlp.shared_expert.gate_proj.weight'" in out, out


def test_a_reward_model_is_a_critic_path_but_not_a_model_path(dirs: dict[str, Path], tmp_path: Path) -> None:
    rm = reward_model_dir(dirs["qwen3_moe"], tmp_path / "rm", seed=5)
    dims = dims_of(rm)
    with HFCheckpoint(rm, dims, score_head=True) as ckpt:
        assert ckpt.score_names == ["score.weight"]
        assert "lm_head.weight" not in ckpt.expected
        with HFCheckpoint(dirs["qwen3_moe"], dims) as body:  # the body is the causal model's
            name = "model.layers.1.self_attn.o_proj.weight"
            assert torch.equal(ckpt.read(name), body.read(name))
    rc, out = validate(tmp_path, rm)  # a policy needs its lm_head
    assert rc == 2 and "'lm_head.weight'" in out and "missing" in out, out
    job = tmp_path / "ppo.yaml"
    job.write_text(f"model: {{path: {dirs['qwen3_moe']}}}\ndata: {{task: copy}}\nalgorithm: {{name: ppo}}\n"
                   f"critic: {{path: {rm}}}\n")
    proc = subprocess.run([sys.executable, "-m", "hpcrl.cli", "validate", str(job)], capture_output=True,
                          text=True, timeout=120, cwd=REPO)
    assert proc.returncode == 0, proc.stderr + proc.stdout

    two = reward_model_dir(dirs["qwen3_moe"], tmp_path / "rm2", labels=2)
    with pytest.raises(CheckpointFormatError, match=r"'score.weight' has shape \[2, 64\]: 2 labels.*num_labels: 1"):
        HFCheckpoint(two, dims, score_head=True)


def test_an_unsupported_model_type(dirs: dict[str, Path], tmp_path: Path) -> None:
    path = broken_copy(dirs, tmp_path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(cfg))
    rc, out = validate(tmp_path, path)
    assert rc == 2 and "model.path=" in out and "'llama' is not supported" in out, out


def test_checkpoint_errors_are_value_errors(dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(CheckpointFormatError, match="has no weights"):
        HFCheckpoint(tmp_path, dims_of(dirs["qwen3_moe"]))
