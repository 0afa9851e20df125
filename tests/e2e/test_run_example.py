"""`hpcrl run` end to end: the tiny examples (Qwen3-MoE and DeepSeek-V3) learn, logs what people
expect, and failures of a rank stop the whole job with a message that names it."""

import json

import numpy as np
import pytest

from e2e_util import DEEPSEEK_EXAMPLE, EXAMPLE, hpcrl, leftover_processes

pytestmark = pytest.mark.e2e

REQUIRED_KEYS = ["step", "reward/mean", "timing/rollout_s", "timing/train_s", "timing/sync_s",
                 "timing/step_s", "rollout/tokens", "sync/bytes", "sync/logprob_max_abs_diff", "train/loss",
                 "train/kl", "train/entropy"]


def model_bytes(preset: str) -> int:
    """Bytes of the preset's float32 weights: what one weight sync moves into one engine."""
    from hpcrl.models.presets import load_hf_config
    from moe.specs import spec_from_config

    return sum(t.numel * 4 for t in spec_from_config(load_hf_config(preset, None)).tensors)


@pytest.fixture(scope="module")
def example_run(tmp_path_factory):
    """The example run, once: (run dir, `hpcrl run`'s output, wall seconds). Its final checkpoint
    also feeds the export round trip below."""
    run_dir = tmp_path_factory.mktemp("example") / "run"
    out, wall = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), timeout_s=840)
    return run_dir, out, wall


LEARNING_RUNS = {"tiny_moe_grpo": ("example_run", "tiny-qwen3-moe"),
                 "tiny_deepseek_v3_grpo": ("deepseek_example_run", "tiny-deepseek-v3")}
"""Example -> (the fixture of its whole run, its model preset). The DeepSeek-V3 run is shared with
test_resume (tests/e2e/conftest.py)."""


@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", list(LEARNING_RUNS))
def test_example_learns_from_random_init(request, example):
    """The example learns (last-5 reward >= 0.8 in its 80 steps) with the shard route (`auto` on
    CPU) syncing the whole model into the engine and passing the log-prob check at every step; the
    engine starts from other weights (test_sync_check_catches), so step 0 checks the initial push."""
    fixture, preset = LEARNING_RUNS[example]
    run_dir, out, wall = request.getfixturevalue(fixture)[:3]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(80))  # what the examples promise: 80 steps
    for r in records:
        missing = [k for k in REQUIRED_KEYS if k not in r]
        assert not missing, (r["step"], missing)
        assert r["sync/logprob_max_abs_diff"] < 1e-4, r
        assert r["sync/bytes"] == model_bytes(preset) and r["rollout/tokens"] > 0, r
    assert "weight sync: shard" in (run_dir / "logs" / "rank1-trainer.log").read_text()
    rewards = np.array([r["reward/mean"] for r in records])
    first5, last5 = rewards[:5].mean(), rewards[-5:].mean()
    assert last5 >= 0.8 and last5 >= 3 * first5, (first5, last5, rewards.round(2).tolist())
    digest = json.loads((run_dir / "final.json").read_text())["policy_sha256"]
    assert len(digest) == 64 and f"policy sha256: {digest}" in out.stdout
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((run_dir / "config.json").read_text())["algorithm"]["num_steps"] == len(records)
    assert (run_dir / "config.yaml").exists()
    from hpcrl.models.presets import load_hf_config

    model_type = load_hf_config(preset, None)["model_type"]
    assert json.loads((run_dir / "model_config.json").read_text())["model_type"] == model_type
    print(f"{example}: {len(records)} steps in {wall:.0f} s wall, reward {first5:.3f} -> {last5:.3f}")


