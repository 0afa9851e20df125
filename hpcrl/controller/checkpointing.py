"""The controller's checkpoint policy: when to save, what to resume from, how to react to
preemption. The loop only calls `maybe_save(step)` after each step; `Session.phase` calls
`check_abandon` at phase boundaries, and the long waits inside a phase (an engine's generation, the
reward workers) call `poll` between their polls.

Saving is collective on the trainer ranks (hpcrl/trainer/checkpoint_io.py writes HDF5 shards under
HF names; the store in checkpoints/ commits atomically). The controller adds the metadata that
makes a resume exact: step, resolved config, layouts, weight version, sampler position, counters,
the last evaluation and the metrics history (metrics.jsonl is rewritten from it on resume, so no
step is logged twice); and, as a blob, the rollouts sampled and not yet trained on by a completed
step (hpcrl/controller/pipeline.py: the batches sampled ahead with rollout.max_staleness, or the
batch of a step abandoned after its generation), with the prompt cursor past them.

Resume modes (`hpcrl run` flags, passed as HPCRL_RESUME): "auto" (default: latest complete
checkpoint of the run, if any), "none" (`--no-resume`), or a step number (`--resume-from STEP`).
The controller holds the checkpoint dir's lock for its life, and an automatic resume takes only the
run's own checkpoints (hpcrl/checkpoint_owner.py): a Slurm job starts long after `hpcrl submit`
checked them, and another run may have written there meanwhile.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from checkpoints import discard_newer, latest_step, list_checkpoints, open_checkpoint
from hpcrl.checkpoint_owner import check_own_checkpoint, lock_checkpoint_dir
from hpcrl.config import to_dict
from hpcrl.config.schema import JobConfig
from hpcrl.controller import pending_eval
from hpcrl.controller.comm import RankFailure
from hpcrl.controller.groups import PolicyGroup
from hpcrl.controller.metrics import read_metrics, set_aside_metrics
from hpcrl.controller.pipeline import BUFFER_BLOB, BufferMismatch, GenerationPipeline
from hpcrl.controller.preemption import Preempted, PreemptionWatch
from launch.checkpoint_step import checkpoint_dir, run_id

# Phases before which a step may be abandoned, as long as no update of it was sent yet (ppo updates
# its critic before its policy): the trainers then hold the state of the previous step.
ABANDONABLE_PHASES = ("generate", "reward", "logprobs", "train_critic", "train")


class EvalAbandoned(Preempted):
    """A preemption cut the evaluation after `last_completed_step` short (Checkpointer.poll); the
    session logs the step without it and saves it with the evaluation pending."""


class ResumeError(RuntimeError):
    """The requested resume is impossible (no such checkpoint, or checkpoints would be overwritten)."""


class Checkpointer:
    def __init__(self, job: JobConfig, run_dir: Path, policy: PolicyGroup, resume: str = "auto") -> None:
        self.job, self.run_dir, self.policy = job, run_dir, policy
        self.dir = checkpoint_dir(job, run_dir)
        self._dir_lock = lock_checkpoint_dir(job, self.dir, run_dir)
        """The run's lock on its checkpoint dir, held for the controller's life (hpcrl/checkpoint_owner.py)."""
        self.resume_mode = resume
        self.watch = PreemptionWatch(job.checkpoint.grace_s)
        self.attempt_id = uuid.uuid4().hex
        self._start_step = 0
        self._last_step_end = time.monotonic()
        self.step_s = 0.0
        self.save_s = 0.0
        self._unlogged_save_s: float | None = None
        self.on_phase: Callable[[int, str], None] = lambda step, phase: None
        """Records a phase the checkpointer starts (the session's phase file)."""
        self._phase: tuple[int, str] = (-1, "startup")  # the step and phase in progress (check_abandon)
        self._poll_fired = False  # poll has abandoned a step (or an evaluation): it fires once
        self.saved_step: int | None = None
        self.completed_step = -1
        """Last step whose update and weight sync completed."""
        self.eval_state: dict = {}
        """{"last_step", "metrics"} of the last evaluation (hpcrl/controller/evaluation.py), or {};
        "pending": the step whose evaluation a preemption cut short (the resume runs it first)."""
        self.restored_checkpoint: str | None = None
        """The digest of the checkpoint this attempt resumed from (hpcrl/controller/pending_eval.py)."""
        self.prompt_cursor = PromptCursor()
        """The prompt sampler's position (blocks of num_prompts_per_step prompts drawn so far)."""
        self.pipeline: GenerationPipeline | None = None
        """The rollouts sampled and not trained on by a completed step (set by the session)."""
        self.failed_reward_steps: list[int] = []
        """The steps in a row whose reward failed on every completion (FailedSteps.steps, the same
        list object: set by the session): a resume continues the row (reward.max_failed_steps)."""
        self.algorithm_state: dict = {}
        """The algorithm's own state across steps (RL.state), e.g. ppo's adaptive KL coefficient."""
        self._algorithm_state_done: dict = {}  # as of the last completed step: what a save records
        self._failed_reward_steps_done: list[int] = []  # the same of failed_reward_steps
        model_config = run_dir / "model_config.json"
        self._model_config = json.loads(model_config.read_text()) if model_config.is_file() else None
        """The policy's HF config, recorded in each checkpoint: a resume from a shared checkpoint.dir
        compares it with the job's model (hpcrl/runner.py _check_same_run)."""

    # ------------------------------------------------------------------ resume

    def _resume_target(self) -> int | None:
        existing = list_checkpoints(self.dir) if self.dir.exists() else []
        if self.resume_mode == "none":
            if existing:
                raise ResumeError(f"--no-resume: {self.dir} already holds checkpoints (steps {existing}); "
                                  "a fresh run would overwrite them. Use another --run-dir or "
                                  "checkpoint.dir, or delete that directory")
            return None
        if self.resume_mode == "auto":
            if not existing:
                return None
            step = latest_step(self.dir)
            if os.environ.get("SLURM_RESTART_COUNT", "0") == "0":  # a requeue goes on with what it took
                check_own_checkpoint(self.job, self.run_dir, self.dir, step, existing)
            return step
        step = int(self.resume_mode)
        if step not in existing:
            raise ResumeError(f"--resume-from {step}: no complete checkpoint at step {step} in {self.dir}; "
                              f"available: {existing or 'none'}")
        return step

    def restore(self) -> int:
        """Load the checkpoint to resume from (if any) into the trainer ranks and the metrics log;
        return the first step to run."""
        step = self._resume_target()
        if step is None:
            moved = set_aside_metrics(self.run_dir)
            if moved is not None:
                print(f"hpcrl: no checkpoint to resume from; the earlier attempt's metrics.jsonl is kept as "
                      f"{moved.name}", flush=True)
            return 0
        try:
            meta = self.policy.load_checkpoint(str(self.dir), step)
        except RankFailure as exc:
            others = [s for s in list_checkpoints(self.dir) if s != step]
            hint = (f"; `--resume-from {others[-1]}` resumes from another complete checkpoint (steps {others})"
                    if others else "")
            raise RankFailure(f"{exc}\ncheckpoint step {step} in {self.dir} did not load{hint}") from None
        history = [r for r in meta.get("metrics_history", []) if r["step"] <= step]
        self.eval_state = meta.get("eval", {})
        self.restored_checkpoint = pending_eval.checkpoint_digest(meta)
        ran = pending_eval.done(self.run_dir, self.restored_checkpoint, self.eval_state.get("pending"))
        if ran is not None:  # an attempt after this checkpoint ran and logged it (hpcrl/controller/pending_eval.py)
            print(f"hpcrl: the evaluation after step {step}, cut short by a preemption, ran and was logged in an "
                  "earlier attempt: not run again", flush=True)
            history.append(ran["record"])
            self.eval_state = ran["eval_state"]
        (self.run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in history))
        self._start_step = step + 1
        self.saved_step = self.completed_step = step
        # Checkpoints written before the cursor existed drew one block per step.
        self.prompt_cursor.next_block = int(meta.get("sampler", {}).get("cursor", step + 1))
        with open_checkpoint(self.dir, step) as reader:
            if reader.blob_ranks(BUFFER_BLOB):
                try:
                    self.pipeline.restore(reader.blob(BUFFER_BLOB))
                except BufferMismatch as exc:
                    raise ResumeError(f"checkpoint step {step} holds rollouts sampled and not yet trained on "
                                      f"(rollout.max_staleness, or a step abandoned after its generation): {exc}. "
                                      "algorithm.group_size, data.num_prompts_per_step, the data or the tokenizer "
                                      "changed since it was saved; resume with the settings it was saved with, "
                                      "or start a new run (another --run-dir)") from None
        self.algorithm_state.update(meta.get("algorithm_state", {}))
        self.failed_reward_steps[:] = meta.get("reward", {}).get("failed_steps", [])
        self._failed_reward_steps_done = list(self.failed_reward_steps)
        self._algorithm_state_done = copy.deepcopy(self.algorithm_state)
        if self.resume_mode not in ("auto", "none"):
            discard_newer(self.dir, step)  # once the step loaded: a failed load keeps them
        print(f"hpcrl: resumed from checkpoint step {step} ({self.dir})", flush=True)
        return self._start_step

    def resume_step(self) -> int:
        """First step to run: 0 for a fresh run, checkpoint step + 1 after a resume."""
        return self._start_step

    # ------------------------------------------------------------------ save

    def _metadata(self, step: int) -> dict:
        job = self.job
        return {"step": step, "config": to_dict(job), "format": "hpcrl-rl-state-1",
                "trainer_layout": {"tp": job.trainer.tp, "pp": job.trainer.pp, "ep": job.trainer.ep,
                                   "etp": job.trainer.etp, "num_procs": job.trainer.num_procs},
                "rollout": {"backend": job.rollout.backend, "num_engines": job.rollout.num_engines,
                            "tp_per_engine": job.rollout.tp_per_engine},
                "weight_version": str(step),
                "run_id": run_id(self.run_dir), "run_dir": str(self.run_dir),
                "sampler": {"seed": job.data.seed, "next_step": step + 1, "cursor": self.prompt_cursor.next_block},
                "counters": {"steps_done": step + 1},
                "eval": self.eval_state,
                "algorithm_state": self._algorithm_state_done,
                "reward": {"failed_steps": self._failed_reward_steps_done},
                "model_config": self._model_config,
                "metrics_history": [r for r in read_metrics(self.run_dir) if r["step"] <= step]
                if (self.run_dir / "metrics.jsonl").exists() else []}

    def save(self, step: int, stopping: bool = False) -> None:
        """Save the state after `step`. `stopping` (the run ends after it: a preemption, the time
        limit, a stop): the prompt blocks still in generation are not waited for but dropped, and the
        cursor moved back to them (GenerationPipeline.drop_in_flight): a resume samples them again
        with the version it pushes, the one that sampled them here (an asynchronous run's push, just
        collected, starts the batches ahead)."""
        self.on_phase(step, "save")  # a rank that dies saving is named in it
        t0 = time.monotonic()
        self.policy.collect_push()  # a push left queued: its pipeline fill is part of the state
        if stopping and self.pipeline is not None:
            dropped = self.pipeline.drop_in_flight(self.prompt_cursor)
            if dropped:
                print(f"hpcrl: {dropped} prompt block(s) in generation when the run stopped are not saved; a "
                      "resume samples them again", file=sys.stderr, flush=True)
        buffer = self.pipeline.to_bytes() if self.pipeline is not None else None
        self.policy.save_checkpoint(str(self.dir), step, self.attempt_id, self.job.checkpoint.keep,
                                    self._metadata(step), {BUFFER_BLOB: buffer} if buffer else None)
        pending_eval.forget(self.run_dir)
        self.save_s = time.monotonic() - t0
        self._unlogged_save_s = self.save_s
        self.saved_step = step

    def take_save_s(self) -> float | None:
        """The seconds of the last save, once: the next step's record logs them (timing/save_s; a
        step's record is written before its save)."""
        saved, self._unlogged_save_s = self._unlogged_save_s, None
        return saved

    def _time_is_short(self) -> bool:
        """True when one more step plus a save would not fit before the expected kill."""
        return self.watch.seconds_left() < 1.5 * (self.step_s + self.save_s) + 5.0

    def maybe_save(self, step: int) -> None:
        """Save after `step` if the interval, the last step, a preemption signal or the job's time
        limit asks for it; on preemption or time limit raise `Preempted` to end the run."""
        self.completed_step = step
        if self.pipeline is not None:
            self.pipeline.step_done(step, updated=self.policy.policy_step == step)
        self._algorithm_state_done = self._state_as_saved()
        self._failed_reward_steps_done = [s for s in self.failed_reward_steps if s <= step]
        now = time.monotonic()
        self.step_s = max(self.step_s * 0.8, now - self._last_step_end)
        self._last_step_end = now
        interval = self.job.checkpoint.interval_steps
        last = step == self.job.algorithm.num_steps - 1
        stop = self.watch.requested or self._time_is_short()
        if last or stop or (interval and (step + 1) % interval == 0):
            self.save(step, stopping=stop)
        if stop and (not last or self.eval_state.get("pending") is not None):  # the resume evaluates
            why = (f"signal {self.watch.signal_name}" if self.watch.requested else "job time limit near")
            raise Preempted(step, why)

    def _state_as_saved(self) -> dict:
        """rl.state as a checkpoint keeps it (JSON), which the live state becomes too: a resumed run
        reads back what an uninterrupted one holds (int keys as strings, tuples as lists).
        AlgorithmError, at the step that set it, for a value JSON cannot hold (it failed at the
        save on the trainer, by default the last step's: the run ended without a checkpoint)."""
        from hpcrl.controller.api import AlgorithmError

        try:
            saved = json.loads(json.dumps(self.algorithm_state))
        except (TypeError, ValueError) as exc:
            raise AlgorithmError(f"rl.state holds a value a checkpoint cannot keep ({exc}): use JSON values "
                                 "(numbers, strings, bools, None, lists, dicts; float(x) or x.tolist() for "
                                 "numpy and torch values)") from None
        self.algorithm_state.clear()
        self.algorithm_state.update(saved)
        return copy.deepcopy(saved)

    def check_abandon(self, step: int, phase: str) -> None:
        """At a phase boundary: after a preemption signal, abandon the step (before its update)
        when finishing it and saving would not fit in the grace budget."""
        self._phase = (step, phase)
        if self._abandonable(step, phase):
            raise Preempted(step - 1, f"signal {self.watch.signal_name}; step {step} abandoned")

    def _abandonable(self, step: int, phase: str) -> bool:
        return (phase in ABANDONABLE_PHASES and self.policy.changed_step != step and self.watch.requested
                and self._time_is_short())

    def poll(self) -> None:
        """Between the polls of a long wait inside a phase (the engines' generation, the reward
        workers): abandon the step as `check_abandon` would at the phase's end, without waiting for
        it. A generation of minutes outlasts Slurm's grace time: the job was killed unsaved (and, at
        a time limit, not requeued). Not while a weight push is queued (asynchronous runs): the
        trainer ranks are sending it, and the engines take it only once their requests are done, so
        a save could not start before them anyway. The requests still in flight are dropped from
        the save (`save`): a resume samples their prompt blocks again.

        An evaluation (after its step's update and push: the step is done) is abandoned the same way
        (EvalAbandoned): the step is saved with its evaluation pending, which the resume runs first
        on the same policy. Before training there is nothing to save: the rerun evaluates again.

        It fires once: the save that follows collects what answered (and waits for what it keeps)."""
        step, phase = self._phase
        if self._poll_fired or self.policy.queued_push is not None:
            return
        if phase == "eval" and self.watch.requested and self._time_is_short():
            self._poll_fired = True
            why = f"signal {self.watch.signal_name}; the evaluation after step {step} abandoned"
            raise EvalAbandoned(step, why) if step >= 0 else Preempted(-1, why)
        if self._abandonable(step, phase):
            self._poll_fired = True
            raise Preempted(step - 1, f"signal {self.watch.signal_name}; step {step} abandoned in phase '{phase}'")

    def save_after_abandon(self, exc: Preempted) -> None:
        """Make sure the state of `exc.last_completed_step` is saved (the loop did not get to it), if
        the trainers still hold it: after a later step's update was sent (a worker failed mid-step),
        their state is no step's, and the latest checkpoint stays the one to resume from."""
        changed = self.policy.changed_step
        if changed is not None and changed > exc.last_completed_step:
            print(f"hpcrl: step {changed}'s update was sent before the run stopped: the trainers no longer "
                  f"hold step {exc.last_completed_step}'s state, so nothing is saved", file=sys.stderr, flush=True)
            return
        if exc.last_completed_step >= 0 and self.saved_step != exc.last_completed_step:
            self.save(exc.last_completed_step, stopping=True)


def resume_mode_from_env() -> str:
    return os.environ.get("HPCRL_RESUME", "auto")


class PromptCursor:
    """Which block of the prompt sampler comes next (block b = `PromptSampler.batch(b)`). A step
    that draws one batch takes block `step`; an algorithm that draws more (DAPO's refills) moves it
    further, so later steps' prompts depend on the run so far: the cursor is checkpointed."""

    def __init__(self) -> None:
        self.next_block = 0

    def take(self) -> int:
        block, self.next_block = self.next_block, self.next_block + 1
        return block
