"""`hpcrl validate` as a user runs it: a subprocess, exit 0 with an OK line for a good job, exit 2
with exactly one error line on stderr (no traceback) for a bad job file or a bad --set."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(300)


def hpcrl_validate(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", "validate", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def test_good_job_exits_0(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "ab>", "answer": "ba"}\n')
    (tmp_path / "job.yaml").write_text(textwrap.dedent("""
        name: good
        data: {path: train.jsonl}
        trainer: {ep: 2, num_procs: 2}
        rollout: {num_engines: 2}
    """))
    out = hpcrl_validate("job.yaml", "--set", "algorithm.lr=3e-4", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "job.yaml: OK (5 ranks: 1 controller, 2 trainer, 2 rollout)"
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize(("job", "overrides", "expected"), [
    ("trainer: {ep: 3, num_procs: 3}\n", [], "trainer.ep=3: num_experts=4"),
    ("algorithm:\n  lr: [1e-3\n", [], "YAML syntax error at line 3"),
    ("model: {preset: tiny-qwen3-moe}\nalgorithm: {lr: 0.01}\nmodel: {preset: tiny-deepseek-v3}\n", [],
     "line 3, column 1: the key 'model' appears twice in one mapping (first at line 1)"),
    ("slurm: {time: 30:00}\n", [], "slurm.time=1800: expected a string, and YAML read a number: quote the value "
                                   "as you wrote it (unquoted, YAML 1.1 reads a time such as 30:00 in base 60"),
    ("name: ok\n", ["algorithm.lr"], "--set='algorithm.lr': expected KEY=VALUE"),
    ("name: ok\n", ["trainer.num_procs=two"], "trainer.num_procs='two': expected an integer"),
    ("algorithm: {name: dapo, kl_estimator: k3}\n", [], "algorithm.kl_estimator='k3': dapo has no KL term"),
    ("algorithm: {name: sft}\n", ["algorithm.clip_eps=0.2"],
     "algorithm.clip_eps=0.2: sft has no importance ratio to clip, so it never reads this key; remove it "
     "(set by --set algorithm.clip_eps=0.2)"),
    ("algorithm: {name: gspo, loss_agg: token-mean}\n", [], "gspo always uses seq-mean-token-mean"),
    ("algorithm: {tis_cap: 3.0}\n", [], "algorithm.tis_cap=3.0: applies to algorithm.rollout_correction"),
], ids=["layout", "yaml-syntax", "yaml-repeated-section", "yaml-base-60-time", "set-syntax", "set-type", "kl-estimator-dapo", "clip-eps-sft",
        "loss-agg-gspo", "tis-cap-without-tis"])
def test_bad_job_exits_2_with_one_line(tmp_path, job, overrides, expected):
    (tmp_path / "job.yaml").write_text(job)
    args = [a for o in overrides for a in ("--set", o)]
    out = hpcrl_validate("job.yaml", *args, cwd=tmp_path)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("hpcrl validate: error: ") and expected in lines[0], lines[0]
    assert "Traceback" not in out.stderr


def test_yaml_anchors_and_merges_still_work(tmp_path):
    """A merged key may be overridden (YAML's meaning), unlike a key written twice."""
    (tmp_path / "job.yaml").write_text("x-base: &b {lr: 0.001, group_size: 4}\nalgorithm:\n  <<: *b\n  lr: 0.002\n")
    from hpcrl.config.load import load_yaml

    assert load_yaml((tmp_path / "job.yaml").read_text())["algorithm"] == {"lr": 0.002, "group_size": 4}


def test_missing_job_file_exits_2(tmp_path):
    out = hpcrl_validate("nowhere.yaml", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr.strip() == ("hpcrl validate: error: job='nowhere.yaml': the job file does not exist; "
                                  "give the path of a job .yaml file")
