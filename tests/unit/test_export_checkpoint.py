"""hpcrl.export.export_checkpoint without a trainer: a checkpoint written by two "ranks" in row and
column slices (block_bytes small, so several checksum blocks per slice) becomes HF-sharded
safetensors equal to the tensors, hashing to their policy hash; the source's tokenizer files and Python
code come along; an earlier export's extra files go."""

import json

import torch
from safetensors.torch import load_file

from checkpoints import CheckpointWriter
from checkpoints.hf_safetensors import INDEX, dir_digest
from hpcrl.export import export_checkpoint
from moe.digest import state_dict_digest
from moe.slices import Box


def _checkpoint(ckpt_dir, sd: dict[str, torch.Tensor]) -> None:
    """Rank 1 writes the second half of every tensor (columns of 2-D ones), rank 0 the first."""
    writers = {r: CheckpointWriter(ckpt_dir, 5, rank=r, world_size=2, attempt_id="a", block_bytes=64)
               for r in (1, 0)}
    for r, w in writers.items():
        for name, t in sd.items():
            full = Box.full(tuple(t.shape))
            box = full.split(t.dim() - 1, 2, r) if t.dim() else full
            w.write(f"policy/{name}", t[box.index].contiguous(), box, tuple(t.shape))
            w.write(f"adam/exp_avg/{name}", torch.zeros_like(t[box.index]), box, tuple(t.shape))
        w.commit({"step": 5} if r == 0 else None)


def test_export_checkpoint_sharded_with_tokenizer(tmp_path) -> None:
    g = torch.Generator().manual_seed(0)
    sd = {"lm_head.weight": torch.randn(16, 8, generator=g), "model.norm.weight": torch.randn(8, generator=g),
          "model.embed_tokens.weight": torch.randn(16, 8, generator=g).to(torch.bfloat16)}
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", sd)
    src = tmp_path / "src"
    src.mkdir()
    copied = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "merges.txt",
              "tiktoken.model", "tokenization_kimi.py", "modeling_deepseek.py")  # Kimi-K2's code and vocabulary
    for f in (*copied, "notes.md"):
        (src / f).write_text(f"{f} content")
    (run / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}, "model": {"path": str(src)}}))
    (run / "model_config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    export_checkpoint(str(run), None, str(out), "200B")  # an earlier export: a file per tensor
    assert len(list(out.glob("model-*-of-00003.safetensors"))) == 3
    assert export_checkpoint(str(run), None, str(out), "600B") == out
    files = sorted(p.name for p in out.glob("*.safetensors"))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    index = json.loads((out / INDEX).read_text())
    assert index["metadata"]["total_size"] == 16 * 8 * 4 + 8 * 4 + 16 * 8 * 2
    back = {k: v for f in files for k, v in load_file(str(out / f)).items()}
    assert set(back) == set(sd)
    assert all(torch.equal(back[k], sd[k]) and back[k].dtype == sd[k].dtype for k in sd)
    assert dir_digest(out) == state_dict_digest(sd)
    assert json.loads((out / "config.json").read_text()) == {"model_type": "qwen3_moe"}
    for f in copied:
        assert (out / f).read_text() == f"{f} content", f
    assert (out / "keep.txt").exists() and not (out / "notes.md").exists()
    # Default size: one model.safetensors, no index; the earlier shards and index are gone.
    export_checkpoint(str(run), 5, str(out))
    assert sorted(p.name for p in out.glob("*.safetensors")) == ["model.safetensors"]
    assert not (out / INDEX).exists() and dir_digest(out) == state_dict_digest(sd)


def test_export_memory_is_a_block_not_the_model(tmp_path) -> None:
    """128 MB of weights export with a peak RSS rise of about one 16 MiB checksum block."""
    from hpcrl.memwatch import peak_rss

    MB = 1 << 20
    run = tmp_path / "run"
    w = CheckpointWriter(run / "checkpoints", 1, attempt_id="a")
    for k in range(4):
        w.write(f"policy/w{k}", torch.full((2048, 4096), float(k)))  # 32 MiB each
    w.commit({})
    del w
    (run / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}, "model": {"path": None}}))
    (run / "model_config.json").write_text("{}")
    with peak_rss() as m:
        export_checkpoint(str(run), 1, str(tmp_path / "out"), "40MB")
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 4
    assert m.rise_bytes < 40 * MB, f"peak RSS rose {m.rise_bytes / MB:.0f} MiB for 128 MiB of weights"


