"""hpcrl run's checks of a resume before anything starts (hpcrl/runner.py check_resume), on
checkpoints written here with the store's writer: a checkpoint of another model in a shared
checkpoint.dir (the model each checkpoint records) or of another run, a checkpoint past
algorithm.num_steps, and a batch of jobs sharing one checkpoint dir."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from checkpoints import CheckpointWriter
from hpcrl.config import ConfigError, load_job, to_dict
from hpcrl.jobs import Executor, Submission
from hpcrl.models.presets import load_hf_config
from hpcrl.runner import check_resume, prepare_run_dir
from launch.checkpoint_step import run_id

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny_moe_grpo.yaml"


def shared_checkpoint(ckpt_dir: Path, step: int, preset: str, record_model: bool = True,
                      writer: Path | None = None) -> None:
    """A committed checkpoint of `step` as a run of `preset` writes its metadata (the policy's tensors
    do not matter to these checks), by run dir `writer` (None: before checkpoints recorded their run)."""
    job = load_job(EXAMPLE, [f"model.preset={preset}"])
    w = CheckpointWriter(ckpt_dir, step, attempt_id="a")
    w.write("policy/lm_head.weight", torch.zeros(2, 2))
    meta = {"step": step, "config": to_dict(job)}
    if record_model:
        meta["model_config"] = load_hf_config(preset, None)
    if writer is not None:
        meta |= {"run_id": run_id(writer), "run_dir": str(writer)}
    w.commit(meta)


def test_an_automatic_resume_takes_only_its_own_runs_checkpoints(tmp_path: Path) -> None:
    """A checkpoint.dir shared by runs (one scratch dir for every job): a new run dir resumed the
    latest run's state and metrics history as its own without a word. Its own run resumes; another
    run dir is refused, naming the run and both ways on; --resume-from takes it on purpose."""
    shared = tmp_path / "shared"
    job = load_job(EXAMPLE, [f"checkpoint.dir={shared}"])
    first = tmp_path / "first"
    prepare_run_dir(job, first)
    shared_checkpoint(shared, 2, "tiny-qwen3-moe", writer=first)
    check_resume(job, first, "auto")  # its own: a requeue, a rerun
    prepare_run_dir(job, first)
    check_resume(job, first, "auto")  # the run dir keeps its identity
    for other in (tmp_path / "new", tmp_path / "second"):  # a new run dir, and another run's
        if other.name == "second":
            prepare_run_dir(job, other)
        with pytest.raises(ConfigError) as err:
            check_resume(job, other, "auto")
        assert err.value.path == "checkpoint.dir" and \
            f"its latest checkpoint, step 2, is another run's (run dir {first})" in str(err.value) and \
            f"`--run-dir {first}`" in str(err.value) and "`--resume-from 2`" in str(err.value), str(err.value)
        check_resume(job, other, "2")
    # the second run saved there on (--resume-from 2): the first run's own steps are named, not the other's
    shared_checkpoint(shared, 4, "tiny-qwen3-moe", writer=tmp_path / "second")
    with pytest.raises(ConfigError) as err:
        check_resume(job, first, "auto")
    assert "holds checkpoints of two runs: steps [2] are this run's, and the latest, step 4, is another run's " \
        f"(run dir {tmp_path / 'second'})" in str(err.value) and "`--resume-from 2`" in str(err.value), str(err.value)



def test_the_controller_holds_its_checkpoint_dir_and_takes_only_its_own_checkpoints(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Under Slurm the controller starts long after `hpcrl submit` checked the dir, and nothing but
    the controller runs there: a second run's controller writing into the same checkpoint dir is
    refused while the first holds it (flock, released with its fd); an automatic resume from another
    run's latest checkpoint is refused as check_resume refuses it, but in a requeued attempt, which
    goes on from the checkpoint its first attempt resumed on purpose (--resume-from)."""
    from hpcrl.controller.checkpointing import Checkpointer

    monkeypatch.delenv("SLURM_RESTART_COUNT", raising=False)
    shared = tmp_path / "shared"
    job = load_job(EXAMPLE, [f"checkpoint.dir={shared}"])
    first, second = tmp_path / "first", tmp_path / "second"
    for run_dir in (first, second):
        prepare_run_dir(job, run_dir)
    holder = Checkpointer(job, first, policy=None)
    with pytest.raises(ConfigError) as err:
        Checkpointer(job, second, policy=None)
    assert err.value.path == "checkpoint.dir" and f"is in use by another run (run dir {first}, pid " in \
        str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="is in use by another run"):
        check_resume(job, second, "auto")  # `hpcrl run` / `hpcrl submit` ask the same before starting
    (tmp_path / "file").write_text("not a directory")  # left to the writability check, which names it
    check_resume(load_job(EXAMPLE, [f"checkpoint.dir={tmp_path / 'file' / 'ck'}"]), second, "auto")
    os.close(holder._dir_lock)  # the first run ended

    def resume_target(run_dir: Path, resume: str = "auto") -> int | None:
        ck = Checkpointer(job, run_dir, policy=None, resume=resume)
        try:
            return ck._resume_target()
        finally:
            os.close(ck._dir_lock)

    shared_checkpoint(shared, 2, "tiny-qwen3-moe", writer=first)
    assert resume_target(first) == 2
    with pytest.raises(ConfigError, match="its latest checkpoint, step 2, is another run's"):
        resume_target(second)
    assert resume_target(second, "2") == 2
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert resume_target(second) == 2


