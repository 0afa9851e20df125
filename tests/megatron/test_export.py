"""`hpcrl export`: a checkpoint becomes a HuggingFace directory that transformers loads, with
log-probs equal to the trainer's for the same tokens; bad arguments exit 2 with one message."""

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.megatron, pytest.mark.timeout(300)]


def test_export_matches_trainer(tmp_path):
    script = Path(__file__).with_name("_export_check.py")
    out = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                         timeout=280)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    diff = float(next(line for line in out.stdout.splitlines() if line.startswith("MAXDIFF")).split()[1])
    assert diff < 1e-5, diff
    assert (tmp_path / "hf" / "model.safetensors").exists() and (tmp_path / "hf" / "config.json").exists()


def test_export_bad_arguments(tmp_path):
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "export", str(tmp_path), "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "not an hpcrl run directory" in out.stderr and "Traceback" not in out.stderr
