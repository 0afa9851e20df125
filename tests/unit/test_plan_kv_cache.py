"""`hpcrl plan`'s rollout KV cache (hpcrl/rollout/kv_pool.py): the bytes a token takes in SGLang
0.5.23's cache, the pool each engine GPU gets beside its weights, and how a step's samples fit it;
layouts whose engines could not start or would cut responses short fail (exit 2). The
mem_fraction_static heuristic itself is checked against SGLang's code in
tests/conformance/test_kv_pool.py; here the figures follow from it by the arithmetic stated."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpcrl.config import ConfigError, load_job
from hpcrl.models.presets import load_hf_config
from hpcrl.plan_cmd import plan_job, render
from hpcrl.rollout.kv_pool import kv_cell_bytes, kv_pool
from moe.hf_megatron import HFModelDims

pytestmark = pytest.mark.timeout(600)

REPO = Path(__file__).resolve().parents[2]
QWEN, DEEPSEEK = REPO / "examples" / "qwen3_235b.yaml", REPO / "examples" / "deepseek_v3_671b.yaml"
GIB = 2**30


def _dims(name: str) -> HFModelDims:
    return HFModelDims.from_hf_config(load_hf_config(None, str(REPO / "moe" / "configs" / f"{name}.json")))


def test_bytes_per_token_are_sglangs_cell_size():
    """pool_configurator.py `_compute_cell_size`: MHA keeps max(1, kv_heads // attn_tp) heads of a key and
    a value of head_dim; MLA keeps kv_lora_rank + qk_rope_head_dim on every GPU; times layers and the
    element size."""
    qwen, deepseek = _dims("qwen3-235b-a22b"), _dims("deepseek-v3")
    assert (qwen.num_kv_heads, qwen.head_dim, qwen.num_layers) == (4, 128, 94)
    assert kv_cell_bytes(qwen, 8, 2) == 1 * 2 * 128 * 94 * 2 == 48128  # 4 heads over 8 GPUs: one each
    assert kv_cell_bytes(qwen, 2, 2) == 2 * 2 * 128 * 94 * 2
    assert kv_cell_bytes(qwen, 2, 1) == kv_cell_bytes(qwen, 2, 2) // 2  # an fp8 cache
    assert (deepseek.mla.kv_lora_rank, deepseek.mla.qk_rope_dim, deepseek.num_layers) == (512, 64, 61)
    assert kv_cell_bytes(deepseek, 1, 2) == kv_cell_bytes(deepseek, 32, 2) == (512 + 64) * 61 * 2 == 70272


@pytest.fixture(scope="module")
def qwen_report():
    return plan_job(load_job(QWEN, [], purpose="plan"))


def test_the_qwen_example_pool(qwen_report):
    """80 GiB H100s, engines of tp 8: SGLang's default fraction 0.813 (reserve 512 + 8192 x 1.5 + 8/8 x
    1024 + decode graphs 512 x 2 + 58 prefill graphs x 8 = 15312 MiB); the pool is what that fraction
    of the GPU leaves beside the weights, in tokens of 48128 B; 16 prompts x 32 samples over 8 engines."""
    ro = qwen_report["rollout"]
    kv = ro["kv_cache"]
    assert (kv["mem_fraction_static"], kv["reserved_bytes"]) == (0.813, 15312 * 2**20)
    assert kv["pool_bytes"] == int(80 * GIB * 0.813 - ro["weights_bytes_per_gpu"]) > 9 * GIB
    assert kv["pool_tokens"] == kv["pool_bytes"] // 48128
    assert (kv["sample_tokens"], kv["samples_per_scheduler"], kv["samples_at_once"]) == (2 + 1024, 64, 64)
    assert kv["fits"] and ro["fits"] and qwen_report["fits"]
    line = next(x for x in render(qwen_report).splitlines() if x.startswith("  KV cache"))
    assert f"= {kv['pool_tokens']:,} tokens of 48,128 B" in line
    assert "--mem-fraction-static 0.813, its default" in line
    assert line.endswith("64 per engine, all at once  (fits)"), line


def test_an_engine_that_could_not_start_fails_naming_the_fix():
    """The DeepSeek-V3 example without its server_args: SGLang's default reserve under DP attention 32
    (decode graphs 512 x 32 x 4.5 MiB alone are 72 GiB) leaves a negative fraction of the GPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "hpcrl.cli", "plan", str(DEEPSEEK), "--set",
                          "rollout.server_args=[]"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env=env)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "per GPU        weights 68.27 GiB  (fits)" in out.stdout
    assert "DOES NOT FIT (the error below says why)" in out.stdout
    err = out.stderr.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("hpcrl plan: error: rollout='num_engines=4 tp_per_engine=32"), err
    assert "under --mem-fraction-static=-0.138 of 80.0 GiB (SGLang refuses to start)" in err[0]
    assert "set --mem-fraction-static >= 0.855 in rollout.server_args (that leaves 11.6 GiB per GPU" in err[0]