@pytest.mark.timeout(600)
def test_export_then_post_train_from_it(example_run, tmp_path):
    """The trained example -> `hpcrl export` -> a run with model.path = the export starts where the
    first run ended: trainer and engines load the directory, step 0 already scores >= 0.9."""
    run_dir, first, _ = example_run
    assert first.returncode == 0
    last5 = np.mean([json.loads(line)["reward/mean"]
                     for line in (run_dir / "metrics.jsonl").read_text().splitlines()[-5:]])
    exported = tmp_path / "hf"
    out, _ = hpcrl("export", str(run_dir), "--out", str(exported), timeout_s=120)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    second = tmp_path / "second"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(second), "--set", f"model.path={exported}",
                   "--set", "algorithm.num_steps=2", "--set", "logging.progress=false", timeout_s=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (second / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["reward/mean"] >= 0.9, (last5, records[0]["reward/mean"])
    assert records[0]["sync/logprob_max_abs_diff"] < 1e-4
    from checkpoints.hf_safetensors import dir_digest

    assert dir_digest(exported) == json.loads((run_dir / "final.json").read_text())["policy_sha256"]
    print(f"export round trip: first run's last-5 reward {last5:.3f}, second run's step 0 "
          f"{records[0]['reward/mean']:.3f}")


def run_with_sync(run_dir, sync: str, args: list[str], example=EXAMPLE) -> tuple[list[dict], dict]:
    """`hpcrl run` of the example with `rollout.weight_sync=sync`: it must succeed with the sync
    check below 1e-4 at every step. Returns (metrics records, final.json)."""
    out, _ = hpcrl("run", str(example), "--run-dir", str(run_dir), *args, "--set",
                   f"rollout.weight_sync={sync}", timeout_s=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records), records
    return records, json.loads((run_dir / "final.json").read_text())


@pytest.mark.timeout(600)
@pytest.mark.parametrize("example", [EXAMPLE, DEEPSEEK_EXAMPLE], ids=["qwen3_moe", "deepseek_v3"])
def test_two_trainer_ranks_ep2_two_engines_shard_and_broadcast_sync_agree(tmp_path, example):
    """Expert parallel trainer (EP=2 over 2 ranks) syncing into two engines, once shard to shard (the
    default: each rank sends its own experts) and once by SGLang-style broadcast (the model is below
    one bucket, so trainer rank 0 is the only source: it gathers rank 1's experts, then broadcasts to
    both engines in one group): the engines get the same weights, so the same seed gives the same
    rewards and the same final policy hash. DeepSeek-V3: MLA, the dense layer, the shared expert and
    the float32 e_score_correction_bias go along."""
    preset = {EXAMPLE: "tiny-qwen3-moe", DEEPSEEK_EXAMPLE: "tiny-deepseek-v3"}[example]
    args = ["--set", "trainer.num_procs=2", "--set", "trainer.ep=2", "--set", "rollout.num_engines=2",
            "--set", "algorithm.num_steps=3", "--set", "logging.progress=false"]
    results = []
    for sync in ("shard", "broadcast"):
        records, final = run_with_sync(tmp_path / sync, sync, args, example)
        assert all(r["sync/bytes"] == 2 * model_bytes(preset) and r["sync/gbps"] > 0 for r in records), \
            records
        announced = {"shard": "weight sync: shard",
                     "broadcast": "weight sync: broadcast, sources [0] into 2 engine(s) in 1 turn(s)"}
        assert announced[sync] in (tmp_path / sync / "logs" / "rank1-trainer.log").read_text()
        results.append(([r["reward/mean"] for r in records], final))
    assert results[0] == results[1]


@pytest.mark.timeout(600)
def test_deepseek_v2_trains_under_ep2_with_the_engine_agreeing_at_every_step(tmp_path):
    """A DeepSeek-V2-Lite-shaped model (tests/deepseek_dirs.deepseek_v2_config: greedy softmax top-k,
    not renormalised, times routed_scaling_factor 2.0, no router bias, no q_lora) on the DeepSeek
    example's job: the Megatron trainer (EP=2 over 2 ranks) syncs shard to shard into transformers'
    DeepseekV2ForCausalLM in the reference engine, and the engine's log-probs of every step's samples
    equal the trainer's within 1e-4 (run_with_sync): both compute V2's router, and every tensor
    arrived."""
    from deepseek_dirs import deepseek_v2_config

    from moe.specs import spec_from_config

    config = tmp_path / "deepseek_v2.json"
    config.write_text(json.dumps(deepseek_v2_config()))
    args = ["--set", "model.preset=null", "--set", f"model.config_path={config}", "--set", "trainer.num_procs=2",
            "--set", "trainer.ep=2", "--set", "algorithm.num_steps=3", "--set", "logging.progress=false"]
    records, _ = run_with_sync(tmp_path / "run", "shard", args, DEEPSEEK_EXAMPLE)
    v2_bytes = sum(t.numel * 4 for t in spec_from_config(deepseek_v2_config()).tensors)  # no router bias
    assert len(records) == 3 and all(r["sync/bytes"] == v2_bytes for r in records), records


@pytest.mark.timeout(600)
def test_broadcast_sync_from_two_sources_matches_shard_sync(tmp_path):
    """The small preset (108 MiB) with 16 MB buckets: both trainer ranks are broadcast sources,
    each engine hears from both in two turns (SGLang's protocol, one group per source and engine).
    The engines get the same weights as with the shard sync: same rewards, same final policy.
    Checksums over every byte (`rollout.sync_checksum: full`) on both paths' point-to-point rounds."""
    args = ["--set", "model.preset=small-qwen3-moe", "--set", "trainer.num_procs=2", "--set", "trainer.ep=2",
            "--set", "rollout.num_engines=2", "--set", "data.num_prompts_per_step=2", "--set",
            "algorithm.group_size=2", "--set", "algorithm.num_steps=2", "--set", "rollout.bucket_mb=16",
            "--set", "rollout.sync_checksum=full", "--set", "logging.progress=false"]
    results = []
    for sync in ("shard", "broadcast"):
        records, final = run_with_sync(tmp_path / sync, sync, args)
        results.append(([r["reward/mean"] for r in records], final))
    log = (tmp_path / "broadcast" / "logs" / "rank2-trainer.log").read_text()
    assert "weight sync: broadcast, sources [0, 1] into 2 engine(s) in 2 turn(s)" in log, log[-2000:]
    assert results[0] == results[1]


def failed_run(run_dir, fault: str, *settings: str) -> tuple[str, str]:
    """`hpcrl run` of the example with HPCRL_FAULT set: it must fail and leave nothing running.
    Returns (stdout + stderr, stderr)."""
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", "algorithm.num_steps=3",
                   *settings, env_extra={"HPCRL_FAULT": fault}, timeout_s=280)
    assert out.returncode != 0
    assert not leftover_processes(str(run_dir))
    return out.stdout + out.stderr, out.stderr


