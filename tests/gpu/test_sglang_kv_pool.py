"""`hpcrl plan`'s SGLang KV pool (hpcrl/rollout/kv_pool.py) against a real SGLang engine on this GPU:
one engine of the tiny preset started by hpcrl's own launch command (dummy weights), its /server_info
read. The fraction SGLang chose must be the one the plan works out for this GPU's capacity, and the
pool it allocated at most the plan's upper bound and at least that bound less 4 GiB of tokens (what
SGLang measures as free before it loads is the GPU less its CUDA context, NCCL and cuBLAS
workspaces: under 4 GiB on any current GPU). Skips, saying why, without a CUDA device or SGLang
(HPCRL_SGLANG_PYTHON, docs/sglang_install.md)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hpcrl.config import JobConfig
from hpcrl.models.presets import load_hf_config
from hpcrl.rollout.client import EngineClient
from hpcrl.rollout.engine_auth import job_keys, set_process_keys
from hpcrl.rollout.kv_pool import EngineMemoryArgs, kv_cell_bytes, mem_fraction_static
from hpcrl.rollout.worker import _launch_sglang
from moe.hf_megatron import HFModelDims

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_sglang_example import SGLANG_PYTHON, pytestmark  # noqa: E402, F401 (the same skips)


@pytest.mark.timeout(900)
def test_sglang_sizes_its_pool_as_the_plan_says(tmp_path):
    hf = load_hf_config("tiny-qwen3-moe", None)
    (tmp_path / "model_config.json").write_text(json.dumps(hf))
    (tmp_path / "logs").mkdir()
    job = JobConfig()
    job.model.dtype, job.resources.device = "bfloat16", "cuda"
    job.rollout.backend, job.rollout.python = "sglang", SGLANG_PYTHON
    set_process_keys(job_keys(tmp_path))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = _launch_sglang(job, tmp_path, "127.0.0.1", port, tmp_path / "logs" / "engine0.log", (0,))
    client = EngineClient(f"http://127.0.0.1:{port}", timeout_s=60)
    try:
        deadline = time.monotonic() + 600
        while not client.health():
            assert proc.poll() is None and time.monotonic() < deadline, \
                (tmp_path / "logs" / "engine0.log").read_text()[-3000:]
            time.sleep(1)
        info = client.server_info()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    # SGLang's capacity is nvidia-smi's memory.total in MiB, the least over the GPUs (utils/common.py
    # get_nvgpu_memory_capacity); what it measures free is torch's (get_available_gpu_memory)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True)
    gpu_mib = min(float(v) for v in smi.stdout.split())
    fraction, _ = mem_fraction_static(gpu_mib, 1, 1, False, EngineMemoryArgs())
    assert info["mem_fraction_static"] == fraction, (info["mem_fraction_static"], fraction, gpu_mib)
    # the plan's bound: the fraction of all of the GPU (SGLang's is of what was free before it loaded),
    # the tiny preset's weights (under 1 MiB) left out, which only raises it
    cell = kv_cell_bytes(HFModelDims.from_hf_config(hf), 1, 2)
    bound = int(torch.cuda.get_device_properties(0).total_memory * fraction) // cell
    pool = info["max_total_num_tokens"]
    print(f"SGLang pool {pool:,} tokens of {cell} B; plan's bound {bound:,} ({pool / bound:.4f} of it)")
    assert bound - 4 * 2**30 // cell <= pool <= bound
    assert info["max_req_input_len"] == min(hf["max_position_embeddings"] - 1, pool - 1) - 5