def _qwen_pool(server_args, **kw):
    """The Qwen example's engine (tp 8, 55 GiB of weights) with `server_args`."""
    args = dict(dims=_dims("qwen3-235b-a22b"), tp=8, attn_dp=1, num_engines=8, engine_dtype="bfloat16",
                weights_bytes=55 * GIB, gpu_bytes=80 * GIB, prompt=2, max_new_tokens=1024, samples=512)
    return kv_pool(server_args=server_args, **{**args, **kw})


def test_a_pool_smaller_than_one_sample_fails():
    """SGLang's max_req_len is min(context_len, pool) - 1 (tp_worker.py): a sample of prompt +
    max_new_tokens needs CONTEXT_RESERVE = 7 more tokens of pool, as of the context
    (validate_data.CONTEXT_RESERVE: inputs of max_req_len - 5 or more are refused, and the sync check
    scores prompt + response as one input)."""
    kv = _qwen_pool(["--max-total-tokens", "1032"])
    assert kv["pool_tokens"] == 1032 and not kv["fits"]
    assert ("fewer than one sample's 1,026 + 7 (SGLang's max_req_len is min(context, pool) - 1: it would "
            "cut responses short of rollout.max_new_tokens=1024") in kv["error"]
    assert "raise --max-total-tokens in rollout.server_args to at least 1,033" in kv["error"]
    assert _qwen_pool(["--max-total-tokens", "1033"])["fits"]


def test_the_fraction_suggested_is_the_smallest_that_fits():
    """55 GiB of weights on 80 GiB: a fraction of 0.688 leaves 892 tokens; the error asks for the
    smallest fraction (to the third decimal, as SGLang rounds its own) whose pool holds 1,026 + 7."""
    kv = _qwen_pool(["--mem-fraction-static", "0.688"])
    assert kv["pool_tokens"] == 892 and not kv["fits"]
    suggested = kv["error"].split("set --mem-fraction-static >= ")[1].split(" ")[0]
    assert suggested == "0.689" and _qwen_pool(["--mem-fraction-static", suggested])["fits"]
    kv = _qwen_pool([], weights_bytes=79.9 * GIB)
    assert "no fraction of the GPU holds the weights and one sample: increase rollout.tp_per_engine" \
        in kv["error"]


def test_samples_beyond_the_running_requests_go_in_waves():
    """64 samples per engine; --max-running-requests 16 runs 16 at a time: 4 waves. A pool of 40,000
    tokens holds 38 samples of 1,026 (SGLang's own cap, min(clamp(pool / context x 512, 2048, 4096),
    pool // 2), is larger): 2 waves."""
    kv = _qwen_pool(["--max-running-requests", "16"])
    assert (kv["max_running_requests"], kv["samples_at_once"], kv["waves"]) == (16, 16, 4) and kv["fits"]
    kv = _qwen_pool(["--max-total-tokens", "40000"])
    assert (kv["samples_at_once"], kv["waves"]) == (40000 // 1026, 2) and kv["max_running_requests"] == 2048


def test_what_the_estimate_does_not_follow_is_named_not_judged():
    kv = _qwen_pool(["--speculative-algorithm", "EAGLE", "--max-total-tokens", "10"])
    assert not kv["modelled"] and kv["fits"] and kv["unmodelled"] == ["--speculative-algorithm"]
    kv = _qwen_pool(["--kv-cache-dtype", "nvfp4"])
    assert not kv["modelled"] and kv["unmodelled"] == ["--kv-cache-dtype nvfp4"]
    fp8 = _qwen_pool(["--kv-cache-dtype", "fp8_e4m3"])
    assert fp8["cell_bytes"] == 48128 // 2 and fp8["pool_tokens"] == fp8["pool_bytes"] // (48128 // 2)


def test_a_float32_engine_keeps_a_float32_cache():
    kv = _qwen_pool([], engine_dtype="float32", weights_bytes=20 * GIB)
    assert kv["cell_bytes"] == 2 * 48128


def test_a_bad_server_arg_number_exits_2_naming_it():
    with pytest.raises(ConfigError) as exc:
        plan_job(load_job(QWEN, ["rollout.server_args=[--mem-fraction-static, lots]"], purpose="plan"))
    assert exc.value.path == "rollout.server_args[0]"


def test_the_reference_engine_is_not_planned():
    report = plan_job(load_job(REPO / "examples" / "tiny_moe_grpo.yaml", [], purpose="plan"))
    assert report["rollout"]["kv_cache"] is None
    assert "  KV cache       the reference engine allocates it per batch (not planned)" in render(report)
    assert math.isfinite(report["rollout"]["weights_bytes_per_gpu"])