def test_a_shared_checkpoint_dir_of_another_model_is_refused(tmp_path: Path) -> None:
    """checkpoint.dir set: the run dir is new, so only the checkpoint's record tells the model (the
    other model's weights were loaded silently where the shapes matched, a traceback where not)."""
    shared = tmp_path / "shared"
    shared_checkpoint(shared, 1, "tiny-qwen3-moe")
    job = load_job(EXAMPLE, ["model.preset=tiny-deepseek-v3", f"checkpoint.dir={shared}"])
    with pytest.raises(ConfigError) as err:
        check_resume(job, tmp_path / "new", "auto")
    assert err.value.path == "model.preset" and "is of another model (model_type: 'qwen3_moe' -> " \
        "'deepseek_v3'" in str(err.value), str(err.value)
    check_resume(load_job(EXAMPLE, [f"checkpoint.dir={shared}"]), tmp_path / "new", "auto")  # its own model
    older = tmp_path / "older"  # written before checkpoints recorded the model: nothing to compare
    shared_checkpoint(older, 1, "tiny-qwen3-moe", record_model=False)
    check_resume(load_job(EXAMPLE, ["model.preset=tiny-deepseek-v3", f"checkpoint.dir={older}"]),
                 tmp_path / "new", "auto")


@pytest.mark.parametrize("resume", ["auto", "5"])
def test_a_checkpoint_past_num_steps_is_refused(tmp_path: Path, resume: str) -> None:
    """Resumed at step 5 with num_steps 4, the run trained nothing and its final.json labelled step
    5's policy as 4 steps. The checkpoint of the last step (a finished run, requeued) is resumed."""
    shared = tmp_path / "ck"
    shared_checkpoint(shared, 5, "tiny-qwen3-moe")
    job = load_job(EXAMPLE, ["algorithm.num_steps=4", f"checkpoint.dir={shared}"])
    with pytest.raises(ConfigError) as err:
        check_resume(job, tmp_path / "run", resume)
    assert err.value.path == "algorithm.num_steps" and "step 5" in str(err.value) and \
        "past the run's last step (3)" in str(err.value), str(err.value)
    check_resume(load_job(EXAMPLE, ["algorithm.num_steps=6", f"checkpoint.dir={shared}"]), tmp_path / "run",
                 resume)


def test_a_batch_sharing_a_checkpoint_dir_is_refused_before_anything_starts(tmp_path: Path) -> None:
    """Two sweep points with one fixed checkpoint.dir overwrote, deleted and resumed each other's
    checkpoints (one failed with CheckpointExistsError)."""
    shared = f"checkpoint.dir={tmp_path / 'ck'}"
    batch = [Submission(EXAMPLE, [shared, f"algorithm.lr={lr}"], run_dir=tmp_path / f"run{i}")
             for i, lr in enumerate((1e-3, 3e-3))]
    with pytest.raises(ConfigError, match="every job of a batch needs its own checkpoint dir"):
        Executor(kind="local").submit_batch(batch)
    assert not any((tmp_path / d).exists() for d in ("run0", "run1", "ck"))
