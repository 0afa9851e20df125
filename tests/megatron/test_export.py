"""`hpcrl export` and the trainer's `export_hf_dir`: a 2-rank (EP=2) policy becomes HF-sharded
safetensors that transformers loads, with weights and log-probs equal to the trainer's and a directory
digest equal to the policy hash; the tokenizer of the run's model.path comes along; bad arguments
exit 2 with one message. In the same world, a bf16 DeepSeek-V3 policy (PP2) exports (both ways) its
source's MTP layer and its float32 router biases bit for bit, from a bf16 directory and from its FP8
copy."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from deepseek_dirs import bf16_deepseek_dir
from fp8_quantize import quantize_dir
from mpi_launch import run_mpiexec

LAUNCH_TIMEOUT_S = 280  # a hang guard: 2 ranks on 2 shared cores run both parts in ~40 s
pytestmark = [pytest.mark.megatron, pytest.mark.mpi, pytest.mark.timeout(360)]
MB = 1 << 20
FP8_BLOCK = (24, 40)  # tiles none of tiny-deepseek-v3's dims: partial scale blocks everywhere


def test_export_matches_trainer(tmp_path):
    script = Path(__file__).with_name("_export_check.py")
    ds = bf16_deepseek_dir(tmp_path / "deepseek", seed=5)
    fp8 = quantize_dir(ds, tmp_path / "deepseek-fp8", FP8_BLOCK, shards=3)
    log = run_mpiexec(2, script, str(tmp_path), str(ds), str(fp8), timeout_s=LAUNCH_TIMEOUT_S)
    r = json.loads(next(line for line in log.splitlines() if line.startswith("RESULT "))[len("RESULT "):])
    assert r["changed"] and len(r["sha"]) == 64
    assert json.loads((tmp_path / "run" / "final.json").read_text())["policy_sha256"] == r["sha"]
    for name in ("hf", "trainer_hf"):  # `hpcrl export` of the checkpoint, the trainer's own export
        d = r[name]
        shards = [f for f in d["files"] if f.endswith(".safetensors")]
        assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors", d["files"]
        assert d["index"]["metadata"]["total_size"] == r["total_size"]
        assert set(d["index"]["weight_map"].values()) == set(shards)
        assert any(".mlp.experts.3.down_proj." in n for n in d["index"]["weight_map"])  # per-expert names
        # the trainer's log-probs are HF's on the exported weights, up to fp32 summation order
        # (_export_check: logprob_bound of logit_bound), with every token routed alike
        assert d["routing_ratio"] > 1, (name, "a router near-tie within the bound", d["routing_ratio"])
        assert d["maxdiff"] <= d["bound"], (name, d["maxdiff"], d["bound"])
        assert d["weights_equal"], name
        assert d["digest"] == d["loaded_digest"] == r["sha"], name
        for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert f in d["files"], (name, f)
        assert d["tokenizer_eos"] == "<|im_end|>"
    assert "exported to" in r["stdout"] and "model-00001-of-" in r["stdout"]
    for exact, rise in r["peaks"]:  # one block of rows at most (the model is 0.3 MB; blocks 16 MB)
        assert exact and rise < 48 * MB, r["peaks"]
    check_deepseek(r["deepseek"])


def check_deepseek(ds: dict) -> None:
    """(a) bf16 source: load, one train step at lr 0, export: every tensor of the source, MTP layer
    included, bit for bit, at its dtype (the router biases float32 in this bf16 run), loadable by
    transformers; the checkpoint round trip keeps them. (b) FP8 source: the dequantized source,
    FP8 weights rounded once to bf16 (model.dtype), no scales, no quantization_config. Both through
    the trainer's export and `hpcrl export` of the run's checkpoint; each directory hashes to
    policy_sha256(model.path)."""
    bf16, fp8 = ds["bf16"], ds["fp8"]
    assert bf16["grad_norm"] is not None and bf16["grad_norm"] > 0, bf16["grad_norm"]  # a real step, at lr 0
    assert fp8["num_fp8"] > 0 and fp8["num_fp8_mtp"] > 0, fp8  # FP8 in the main model and the MTP layer
    for kind, res in ds.items():
        assert res["state_dict_differ"] == [], (kind, res["state_dict_differ"])
        assert res["sd_bias_dtypes"] == ["torch.float32"], (kind, res["sd_bias_dtypes"])
        assert res["sha_is_state_dict_digest"] and res["sha_mtp_differs"], kind
        for path in ("trainer", "cli"):
            d = res[path]
            where = (kind, path)
            assert d["missing"] == [] and d["extra"] == [], (where, d["missing"], d["extra"])
            assert d["dtype_differ"] == [] and d["bits_differ"] == [], (where, d["dtype_differ"],
                                                                         d["bits_differ"])
            assert d["num_mtp"] == 44, where  # 6 MTP-only tensors + the 38 of a MoE decoder layer
            assert d["digest_ok"], where
            assert d["config_dtype"] == "bfloat16" and not d["quantization_config"], where
            assert d["hf_dtype"] == "torch.bfloat16" and d["hf_bias_dtypes"] == ["torch.float32"], where
            assert d["hf_differ"] == [], (where, d["hf_differ"])
    assert bf16["round_trip_differ"] == [], bf16["round_trip_differ"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", "export", *args], capture_output=True,
                          text=True, timeout=120)


def test_export_bad_arguments(tmp_path):
    out = _cli(str(tmp_path), "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and "not an hpcrl run directory" in out.stderr
    assert "Traceback" not in out.stderr
    out = _cli(str(tmp_path), "--out", str(tmp_path / "o"), "--max-shard-size", "lots")
    assert out.returncode == 2 and "--max-shard-size" in out.stderr and "5GB" in out.stderr
    assert "Traceback" not in out.stderr
    (tmp_path / "config.json").write_text(json.dumps({"checkpoint": {"dir": None}}))
    for step in (["--step", "4"], []):  # no checkpoint at all: the run dir is named, not a --step never given
        out = _cli(str(tmp_path), *step, "--out", str(tmp_path / "o"))
        assert out.returncode == 2 and "error: RUN_DIR=" in out.stderr and "has no complete checkpoint" in out.stderr
        assert "Traceback" not in out.stderr and "--step=None" not in out.stderr
