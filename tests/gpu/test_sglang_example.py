"""The SGLang production path on a user's GPU cluster: the tiny example with `rollout.backend: sglang`,
2 engines, bf16 (engines and the bf16 trainer), GPU placement from hpcrl (each engine its own GPU when
the machine has 3+), and the bf16 sync check (rollout.logprob_tolerance 1.0 per token,
rollout.logprob_mean_tolerance 0.02 over tokens) from step 0; once with the broadcast
(`rollout.weight_sync: auto`), once with the shard route through hpcrl's `--custom-weight-loader`
over NCCL (docs/sglang_shard_route.md).

SGLang runs from its own environment (docs/sglang_install.md): set HPCRL_SGLANG_PYTHON to that
environment's python, or run this test with a python that imports sglang. Skips, saying why, where
there is no CUDA device or no SGLang."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_util import EXAMPLE, hpcrl  # noqa: E402

BF16_TOLERANCE, BF16_MEAN_TOLERANCE = 1.0, 0.02


def _sglang_python() -> str | None:
    python = os.environ.get("HPCRL_SGLANG_PYTHON")
    if python:
        probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('sglang') is None)"
        ok = subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
        return python if ok else None
    return sys.executable if importlib.util.find_spec("sglang") is not None else None


SGLANG_PYTHON = _sglang_python() if torch.cuda.is_available() else None

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
    pytest.mark.skipif(SGLANG_PYTHON is None, reason="needs SGLang 0.5.x: set HPCRL_SGLANG_PYTHON to the "
                       "python of an SGLang environment (docs/sglang_install.md)"),
]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("weight_sync", ["auto", "shard"])
def test_example_with_sglang_engines(tmp_path, weight_sync):
    run_dir = tmp_path / "sglang"
    share = torch.cuda.device_count() < 3  # 1 trainer rank + 2 engines of TP 1
    out, wall = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", "resources.device=cuda",
                      "--set", "rollout.backend=sglang", "--set", "rollout.num_engines=2",
                      "--set", "model.dtype=bfloat16", "--set", f"rollout.logprob_tolerance={BF16_TOLERANCE}",
                      "--set", f"rollout.logprob_mean_tolerance={BF16_MEAN_TOLERANCE}",
                      "--set", f"rollout.python={SGLANG_PYTHON}",
                      "--set", f"rollout.weight_sync={weight_sync}",
                      "--set", f"resources.share_gpus={str(share).lower()}",
                      "--set", "algorithm.num_steps=10", "--set", "logging.progress=false", timeout_s=1700)
    logs = "".join(p.read_text()[-2000:] for p in sorted((run_dir / "logs").glob("engine*.log")))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + logs
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 10
    assert all(r["sync/logprob_max_abs_diff"] < BF16_TOLERANCE for r in records)
    assert all(r["sync/logprob_mean_abs_diff"] < BF16_MEAN_TOLERANCE for r in records)
    steps = sorted(r["timing/step_s"] for r in records[2:])
    print(f"sglang, weight_sync {weight_sync}: median step {steps[len(steps) // 2]:.3f} s, wall {wall:.0f} s")