def test_export_config_drops_an_fp8_sources_quantization_config() -> None:
    """An export is never FP8: its config.json must not carry the source's quantization_config (transformers
    and SGLang would read the weights as FP8 blocks by it); the dtype is the stored one."""
    import json

    from hpcrl.trainer.hf_export import config_at_dtype

    source = {"model_type": "deepseek_v3", "torch_dtype": "bfloat16",
              "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    for dtypes in ({"bfloat16"}, {"bfloat16", "float32"}):
        written = json.loads(config_at_dtype(source, dtypes))
        assert "quantization_config" not in written and written["model_type"] == "deepseek_v3"
    assert json.loads(config_at_dtype(source, {"float32"}))["dtype"] == "float32"


def test_export_refuses_an_out_it_would_damage_and_a_run_dir_that_is_not_one(tmp_path) -> None:
    """--out a file, the run directory (its config.json would be replaced), or a model directory
    export did not write (its weights would be deleted); RUN_DIR a HF model directory or a broken
    config.json: exit 2 naming the argument, and nothing of the user's is touched."""
    import pytest

    from hpcrl.config.errors import ConfigError

    sd = {"model.norm.weight": torch.ones(8)}
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", sd)
    (run / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}, "model": {"path": None}}))
    (run / "config.yaml").write_text("name: run\n")
    (run / "model_config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    model = tmp_path / "model"
    model.mkdir()
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(model / "model.safetensors"))
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, words in ((afile, "is a file"), (run, "is an hpcrl run directory"),
                       (model, "holds model.safetensors, which hpcrl export did not write")):
        with pytest.raises(ConfigError, match=words) as err:
            export_checkpoint(str(run), None, str(out))
        assert err.value.path == "--out"
    assert (model / "model.safetensors").is_file() and json.loads((run / "config.json").read_text())["checkpoint"]
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{bad")
    for run_dir, words in ((model, "not an hpcrl run's"), (tmp_path / "broken", "is not JSON")):
        with pytest.raises(ConfigError, match=words) as err:
            export_checkpoint(str(run_dir), None, str(tmp_path / "x"))
        assert err.value.path == "RUN_DIR"


def test_a_corrupt_checkpoint_shard_exits_2_and_leaves_no_half_export(tmp_path) -> None:
    import pytest

    from hpcrl.config.errors import ConfigError

    g = torch.Generator().manual_seed(0)
    sd = {"lm_head.weight": torch.randn(16, 8, generator=g)}
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", sd)
    (run / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}, "model": {"path": None}}))
    (run / "model_config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    shards = sorted((run / "checkpoints").rglob("*.h5"))
    assert shards, list((run / "checkpoints").rglob("*"))
    shards[-1].write_bytes(shards[-1].read_bytes()[:100])
    out = tmp_path / "out"
    with pytest.raises(ConfigError) as err:
        export_checkpoint(str(run), None, str(out))
    assert err.value.path == "--step" and shards[-1].name in str(err.value)
    assert not list(out.glob("model*.safetensors"))


def test_a_damaged_manifest_exits_2_naming_it(tmp_path) -> None:
    """open_checkpoint checks the manifest's own checksum: its CorruptCheckpointError was a traceback."""
    import pytest

    from hpcrl.config.errors import ConfigError

    sd = {"lm_head.weight": torch.randn(16, 8, generator=torch.Generator().manual_seed(0))}
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", sd)
    (run / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}, "model": {"path": None}}))
    (run / "model_config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    manifest = next((run / "checkpoints").rglob("manifest.json"))
    manifest.write_text(manifest.read_text().replace('"step": ', '"step":  ', 1).replace("a", "b", 1))
    with pytest.raises(ConfigError) as err:
        export_checkpoint(str(run), None, str(tmp_path / "out"))
    assert err.value.path == "--step" and "manifest" in str(err.value), str(err.value)
    assert "export another step" in str(err.value)
