"""Evaluation end to end (`data.val_path`, `eval.*`): val/ metrics at the evaluation steps and before
training (per data source too), the training trajectory unchanged by it, its state in the checkpoints,
and a resume that reproduces it. The run also profiles step 1 (logging.profile_steps), which must not
change training either."""

import gzip
import json
import signal
import time

import pytest
from e2e_util import EXAMPLE, hpcrl, kill_everything, start_run
from wandb_records import history, offline_runs, run_id

from launch.result import REQUEUE_EXIT_CODE as EXIT_REQUEUE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _val(record):
    return {k: v for k, v in record.items() if k.startswith("val/")}


def _sha(run_dir):
    return json.loads((run_dir / "final.json").read_text())["policy_sha256"]


def _trace_ops(path) -> set[str]:
    return {e["name"] for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X"}


def _charted(rows):
    return [(r["step"], r.get("reward/mean"), r.get("val/reward_mean"), r.get("val/first/pass@2")) for r in rows]


def test_evaluation_logs_val_metrics_and_leaves_training_unchanged(tmp_path, reference_run):
    ref_dir, args = reference_run  # 8 steps, checkpoints after steps 2, 5, 7
    val = tmp_path / "val.jsonl"  # held-out copy-task prompts: a letter, answered by four of it
    val.write_text("".join(json.dumps({"prompt": c, "answer": c * 4, "data_source": source}) + "\n"
                           for source, letters in (("first", "abcd"), ("second", "efgh")) for c in letters))
    run_dir = tmp_path / "eval"
    eval_args = [*args, "--set", f"data.val_path={val}", "--set", "eval.interval_steps=3",
                 "--set", "eval.num_samples=2", "--set", "eval.temperature=1.0", "--set", "eval.before_train=true",
                 "--set", "logging.wandb_project=hpcrl-e2e",  # W&B offline: the records read back from its files
                 "--set", "logging.rollout_samples=3", "--set", "logging.profile_steps=[1]"]
    wandb_env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", **{
        key: str(tmp_path / "wandb_home" / sub) for key, sub in
        (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data"))}}
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *eval_args, timeout_s=500, env_extra=wandb_env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "evaluation before training and every 3 steps on 8 prompts" in out.stdout
    records, reference = _records(run_dir), _records(ref_dir)

    # evaluation of the initial policy (its own record, step -1), after steps 2 and 5 (interval) and
    # 7 (the last step), with every val/ metric, per data source too
    assert [r["step"] for r in records if _val(r)] == [-1, 2, 5, 7]
    assert [r["step"] for r in records] == list(range(-1, 8))
    assert set(records[0]) == {"step", "time", "timing/eval_s", *_val(records[0])}
    for r in records:
        if _val(r):
            assert set(_val(r)) == {"val/reward_mean", "val/pass@2", "val/reward_errors", "val/response_len",
                                    "val/first/reward_mean", "val/first/pass@2",
                                    "val/second/reward_mean", "val/second/pass@2"}
            assert 0 <= r["val/reward_mean"] <= 1 and 0 <= r["val/pass@2"] <= 1
            # 4 prompts x 2 samples each: the pooled mean is the sources' mean
            assert r["val/reward_mean"] == pytest.approx((r["val/first/reward_mean"] + r["val/second/reward_mean"]) / 2)
            assert r["val/reward_errors"] == 0
            assert r["timing/eval_s"] > 0
    trained = records[1:]
    assert all(r["reward/errors"] == 0 for r in trained)
    # a save's seconds are in the next step's record (checkpoints after steps 2 and 5)
    assert [r["step"] for r in trained if "timing/save_s" in r] == [3, 6]
    # the first 3 completions of each step and evaluation as text, with their rewards
    samples = run_dir / "rollouts"
    assert sorted(p.name for p in samples.iterdir()) == sorted(
        [f"step_{s:06d}.jsonl" for s in range(8)] + [f"val_step_{s:06d}.jsonl" for s in (2, 5, 7)]
        + ["val_before_train.jsonl"])
    for path in samples.iterdir():
        lines = [json.loads(line) for line in path.read_text().splitlines()]
        assert [(r["round"], r["index"]) for r in lines] == [(0, 0), (0, 1), (0, 2)]
        for r in lines:  # copy-task prompts: a letter, answered by four of it
            assert r["answer"] == r["prompt"] * 4 and r["reward_error"] is None and 0 <= r["reward"] <= 1
            assert r["response_tokens"] >= 1 and r["finish_reason"] in ("stop", "length")
        assert {r["data_source"] for r in lines} == ({"first"} if path.name.startswith("val") else {"unknown"})
    step_files = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in samples.glob("step_*.jsonl")}
    # step 1's traces: the trainer rank's commands (named spans) and the engine's forward batches
    profiled = run_dir / "profile" / "step_000001"
    assert sorted(p.name for p in (run_dir / "profile").iterdir()) == ["step_000001"]
    trainer_ops = _trace_ops(profiled / "trainer_rank1.trace.json.gz")
    assert {"hpcrl.train", "hpcrl.sync", "aten::mm"} <= trainer_ops, sorted(trainer_ops)[:20]
    assert {"aten::topk", "aten::softmax"} <= _trace_ops(profiled / "engine0" / "step1-TP-0.trace.json.gz")
    assert f"hpcrl: step 1 profiled: {profiled}" in out.stdout
    # W&B got every record at its step
    [first_wandb] = offline_runs(run_dir)
    assert _charted(history(first_wandb)) == _charted(records)

    # training is exactly the run without evaluation
    assert [r["reward/mean"] for r in trained] == [r["reward/mean"] for r in reference]
    assert _sha(run_dir) == _sha(ref_dir)

    # the last evaluation is in the checkpoint metadata
    manifest = json.loads((run_dir / "checkpoints" / "step_000005" / "manifest.json").read_text())
    saved = manifest["body"]["metadata"]["eval"]
    assert saved["last_step"] == 5 and _val(saved["metrics"]) == _val(records[6])

    # resuming after step 2 evaluates again at 5 and 7 with the same numbers, not before training
    # (that record comes from the checkpoint's metrics history, with its time)
    resumed, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *eval_args, "--resume-from", "2",
                       timeout_s=500, env_extra=wandb_env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    again = _records(run_dir)
    assert [(r["step"], r.get("reward/mean"), _val(r)) for r in again] == \
        [(r["step"], r.get("reward/mean"), _val(r)) for r in records]
    assert again[0] == records[0]
    rewritten = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in samples.glob("step_*.jsonl")}
    assert {n: f[0] for n, f in rewritten.items()} == {n: f[0] for n, f in step_files.items()}  # the same text,
    assert sorted(n for n in rewritten if rewritten[n][1] != step_files[n][1]) == \
        [f"step_{s:06d}.jsonl" for s in range(3, 8)]  # written again for the steps run again
    # W&B had steps 3-7 already: a new W&B run got the restored history (-1 to 2), then steps 3-7
    assert "(new)" in resumed.stdout and len(offline_runs(run_dir)) == 2
    second_wandb = offline_runs(run_dir)[-1]
    assert run_id(second_wandb) != run_id(first_wandb)
    assert _charted(history(second_wandb)) == _charted(records)
    assert _sha(run_dir) == _sha(ref_dir)

    # A preemption in the evaluation after step 2 (its engine hangs there, as a long evaluation outlasts
    # the grace time): step 2 is logged without it and saved with it pending, and the resume runs it
    # first, on the same policy, as a record of its own: the same numbers, and training unchanged.
    cut = tmp_path / "cut"
    proc = start_run(cut, *eval_args, "--set", "checkpoint.grace_s=15", "--set", "resources.timeout_s=900",
                     env_extra={"HPCRL_FAULT": "2:generate:hang:2", **wandb_env})  # the push after step 2: "2"
    deadline = time.monotonic() + 300
    while not (cut / ".phase.json").is_file() or \
            json.loads((cut / ".phase.json").read_text()) != {"step": 2, "phase": "eval"}:
        assert time.monotonic() < deadline and proc.poll() is None, "the evaluation after step 2 did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == EXIT_REQUEUE, out[-3000:]
    assert "the evaluation after step 2 abandoned" in out and "step 2 is saved with its evaluation pending" in out
    assert [r["step"] for r in _records(cut)] == [-1, 0, 1, 2] and not _val(_records(cut)[-1])
    # The resume runs it and logs its record; then the attempt dies (kill -9) in step 3, before its next
    # checkpoint: the resume after that takes the record the first one wrote (.pending_eval.json)
    # rather than evaluating again, so TensorBoard and W&B do not chart it twice.
    proc = start_run(cut, *eval_args, env_extra=wandb_env)
    while not (cut / ".phase.json").is_file() or json.loads((cut / ".phase.json").read_text())["step"] < 3:
        assert time.monotonic() < deadline + 300 and proc.poll() is None, "the resumed run did not reach step 3"
        time.sleep(0.1)
    kill_everything(proc, cut)
    assert json.loads((cut / ".pending_eval.json").read_text())["step"] == 2
    resumed, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(cut), *eval_args, timeout_s=500, env_extra=wandb_env)
    assert resumed.returncode == 0 and "resumed from checkpoint step 2" in resumed.stdout, resumed.stderr[-3000:]
    assert "the evaluation after step 2, cut short by a preemption, ran and was logged in an earlier attempt" \
        in resumed.stdout
    assert not (cut / ".pending_eval.json").exists()  # the save after step 5 holds the record
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    charted = EventAccumulator(str(cut / "tensorboard"))
    charted.Reload()
    assert [e.step for e in charted.Scalars("val/reward_mean")] == [-1, 2, 5, 7]
    got = _records(cut)
    assert [r["step"] for r in got] == [-1, 0, 1, 2, 2, 3, 4, 5, 6, 7]
    assert set(got[4]) == {"step", "time", "timing/eval_s", *_val(records[3])}  # the evaluation's own record
    merged: dict[int, dict] = {}
    for r in got:
        merged.setdefault(r["step"], {}).update(r)
    assert [(r["step"], r.get("reward/mean"), _val(r)) for r in merged.values()] == \
        [(r["step"], r.get("reward/mean"), _val(r)) for r in records]
    assert _sha(cut) == _sha(ref_dir)
    rows = history(offline_runs(cut)[-1])  # W&B: the pending evaluation's row at step 2 too
    assert [_val(r) for r in rows if r["step"] == 2 and _val(r)] == [_val(records[3])]
