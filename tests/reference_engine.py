"""A real reference-engine subprocess for the tests that drive it over HTTP (tests/unit/
test_reference_server.py, test_engine_refusals.py): the tiny preset, its prompts and greedy params."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from hpcrl.models.presets import CONFIG_DIR, load_hf_config
from hpcrl.rollout.client import EngineClient, launch_reference_server

CONFIG_PATH = CONFIG_DIR / "tiny-qwen3-moe.json"
HF_CONFIG = load_hf_config("tiny-qwen3-moe", None)
PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35]]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@contextmanager
def reference_server(log: Path) -> Iterator[tuple[subprocess.Popen, EngineClient]]:
    """The tiny preset's reference engine (CPU, one thread) and a client; on exit the engine gets
    SIGTERM and must stop cleanly (exit 0, its log saying so) within 30 s."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    proc, url = launch_reference_server(str(CONFIG_PATH), "cpu", 0, str(log), threads=1)
    client = EngineClient(url, timeout_s=60)
    try:
        yield proc, client
    finally:
        client.close()
        torch.set_num_threads(prev)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                raise AssertionError(f"reference server ignored SIGTERM; log:\n{log.read_text()}") from None
            assert code == 0, log.read_text()
            assert "reference server stopped" in log.read_text()
