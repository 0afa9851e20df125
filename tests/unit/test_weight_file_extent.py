"""A model directory whose safetensors file does not hold the bytes its header describes (a download or
copy cut short, bytes appended, a header whose byte range does not fit its shape) is refused where
the header is read: `hpcrl validate` and `hpcrl run` exit 2 with one line naming the file, before any
process starts, instead of a traceback from the first tensor read that names no file."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from hf_fixtures import model_dir

from moe.hf_checkpoint import CheckpointFormatError, read_header

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def good_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_dir(tmp_path_factory.mktemp("hf") / "model", tokenizer=False)


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _last_shard(model: Path) -> Path:
    return sorted(model.glob("*.safetensors"))[-1]


def test_a_whole_file_passes(good_dir):
    for f in good_dir.glob("*.safetensors"):
        assert read_header(f)


@pytest.mark.parametrize("cut", [1, 4096])
def test_truncated_file_is_named(good_dir, tmp_path, cut):
    shard = _last_shard(_copy(good_dir, tmp_path / "m"))
    size = shard.stat().st_size
    os.truncate(shard, size - cut)
    with pytest.raises(CheckpointFormatError, match=f"{shard.name}: truncated: .* file has {size - cut} bytes"):
        read_header(shard)


def test_appended_bytes_are_named(good_dir, tmp_path):
    shard = _last_shard(_copy(good_dir, tmp_path / "m"))
    with shard.open("ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(CheckpointFormatError, match=f"{shard.name}: longer than its header says"):
        read_header(shard)


def test_a_range_that_does_not_fit_the_shape_is_named(good_dir, tmp_path):
    shard = _last_shard(_copy(good_dir, tmp_path / "m"))
    raw = shard.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    name = next(n for n in header if n != "__metadata__")
    header[name]["shape"] = [*header[name]["shape"][:-1], header[name]["shape"][-1] + 1]
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (length - len(text))  # the same header length, so only the shape is wrong
    assert len(text) == length
    shard.write_bytes(raw[:8] + text + raw[8 + length:])
    with pytest.raises(CheckpointFormatError, match=f"tensor '{name}' .* the file is corrupt"):
        read_header(shard)


def test_hpcrl_validate_names_the_truncated_file(good_dir, tmp_path):
    model = _copy(good_dir, tmp_path / "model")
    shard = _last_shard(model)
    os.truncate(shard, shard.stat().st_size - 100)
    (tmp_path / "train.jsonl").write_text('{"prompt": "ab>", "answer": "ba"}\n')
    (tmp_path / "job.yaml").write_text(textwrap.dedent(f"""
        name: truncated
        model: {{path: {model}}}
        data: {{path: train.jsonl, task: copy}}
    """))
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "validate", "job.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 2, (out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr
    assert f"model.path='{model}'" in lines[0] and f"{shard}: truncated" in lines[0], lines[0]
