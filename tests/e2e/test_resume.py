"""Preemption-safe, bit-identical resume of `hpcrl run` (CPU examples, fixed seed): interrupted by a
signal or by kill -9 between checkpoints, then rerun, a run ends with the same policy_sha256 and the
same per-step reward/mean as an uninterrupted run; corrupted checkpoints are detected."""

import json
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from e2e_util import (DEEPSEEK_EXAMPLE, EXAMPLE, hpcrl, kill_everything, leftover_processes, start_run,
                       wait_for_step as _wait_for_step)

from launch.result import REQUEUE_EXIT_CODE as EXIT_REQUEUE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

ARGS = ["--set", "algorithm.num_steps=8", "--set", "checkpoint.interval_steps=3", "--set", "logging.progress=false"]


def _result(run_dir: Path) -> tuple[list[tuple[int, float]], str]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["reward/mean"]) for r in records], json.loads((run_dir / "final.json").read_text())[
        "policy_sha256"]


@pytest.fixture(scope="module")
def uninterrupted(reference_run):
    run_dir, args = reference_run  # tests/e2e/conftest.py: the session's shared uninterrupted run
    # Its ranks were bound to cores and its engine ran over two nodes, these runs' are not and do
    # not: neither may change a number.
    assert args == [*ARGS, "--set", "resources.cpu_bind=auto", "--set", "rollout.nodes_per_engine=2"], args
    return _result(run_dir)


def _start(run_dir: Path) -> subprocess.Popen:
    return start_run(run_dir, *ARGS)


@pytest.fixture(scope="module")
def deepseek_uninterrupted(deepseek_example_run):
    run_dir, _, _, args = deepseek_example_run  # tests/e2e/conftest.py: shared with test_run_example
    return _result(run_dir), args


def _baseline(request, example: str) -> tuple[Path, list[str], int, tuple]:
    """(job file, its --set args, the step count at which to signal, the uninterrupted run's result).
    The tiny example: 8 steps with checkpoints, signalled after 4. The DeepSeek-V3 example: its whole
    80-step run, without checkpoints (the signal saves one), signalled after 40."""
    if example == "tiny_moe":
        return EXAMPLE, ARGS, 4, request.getfixturevalue("uninterrupted")
    result, args = request.getfixturevalue("deepseek_uninterrupted")
    return DEEPSEEK_EXAMPLE, args, 40, result


# The local launcher hands SIGUSR1 and SIGTERM to the controller the same way (as TERM), so one
# signal covers both here; tests/slurm/test_preemption.py covers Slurm's USR1 path end to end.
@pytest.mark.parametrize("example,signame", [
    ("tiny_moe", "SIGUSR1"),
    # the shared uninterrupted run (up to 840 s when this test is the first to ask for it) comes first
    pytest.param("tiny_deepseek_v3", "SIGUSR1", marks=pytest.mark.timeout(1500))])
def test_signal_saves_exits_for_requeue_and_resume_is_bit_identical(tmp_path, request, example, signame):
    job, args, steps, uninterrupted = _baseline(request, example)
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *args, example=job)
    _wait_for_step(proc, run_dir, steps)
    proc.send_signal(getattr(signal, signame))
    out = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_REQUEUE, out[-3000:]
    assert "preempted" in out and "requeue" in out
    assert f"hpcrl run: {signame} forwarded to the controller as SIGTERM" in out, out[-3000:]
    assert not (run_dir / "final.json").exists()
    resumed, _ = hpcrl("run", str(job), "--run-dir", str(run_dir), *args, timeout_s=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    saved = re.search(r"resumed from checkpoint step (\d+)", resumed.stdout)
    # the checkpoint the signal made: after the last step done when it came, before the last step
    assert saved and steps - 1 <= int(saved.group(1)) < len(uninterrupted[0]) - 1, resumed.stdout[-2000:]
    assert _result(run_dir) == uninterrupted
    assert not leftover_processes(str(run_dir))


def test_a_signal_during_a_generation_that_outlasts_the_grace_abandons_it(tmp_path, uninterrupted):
    """Step 4's generation does not end (its engine hangs: a generation of minutes outlasts Slurm's
    grace time as well). The signal abandons the step within the grace budget instead of waiting out
    resources.timeout_s (900 s here, past this test's timeouts); step 3, no checkpoint step, is saved;
    the resume samples block 4 again and ends with the uninterrupted run's result."""
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *ARGS, "--set", "checkpoint.grace_s=15", "--set", "resources.timeout_s=900",
                     env_extra={"HPCRL_FAULT": "2:generate:hang:3"})  # step 4 samples with weight version 3
    _wait_for_step(proc, run_dir, 4)
    deadline = time.monotonic() + 120
    while json.loads((run_dir / ".phase.json").read_text()) != {"step": 4, "phase": "generate"}:
        assert time.monotonic() < deadline and proc.poll() is None, "step 4's generation did not start"
        time.sleep(0.1)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == EXIT_REQUEUE, out[-3000:]
    assert "step 4 abandoned in phase 'generate'" in out and "checkpoint of step 3 saved" in out, out[-3000:]
    assert "1 prompt block(s) in generation when the run stopped are not saved" in out, out[-3000:]
    assert not leftover_processes(str(run_dir))
    resumed, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, timeout_s=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from checkpoint step 3" in resumed.stdout
    assert _result(run_dir) == uninterrupted


