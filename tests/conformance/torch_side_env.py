"""A side environment with SGLang 0.5.23's torch (2.14.1), for the mixed-version weight-update test.

hpcrl's environment pins torch 2.13.0; SGLang 0.5.22/0.5.23 pin torch 2.14.1, so a real deployment
has the trainer and the engines on different torch versions in one gloo/NCCL group. This builds a
venv with torch==2.14.1 (+ numpy, packaging, which SGLang's utils import) at `side_python()`'s
location: `$HPCRL_TORCH_SIDE_ENV` or `~/.cache/hpcrl/torch-2.14.1`. PyPI has no CPU-only build of
torch 2.14.1 for Linux x86_64: pip installs the CUDA 13 build and its nvidia-* wheels (about 2 GB of
downloads, 5.5 GB installed), which runs on a CPU machine. The test that uses it skips when it is
absent; build it with

    .venv/bin/python tests/conformance/torch_side_env.py
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SIDE_TORCH = "2.14.1"


def side_env() -> Path:
    """The side venv's directory."""
    env = os.environ.get("HPCRL_TORCH_SIDE_ENV")
    return Path(env) if env else Path.home() / ".cache" / "hpcrl" / f"torch-{SIDE_TORCH}"


def side_python() -> Path:
    return side_env() / "bin" / "python"


def build() -> Path:
    """Create the side venv (idempotent) and return its python."""
    env = side_env()
    if not side_python().exists():
        base = getattr(sys, "_base_executable", sys.executable)  # not this venv's python: a fresh venv
        subprocess.run([base, "-m", "venv", str(env)], check=True)
    subprocess.run([str(side_python()), "-m", "pip", "install", "-q", f"torch=={SIDE_TORCH}", "numpy",
                    "packaging"], check=True)
    return side_python()


if __name__ == "__main__":
    print(build())
