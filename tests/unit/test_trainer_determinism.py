"""trainer.deterministic: what `deterministic_cuda` sets in a trainer rank on a GPU (before its first
CUDA call; tests/gpu/test_gpu_example.py runs a resume on CUDA with it and requires it bit-identical).
A CPU trainer never calls it, so here it runs in fresh processes."""

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import load_job

REPO_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_grpo.yaml"

PROBE = (
    "import os, sys, torch\n"
    "from hpcrl.trainer.worker import deterministic_cuda\n"
    "deterministic_cuda()\n"
    "print(os.environ['CUBLAS_WORKSPACE_CONFIG'], torch.are_deterministic_algorithms_enabled(),\n"
    "      torch.is_deterministic_algorithms_warn_only_enabled(),\n"
    "      torch.utils.deterministic.fill_uninitialized_memory)\n"
)


@pytest.mark.parametrize("preset,expected", [(None, ":4096:8"), (":16:8", ":16:8")])
def test_deterministic_cuda_sets_torch_and_cublas(preset, expected) -> None:
    """Deterministic kernels, warn-only (an op without one must not stop a run), no NaN fill, and
    cuBLAS's fixed workspace unless the user chose one."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    if preset:
        env["CUBLAS_WORKSPACE_CONFIG"] = preset
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [expected, "True", "True", "False"], out.stdout


def test_deterministic_is_on_by_default_and_can_be_turned_off() -> None:
    assert load_job(REPO_EXAMPLE).trainer.deterministic is True
    assert load_job(REPO_EXAMPLE, ["trainer.deterministic=false"]).trainer.deterministic is False