def test_kill_9_between_checkpoints_then_resume_is_bit_identical(tmp_path, uninterrupted):
    """The resume also recomputes every layer's activations in its training backwards
    (trainer.recompute_granularity full): the same ops on the same inputs, so the same weights, bit for bit."""
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_step(proc, run_dir, 7)  # checkpoints at steps 2 and 5; step 6 is lost
    kill_everything(proc, run_dir)
    assert not leftover_processes(str(run_dir))
    resumed, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS,
                       "--set", "trainer.recompute_granularity=full", timeout_s=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from checkpoint step 5" in resumed.stdout
    assert _result(run_dir) == uninterrupted


def test_corrupt_shard_is_named_and_an_older_checkpoint_can_be_chosen(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    proc = _start(run_dir)
    _wait_for_step(proc, run_dir, 4)
    proc.send_signal(signal.SIGUSR1)
    assert proc.communicate(timeout=300)[0] and proc.returncode == EXIT_REQUEUE
    ckpt = run_dir / "checkpoints"
    steps = sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*"))
    assert len(steps) >= 2, steps

    def corrupt(step: int) -> tuple[Path, bytes]:
        shard = sorted((ckpt / f"step_{step:06d}").glob("*.h5"))[0]
        good = shard.read_bytes()
        data = bytearray(good)
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
        return shard, good

    # --resume-from an older step that does not load: the newer checkpoints stay (they were discarded
    # before the load) and the message names the step to resume from instead
    older, good = corrupt(steps[0])
    bad, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, "--resume-from", str(steps[0]),
                   timeout_s=400)
    text = bad.stdout + bad.stderr
    assert bad.returncode != 0 and older.name in text, text[-3000:]
    assert f"`--resume-from {steps[-1]}` resumes from another complete checkpoint" in text, text[-3000:]
    assert "failed in phase 'load' of step" in text and "Traceback" not in text, text[-3000:]  # one line
    assert sorted(int(p.name.split("_")[1]) for p in ckpt.glob("step_*")) == steps
    older.write_bytes(good)
    shard, _ = corrupt(steps[-1])
    bad, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, timeout_s=400)
    text = bad.stdout + bad.stderr
    assert bad.returncode != 0
    assert shard.name in text and str(steps[-1]) in text, text[-3000:]
    good, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, "--resume-from", str(steps[0]),
                    timeout_s=400)
    assert good.returncode == 0, good.stdout[-2000:] + good.stderr[-2000:]
    assert _result(run_dir) == uninterrupted