@pytest.mark.timeout(300)
def test_a_bad_row_validation_did_not_check_stops_the_run_as_bad_input(tmp_path):
    """Validation reads the file's first 64 rows and the first 64 of the sampler's epoch-0 order; a bad
    row the sampler draws later (here the 65th-100th of that order, drawn at step 0) stops the run with
    exit 2 and the row's message, no traceback, nothing left running (it was a controller fault: a
    traceback, MPI_Abort(1))."""
    n, seed = 201, 0
    order = np.random.default_rng([seed, 0]).permutation(n)  # hpcrl.tasks.sampler's epoch-0 order
    bad = next(int(order[p]) for p in range(64, 100) if order[p] >= 64)
    rows = [{"prompt": "ab", "answer": "ab"}] * n
    rows[bad] = {"prompt": "AB!", "answer": "ab"}  # outside the character tokenizer's alphabet
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", f"data.path={data}", "--set",
                   f"data.seed={seed}", "--set", "data.num_prompts_per_step=100", "--set", "algorithm.group_size=2",
                   "--set", "algorithm.num_steps=1", "--set", "logging.progress=false", timeout_s=280)
    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
    assert f"hpcrl run stopped on bad data: data.path='{data}': row {bad + 1} has a prompt" in out.stderr
    assert "Traceback" not in out.stderr and not leftover_processes(str(run_dir))


@pytest.mark.timeout(300)
def test_hung_trainer_rank_is_named_and_the_job_stops(tmp_path):
    run_dir = tmp_path / "hang"
    text, stderr = failed_run(run_dir, "1:train:hang", "--set", "resources.timeout_s=10")
    assert "no answer within 10 s in phase 'train' of step 0 from rank 1 (trainer, host" in text, text[-3000:]
    assert "Traceback" not in stderr
    assert not (run_dir / "final.json").exists()


@pytest.mark.timeout(300)
def test_rollout_rank_that_dies_is_named(tmp_path):
    text, _ = failed_run(tmp_path / "exit", "2:generate:exit")
    assert "the engine of rank 2 (rollout, host" in text and "in phase 'generate' of step 0" in text, \
        text[-3000:]
    assert "see RUN_DIR/logs/engine0.log" in text


@pytest.mark.timeout(300)
def test_rollout_rank_that_exits_is_named_with_its_engine_gone(tmp_path):
    """The rollout rank itself dies (at its step-0 heartbeat): its engine goes with it, and the
    controller names the rank, whichever of generation or the next heartbeat notices first."""
    text, stderr = failed_run(tmp_path / "rank_exit", "2:heartbeat:exit")
    assert "rank 2 (rollout, host" in text and "exited during phase" in text, text[-3000:]
    assert "Traceback" not in stderr


@pytest.mark.timeout(300)
def test_hung_engine_is_named_within_the_deadline(tmp_path):
    """Generation goes from the controller straight to the engine over HTTP: a hung engine is named
    with its rollout rank when the phase deadline passes, and nothing is left running."""
    text, stderr = failed_run(tmp_path / "hang", "2:generate:hang", "--set", "resources.timeout_s=10")
    assert "no answer within 10 s in phase 'generate' of step 0 from the engine of rank 2 (rollout, host" \
        in text, text[-3000:]
    assert "Traceback" not in stderr
