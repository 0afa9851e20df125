"""A real reference-engine subprocess for the tests that drive it over HTTP (tests/unit/
test_reference_server.py, test_engine_refusals.py, test_reference_engine_deepseek.py): the tiny
preset, its prompts and greedy params; and the decode-loop errors the engine tests' bounds must
catch (DECODE_MUTATIONS: wrappers of the engine's `_hf_forward`)."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from hpcrl.models.presets import CONFIG_DIR, load_hf_config
from hpcrl.rollout.client import EngineClient, launch_reference_server

CONFIG_PATH = CONFIG_DIR / "tiny-qwen3-moe.json"
HF_CONFIG = load_hf_config("tiny-qwen3-moe", None)
PROMPTS = [[1, 5, 6, 7, 8], [1, 20, 21], [1, 30, 31, 32, 33, 34, 35]]
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}


@contextmanager
def reference_server(log: Path, config_path: Path = CONFIG_PATH, **launch: Any
                     ) -> Iterator[tuple[subprocess.Popen, EngineClient]]:
    """The reference engine of `config_path` (the tiny preset's; CPU, one thread; `launch`: further
    launch_reference_server arguments) and a client; on exit the engine gets SIGTERM and must stop
    cleanly (exit 0, its log saying so) within 30 s."""
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    proc, url = launch_reference_server(str(config_path), "cpu", 0, str(log), threads=1, **launch)
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


@contextmanager
def server_twin() -> Iterator[Any]:
    """The model a reference_server() answers with (the preset drawn from seed 0, as the server
    starts it), computing on one torch thread while the context lasts."""
    from hpcrl.rollout.engine import ReferenceModel

    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield ReferenceModel(HF_CONFIG, seed=0)
    finally:
        torch.set_num_threads(prev)


def unmasked_padding(forward):
    return lambda ids, mask, pos, cache: forward(ids, None, pos, cache)


def positions_from_padded_start(forward):
    def wrapped(ids, mask, pos, cache):
        prefill = ids.shape[1] > 1
        return forward(ids, mask, torch.arange(ids.shape[1]).expand_as(pos) if prefill else pos, cache)
    return wrapped


def decode_positions_one_ahead(forward):
    return lambda ids, mask, pos, cache: forward(ids, mask, pos + (ids.shape[1] == 1), cache)


DECODE_MUTATIONS = [unmasked_padding, positions_from_padded_start, decode_positions_one_ahead]
"""Padding left unmasked, positions counted from the padded start, decode positions one ahead."""
