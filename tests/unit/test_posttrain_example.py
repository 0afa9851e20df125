"""examples/posttrain_from_hf.yaml is a job that validates and plans as written, once its model and
data paths point at real files (here: a small HF directory and a verl-style parquet made on the spot)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hf_fixtures import model_dir

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "posttrain_from_hf.yaml"


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from hf_fixtures import QWEN3_MOE

    root = tmp_path_factory.mktemp("posttrain")
    # The example's layout (EP8, TP2) and budget (1024 new tokens) need 8 experts and a longer context.
    config = {**QWEN3_MOE, "num_experts": 8, "max_position_embeddings": 2048}
    model = model_dir(root / "model", "qwen3_moe", seed=0, config=config)
    rows = [{"prompt": [{"role": "user", "content": f"What is {a}+{a}? Answer after ####."}],
             "reward_model": {"ground_truth": str(2 * a)}, "data_source": "toy"} for a in range(20)]
    pq.write_table(pa.Table.from_pylist(rows), root / "train.parquet")
    pq.write_table(pa.Table.from_pylist(rows[:5]), root / "test.parquet")
    return ["--set", f"model.path={model}", "--set", f"data.path={root / 'train.parquet'}",
            "--set", f"data.val_path={root / 'test.parquet'}", "--set", "data.max_prompt_tokens=100"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpcrl.cli", *args], capture_output=True, text=True,
                          timeout=120, cwd=REPO)


def test_the_example_validates_with_real_paths(paths):
    out = cli("validate", str(EXAMPLE), *paths)
    assert out.returncode == 0, out.stderr


def test_the_example_plans_with_real_paths(paths):
    out = cli("plan", str(EXAMPLE), *paths, "--json")
    assert out.returncode == 0, out.stderr
    plan = json.loads(out.stdout)
    assert plan, plan


def test_the_example_names_its_missing_model_dir():
    out = cli("validate", str(EXAMPLE))
    assert out.returncode == 2 and "model.path=" in out.stderr and "no such directory" in out.stderr, out.stderr


def test_a_generation_budget_over_the_context_is_named(paths):
    out = cli("validate", str(EXAMPLE), *paths, "--set", "rollout.max_new_tokens=4000")
    assert out.returncode == 2 and "rollout.max_new_tokens=4000" in out.stderr and "<= -" not in out.stderr, \
        out.stderr
