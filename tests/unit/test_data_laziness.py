"""Data files are read lazily: the controller's data start-up (the model's HF tokenizer, the prompt
sampler over the file, the first batch: what Session.__init__ and _request do) on a 1M-row jsonl costs
about what it costs on a 1k-row one.

Measured, not assumed: each start-up runs in a fresh subprocess that reports its wall time from
before its imports to the first batch, and its peak resident memory (VmHWM). The 1M-row ratios must
stay within 2x of the 1k-row ones; reading the file whole (json-parsing 1M rows of ~200 characters)
takes seconds and about a GB, an order of magnitude over. No absolute times are asserted. The probe
imports only hpcrl.tasks (a stand-in namespace for the job): the rest of the controller (torch,
megatron imports: seconds, ~300 MB) would hide what the data side costs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from hf_fixtures import QWEN3_MOE, train_tokenizer

pytestmark = pytest.mark.timeout(300)

PROBE = textwrap.dedent("""
    import json, sys, time, tracemalloc
    t0 = time.perf_counter()
    from types import SimpleNamespace
    from hpcrl.tasks import build_sampler, load_tokenizer, prompt_format

    data = SimpleNamespace(path=sys.argv[2], task=None, prompt_key="prompt",
                           answer_key="reward_model.ground_truth", apply_chat_template=True,
                           chat_template_kwargs={}, max_prompt_tokens=256,
                           overlong_prompts="error", num_prompts_per_step=8, seed=3, val_path=None)
    job = SimpleNamespace(base_dir=".", model=SimpleNamespace(path=sys.argv[1], trust_remote_code=False), data=data)
    tokenizer = load_tokenizer(job)
    tracemalloc.start()  # numpy reports its buffers to tracemalloc: the data side's own peak
    sampler = build_sampler(job, prompt_format(job, tokenizer, 256))
    batch = sampler.batch(0)
    seconds = time.perf_counter() - t0
    data_peak = tracemalloc.get_traced_memory()[1]
    assert len(batch) == 8 and all(ex.prompt_ids for ex in batch), batch
    hwm_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM"))
    rows = len(sampler.examples)
    print(json.dumps({"s": seconds, "hwm_kb": hwm_kb, "data_peak": data_peak, "rows": rows}))
""")

def write_rows(path: Path, num_rows: int) -> None:
    """`num_rows` jsonl rows of ~200 characters: 1000 distinct rows written as one repeated block."""
    filler = "Natalia sold clips to her friends in April and then half as many in May. " * 2
    block = "".join(json.dumps({"prompt": f"Question {i}: {filler}How many?",
                                "reward_model": {"ground_truth": str(i)}, "answer": str(i)}) + "\n"
                    for i in range(1000)).encode()
    with path.open("wb") as f:
        for _ in range(num_rows // 1000):
            f.write(block)


def start_up(model: Path, data: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(model), str(data)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_start_up_on_1m_rows_costs_about_what_1k_rows_cost(tmp_path):
    model = tmp_path / "model"
    train_tokenizer(model)
    (model / "config.json").write_text(json.dumps(QWEN3_MOE | {"max_position_embeddings": 512}))
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    write_rows(small, 1000)
    write_rows(big, 1_000_000)
    assert 190 < big.stat().st_size / 1_000_000 < 260  # bytes per row
    small_run, big_run = start_up(model, small), start_up(model, big)
    assert (small_run["rows"], big_run["rows"]) == (1000, 1_000_000)
    time_ratio = big_run["s"] / small_run["s"]
    memory_ratio = big_run["hwm_kb"] / small_run["hwm_kb"]
    print(f"start-up on 1k rows: {small_run}; on 1M rows: {big_run}; ratios: time {time_ratio:.2f}, "
          f"peak memory {memory_ratio:.2f}")
    assert time_ratio < 2.0, (small_run, big_run)
    assert memory_ratio < 2.0, (small_run, big_run)
    # The tokenizer's imports (torch, via transformers) make a ~300 MB baseline; the data side's own
    # peak is the index (8 B/row), its one transient copy (8 B/row) and the epoch permutation (8 B/row).
    assert big_run["data_peak"] / 1_000_000 < 40, big_run
