"""install.sh and pyproject.toml install no SGLang or transformer-engine into hpcrl's environment (their
pins clash with hpcrl's, docs/sglang_install.md), and install.sh refuses an option it does not know
before installing anything."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_no_dependency_or_extra_brings_sglang_or_transformer_engine():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    every = [*project["dependencies"], *(d for deps in project["optional-dependencies"].values() for d in deps)]
    assert not [d for d in every if d.lower().startswith(("sglang", "transformer-engine", "transformer_engine"))]
    assert "torch==2.13.0" in project["dependencies"]


def test_unknown_option_is_refused_before_anything_is_installed(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "install.sh"), "--gpu"], capture_output=True, text=True,
                         timeout=60, env={"HPCRL_VENV": str(tmp_path / "venv"), "PATH": "/usr/bin:/bin"})
    assert out.returncode == 2 and "unknown option '--gpu'; use --test, --wandb and/or --cuda" in out.stderr
    assert not (tmp_path / "venv").exists()
