"""The trainer's torch (2.13.0, this venv) and SGLang's torch (2.14.1, a side venv: torch_side_env.py)
in one gloo weight-update group: hpcrl's rank 0 broadcasts flattened buckets of the DeepSeek-V3 debug
spec to an engine of TP 2 running SGLang's own init_custom_process_group and FlattenedTensorBucket
under torch 2.14.1, which receives every tensor bit-exact. Skips when the side venv is absent."""

from __future__ import annotations

import subprocess

import pytest
import torch
from test_wire_formats import run_handshake
from torch_side_env import SIDE_TORCH, side_python


@pytest.fixture(scope="module")
def side():
    python = side_python()
    if not python.exists():
        pytest.skip(f"no torch {SIDE_TORCH} side venv at {python.parent.parent}; build it with "
                    ".venv/bin/python tests/conformance/torch_side_env.py (CUDA build, ~5.5 GB)")
    out = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().startswith(SIDE_TORCH), out.stdout
    return python


@pytest.mark.timeout(600)
def test_mixed_torch_versions_bit_exact(tmp_path, sglang_root, side):
    trainer, engines = run_handshake(tmp_path, sglang_root, str(side))
    assert trainer["torch"] == torch.__version__ != engines[0]["torch"]
    for engine in engines:
        assert engine["torch"].startswith(SIDE_TORCH)
        assert engine["digests"] == trainer["digests"]
