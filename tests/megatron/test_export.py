"""`hpcrl export` and the trainer's `export_hf_dir`: a 2-rank (EP=2) policy becomes HF-sharded
safetensors that transformers loads, with weights and log-probs equal to the trainer's and a directory
digest equal to the policy hash; the tokenizer of the run's model.path comes along; bad arguments
exit 2 with one message."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_launch import run_mpiexec

LAUNCH_TIMEOUT_S = 280  # a hang guard: 2 ranks on 2 shared cores train, save and export in ~60 s
pytestmark = [pytest.mark.megatron, pytest.mark.mpi, pytest.mark.timeout(330)]
MB = 1 << 20


def test_export_matches_trainer(tmp_path):
    script = Path(__file__).with_name("_export_check.py")
    log = run_mpiexec(2, script, str(tmp_path), timeout_s=LAUNCH_TIMEOUT_S)
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
    out = _cli(str(tmp_path), "--step", "4", "--out", str(tmp_path / "o"))
    assert out.returncode == 2 and "available steps: none" in out.stderr and "Traceback" not in out.stderr
