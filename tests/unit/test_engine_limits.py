"""The engines' longest input read at start (hpcrl/controller/engine_limits.py) from a real reference
engine over HTTP: SGLang's /server_info max_req_input_len, min(context, KV pool) - 6, which the
reference engine lowers with SGLang's --context-length (as a small KV pool lowers SGLang's); a step
whose prompt + max_new_tokens reaches it stops the run naming the fix. Validation's prompt limit
takes a shorter --context-length in rollout.server_args."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_job
from hpcrl.config.validate_data import prompt_limit
from hpcrl.controller.engine_limits import check_engine_inputs
from hpcrl.rollout.client import EngineError
from reference_engine import CONFIG_PATH, reference_server

pytestmark = pytest.mark.timeout(300)

TINY = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_grpo.yaml"  # copy task: 2-token prompts


@pytest.fixture(scope="module")
def short_engine(tmp_path_factory):
    """The tiny preset (context 64) served with --context-length 48: longest input 48 - 6 = 42."""
    with reference_server(tmp_path_factory.mktemp("engine") / "engine.log",
                          extra_args=["--context-length", "48"]) as (_, client):
        yield client


def test_the_engine_reports_sglangs_longest_input(short_engine):
    info = short_engine.server_info()
    assert (info["context_length"], info["max_req_input_len"]) == (48, 42)
    assert short_engine.model_info()["context_len"] == 48
    # the engine refuses as SGLang does at its new bound: 42 input tokens or more
    refused = r"Input length \(42 tokens\) exceeds the maximum allowed length \(42"
    with pytest.raises(EngineError, match=refused):
        short_engine.generate([[1] * 42], [{"max_new_tokens": 1}])


def test_a_request_that_reaches_it_stops_the_run_naming_the_fix(short_engine):
    """2-token prompts: 40 new tokens make requests of 42 tokens, refused; 39 pass."""
    job = load_job(TINY, ["rollout.max_new_tokens=40"])
    with pytest.raises(ConfigError) as exc:
        check_engine_inputs(job, [short_engine])
    assert exc.value.path == "rollout.max_new_tokens"
    assert ("with prompts of up to 2 tokens (data.task=copy's 2-token prompts), a request of 42 tokens "
            "reaches engine 0's longest input, max_req_input_len=42") in str(exc.value)
    assert "set data.max_prompt_tokens <= 1, lower rollout.max_new_tokens" in str(exc.value)
    check_engine_inputs(load_job(TINY, ["rollout.max_new_tokens=39"]), [short_engine])


def test_an_engine_at_the_models_context_passes_what_validation_allowed(tmp_path):
    """Validation's bound, prompt + max_new_tokens <= context - 7, is one under the reference engine's
    context - 6: the check can only fail where the engine takes less than the model's context."""
    job = load_job(TINY, ["data.max_prompt_tokens=40", "rollout.max_new_tokens=17"])
    assert prompt_limit(job)[0] == 40 and 40 + 17 == 64 - 7
    with reference_server(tmp_path / "engine.log") as (_, client):
        assert client.server_info()["max_req_input_len"] == 58
        check_engine_inputs(job, [client])


def test_validation_takes_a_shorter_context_length_from_server_args():
    job = load_job(TINY, ["rollout.server_args=[--context-length, '48']"])
    assert prompt_limit(job) == (37, "the engines' context (rollout.server_args[0] --context-length 48 - "
                                     "rollout.max_new_tokens=4 - 7 = 37 tokens)")
    longer = load_job(TINY, ["rollout.server_args=['--context-length=100']"])
    assert prompt_limit(longer)[0] == 64 - 4 - 7  # the model's context stays the bound
    with pytest.raises(ConfigError) as exc:
        prompt_limit(load_job(TINY, ["rollout.server_args=[--context-length, long]"]))
    assert exc.value.path == "rollout.server_args[0]"


def test_an_engine_with_a_tiny_context_starts_and_refuses_as_sglang(tmp_path):
    """--context-length 8: every input of 2 tokens or more is refused (8 - 6), the server still starts."""
    with reference_server(tmp_path / "engine.log", extra_args=["--context-length", "8"]) as (_, client):
        assert client.server_info()["max_req_input_len"] == 2
        refused = r"Input length \(2 tokens\) exceeds the maximum allowed length \(2"
        with pytest.raises(EngineError, match=refused):
            client.generate([[1, 1]], [{"max_new_tokens": 1}])


def test_a_context_length_over_the_models_is_refused_at_start_as_sglang_does(tmp_path):
    cmd = [sys.executable, "-m", "hpcrl.rollout.reference_server", "--model-config", str(CONFIG_PATH),
           "--port", "0", "--context-length", "100"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert ("User-specified context_length (100) is greater than the derived context_length (64)"
            in out.stderr
            and "SGLANG_ALLOW_OVERWRITE_LONGER_CONTEXT_LEN=1" in out.stderr), out.stderr[-2000:]