def test_resume_flags_are_checked_before_starting(tmp_path, uninterrupted):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    out, wall = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, "--resume-from", "99", timeout_s=120)
    assert out.returncode == 2 and "--resume-from" in out.stderr and "99" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_a_run_dir_of_another_model_or_algorithm_or_no_run_is_refused_untouched(tmp_path, reference_run):
    """Resuming the shared run's checkpoints with another model (DeepSeek-V3 for its Qwen3-MoE) or an
    algorithm with a critic (ppo; it has none), or running into a directory that holds no run (a
    HuggingFace model directory), exits 2 naming the key before a file is written: the run dir's
    config files stay as they were (a failed resume used to rewrite them, and an export then paired
    the new model's config.json with the old weights)."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(reference_run[0], run_dir)
    before = {f: (run_dir / f).read_bytes() for f in ("config.json", "config.yaml", "model_config.json")}
    for setting, key, why in (("model.preset=tiny-deepseek-v3", "model.preset", "is of another model "
                               "(model_type: 'qwen3_moe' -> 'deepseek_v3'"),
                              ("algorithm.name=ppo", "algorithm.name", "holds no critic")):
        out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, "--set", setting, timeout_s=120)
        assert out.returncode == 2 and f"error: {key}=" in out.stderr and why in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
        assert {f: (run_dir / f).read_bytes() for f in before} == before
    model_dir = tmp_path / "hf"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(model_dir), *ARGS, timeout_s=120)
    assert out.returncode == 2 and "holds config.json but no hpcrl run" in out.stderr, out.stderr
    assert json.loads((model_dir / "config.json").read_text()) == {"model_type": "qwen3_moe"}
    assert sorted(p.name for p in model_dir.iterdir()) == ["config.json"]


def test_resume_under_a_different_trainer_layout(tmp_path, uninterrupted):
    """Saved by 1 trainer rank, resumed by 2 (EP=2): each rank reads only its experts' slices, and
    the first resumed step generates exactly what the uninterrupted run generated. The resumed steps
    train in micro-batches by tokens (trainer.max_tokens_per_micro_batch: here 7 of 10 rows or fewer,
    where the fixed split makes one of 64), and the trainer's log-probs still equal the engine's (the
    sync check). (Micro-batches of other shapes on the EP ranks: tests/megatron/test_policy_layouts.py.)"""
    run_dir = tmp_path / "run"
    first, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, "--set", "algorithm.num_steps=4",
                     timeout_s=400)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    resumed, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, "--set", "trainer.num_procs=2",
                       "--set", "trainer.ep=2", "--set", "algorithm.num_steps=6",
                       "--set", "trainer.max_tokens_per_micro_batch=60", timeout_s=400)
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "resumed from checkpoint step 3" in resumed.stdout
    steps, _ = _result(run_dir)
    assert steps[:5] == uninterrupted[0][:5]  # steps 0-3 restored from history, step 4 regenerated
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6))
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records)


def test_ctrl_c_before_the_world_forms_twice_and_a_second_run_in_the_run_dir(tmp_path, monkeypatch):
    """Ctrl-C before the MPI world formed stops it (the ranks recorded the forwarded TERM as a
    preemption: the world started up, trained a step and saved, then exited 3); a second `hpcrl run`
    on a live run dir exits 2 (the two resumed, wrote and deleted each other's checkpoints and
    metrics), and so does a run in another run dir with the live run's checkpoints as its
    checkpoint.dir (hpcrl/checkpoint_owner.py); a second Ctrl-C stops the world at once, without
    saving."""
    import psutil

    early = tmp_path / "early"
    proc = _start(early)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not any(  # mpiexec has started the ranks
            "hpcrl.worker_main" in " ".join(p.info["cmdline"] or []) and str(early) in " ".join(p.info["cmdline"])
            for p in psutil.process_iter(["cmdline"])):
        time.sleep(0.02)
    assert not (early / ".ranks.json").exists()
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130, out[-3000:]
    assert "SIGINT before the MPI world formed: the world is stopped without saving" in out, out[-3000:]
    assert not list((early / "checkpoints").glob("step_*")) and not leftover_processes(str(early))

    # grpo, each step a second longer: the second Ctrl-C comes while the controller finishes its step
    (tmp_path / "slow_grpo.py").write_text("import time\nfrom hpcrl.dataflows import grpo\nDEFAULTS = grpo.DEFAULTS\n"
                                           "def step(rl, step):\n    grpo.step(rl, step)\n    time.sleep(1.0)\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    run_dir = tmp_path / "run"
    proc = start_run(run_dir, *ARGS, "--set", "algorithm.name=slow_grpo")
    _wait_for_step(proc, run_dir, 2)
    second, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *ARGS, timeout_s=120)
    assert second.returncode == 2 and "is in use by another hpcrl run (its `hpcrl run` pid " \
        f"{proc.pid}" in second.stderr, second.stderr[-2000:]
    # another run dir writing into the live run's checkpoints (a shared checkpoint.dir) exits 2, naming the run
    other, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(tmp_path / "other"), *ARGS,
                     "--set", f"checkpoint.dir={run_dir / 'checkpoints'}", timeout_s=120)
    assert other.returncode == 2 and f"is in use by another run (run dir {run_dir}, pid " in other.stderr, \
        other.stderr[-2000:]
    proc.send_signal(signal.SIGINT)
    time.sleep(0.3)  # two signals sent at once arrive as one
    proc.send_signal(signal.SIGINT)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 130 and "SIGINT a second time: the world is stopped without saving" in out, \
        out[-3000:]
    assert not leftover_processes(str(run_dir))
