"""Everything the controller's loop talks to, built once on rank 0: worker groups, prompt
sampler, tokenizer, reward pool, evaluator, metrics and checkpointer; plus start-up and shutdown.
"""

from __future__ import annotations

import json
import os
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from hpcrl.config.schema import JobConfig, critic_enabled, engine_routes
from hpcrl.config.validate import prompt_limit
from hpcrl.controller.checkpointing import Checkpointer, EvalAbandoned, resume_mode_from_env
from hpcrl.controller import pending_eval
from hpcrl.controller.comm import World
from hpcrl.controller.engine_limits import check_engine_inputs
from hpcrl.controller.evaluation import BEFORE_TRAINING, Evaluator, read_val_examples
from hpcrl.controller.groups import GenerateRequest, PolicyGroup, Rollout, RolloutGroup
from hpcrl.controller.metrics import MetricsLogger
from hpcrl.controller.phase_file import PhaseFile
from hpcrl.controller.preemption import Preempted
from hpcrl.controller.pipeline import Flight, GenerationPipeline
from hpcrl.controller.samples import SampleLog
from hpcrl.profiling import step_dir
from hpcrl.rewards.pool import FailedSteps, Scores, reward_scorer
from hpcrl.tasks import build_sampler, load_tokenizer, open_examples, prompt_format


def route_format(job: JobConfig, run_dir: Path):  # -> RouteFormat | None
    """The engines' route format when rollout.routing_replay asks for their routes, else None (the
    model's config as the trainer reads it: RUN_DIR/model_config.json)."""
    if not engine_routes(job):
        return None
    from hpcrl.controller.routes import RouteFormat
    from moe.hf_megatron import HFModelDims

    return RouteFormat.of(HFModelDims.from_hf_config(json.loads((run_dir / "model_config.json").read_text())))


def sampling_seed(seed: int, block: int, index: int) -> int:
    """Per-completion sampling seed: a pure function of (seed, prompt block, index), so reruns and
    resumes sample the same tokens (block == step when every step draws one batch)."""
    return zlib.crc32(f"{seed}:{block}:{index}".encode()) & 0x7FFFFFFF


class Session:
    def __init__(self, job: JobConfig, run_dir: Path, world: World) -> None:
        self.job, self.run_dir, self.world = job, run_dir, world
        res = job.resources
        self.policy = PolicyGroup(world, res.timeout_s)
        self.rollouts = RolloutGroup(world, res.timeout_s, route_format(job, run_dir),
                                     job.rollout.nodes_per_engine, run_dir)
        self.tokenizer = load_tokenizer(job)
        self.prompts = prompt_format(job, self.tokenizer, *prompt_limit(job))
        self.sampler = build_sampler(job, self.prompts)
        print(f"hpcrl: prompts from {job.data.path or 'data.task=' + str(job.data.task)}, tokenized by "
              f"{self.tokenizer.name} (stop ids {self.tokenizer.stop_token_ids})", flush=True)
        self.reward_pool = reward_scorer(job.reward.fn, job.reward.num_workers, job.reward.timeout_s)
        self.failed_steps = FailedSteps(job.reward.fn, job.reward.max_failed_steps)
        self.samples = SampleLog(run_dir, job.logging.rollout_samples, self.tokenizer.decode)
        self.checkpointer = Checkpointer(job, run_dir, self.policy, resume_mode_from_env())
        self.checkpointer.failed_reward_steps = self.failed_steps.steps  # a resume continues the row
        self.evaluator = self._evaluator()
        self.evaluator.poll = self.checkpointer.poll  # a preemption abandons a long evaluation
        self.metrics: MetricsLogger | None = None
        self.phase_file = PhaseFile(run_dir / ".phase.json")
        self.checkpointer.on_phase = self.phase_file.write  # not phase(): a save abandons nothing
        self._prepared: dict[int, GenerateRequest] = {}  # the next block's requests, built ahead
        self.pipeline = self.checkpointer.pipeline = GenerationPipeline(
            self.rollouts, self._request_of, self.checkpointer.prompt_cursor.take, job.rollout.max_staleness,
            job.algorithm.num_steps, self._prepare_next, job.rollout.partial)
        self.pipeline.poll = self.checkpointer.poll  # a preemption abandons a step within its generation
        self.last_block = -1  # the prompt block of the last generate
        self.pushes: list[dict[str, float]] = []  # the weight pushes completed since the step record
        self.policy.on_pushed = self._pushed
        self._write_json(".ranks.json", [r.__dict__ for r in world.ranks])
        roles = {role: [r for r in world.ranks if r.role == role] for role in ("controller", "trainer", "rollout")}
        print(f"hpcrl: MPI world of {len(world.ranks)} ranks: " + "; ".join(
            f"{role} {','.join(str(r.rank) for r in rs)} on {','.join(sorted({r.host for r in rs}))}"
            for role, rs in roles.items()), flush=True)

    def _write_json(self, name: str, obj: object) -> None:
        tmp = self.run_dir / f"{name}.tmp"
        tmp.write_text(json.dumps(obj))
        os.replace(tmp, self.run_dir / name)

    def phase(self, step: int, name: str) -> None:
        """Record the current phase (so a launcher can name it if a rank dies without a word) and
        let the checkpointer abandon the step after a preemption signal."""
        self.phase_file.write(step, name)
        self.checkpointer.check_abandon(step, name)

    def start(self) -> None:
        """Start every worker (model build, engine launch), connect trainer -> engines and push the
        initial weights, so the engines generate with exactly the trainer's policy from step 0."""
        t = self.job.resources.startup_timeout_s
        self.phase(-1, "startup")
        trainers, engines = self.policy.async_init(t), self.rollouts.async_init(t)
        trainers.wait()
        urls = engines.wait()
        check_engine_inputs(self.job, self.rollouts.engines, self.tokenizer)
        self.phase(-1, "resume")
        version = self.checkpointer.restore()  # the policy version: optimizer steps taken
        self.phase(-1, "connect")
        self.policy.connect_engines(urls)
        self.phase(-1, "initial sync")
        self.policy.push_weights(version - 1)
        self.pushes = []
        log, start = self.job.logging, self.checkpointer.resume_step()
        self.metrics = MetricsLogger(self.run_dir, self.job.algorithm.num_steps, start, tensorboard=log.tensorboard,
                                     progress=log.progress, wandb=self._wandb(start))

    def _wandb(self, start: int):  # -> WandbLog | None
        """The run dir's W&B run (logging.wandb_project), given the restored metrics history."""
        log = self.job.logging
        if log.wandb_project is None:
            return None
        from hpcrl.config import to_dict
        from hpcrl.controller.metrics import read_metrics
        from hpcrl.controller.wandb_log import WandbLog

        history = read_metrics(self.run_dir) if (self.run_dir / "metrics.jsonl").is_file() else []
        wandb = WandbLog(log.wandb_project, log.wandb_name, self.run_dir, to_dict(self.job), start if start else -1,
                         history)
        print(f"hpcrl: W&B run {wandb.run_id} of project {log.wandb_project} "
              f"({'continued' if wandb.continued else 'new'})", flush=True)
        return wandb

    def generate(self, step: int) -> tuple[Rollout, Flight, int]:
        """Completions of the next block of prompts (the checkpointed prompt cursor: block `step` when
        every step draws once), sampled by policy version max(0, step - rollout.max_staleness) (the
        generation pipeline); its flight and how many stale flights were dropped before it."""
        if self.pipeline.needs_push(step):
            self.policy.collect_push()
        rollout, flight, dropped = self.pipeline.take(step)
        self.last_block = flight.block
        return rollout, flight, dropped

    def push_weights(self, step: int) -> dict[str, float] | None:
        """The weight push after `step`'s update: the engines then hold policy version step + 1, and
        the pipeline starts the batches they sample ahead (rollout.max_staleness). An asynchronous
        run leaves the push queued behind the update and returns None: it is collected when a phase
        needs it (the next update, a generate that `needs_push`, evaluation, a checkpoint, the
        last step's end), so the controller's work between two updates overlaps it."""
        if self.job.rollout.max_staleness and self.policy.queued_push == step:
            return None
        self.pipeline.collect_started()  # answered by the version that started them: docs/async.md
        return self.policy.push_weights(step)

    def _pushed(self, step: int, sync: dict[str, float]) -> None:
        self.pipeline.version = step + 1
        self.pipeline.fill(step + 1)
        self.pushes.append(sync)

    def profile_engines(self, step: int, start: bool) -> None:
        """logging.profile_steps: start (or stop and write) the engines' traces of `step`, through
        SGLang's /start_profile and /stop_profile (hpcrl/profiling.py). A profile that fails is a
        warning: the run goes on."""
        if step not in self.job.logging.profile_steps:
            return
        out = step_dir(self.run_dir, step)
        failed = (self.rollouts.start_profile(str(out), f"step{step}", self.job.resources.device == "cuda")
                  if start else self.rollouts.stop_profile())
        for line in failed:
            print(f"hpcrl: warning: profiling step {step} failed on {line}; the run goes on", file=sys.stderr,
                  flush=True)
        if not start:
            print(f"hpcrl: step {step} profiled: {out} (the trainer ranks' traces follow with their next "
                  "command)", flush=True)

    def _request_of(self, block: int) -> GenerateRequest:
        return self._prepared.pop(block, None) or self._request(block)

    def _prepare_next(self) -> None:
        """Build the next block's requests while the engines generate (the controller is idle then;
        building them costs ~1 ms of the tiny run's step)."""
        block = self.checkpointer.prompt_cursor.next_block
        if block not in self._prepared and block < self.job.algorithm.num_steps + self.job.rollout.max_staleness:
            self._prepared = {block: self._request(block)}

    def demonstrations(self) -> Rollout:
        """The next block's prompts with their reference answers as the responses (answer ids, then
        the tokenizer's `answer_end_id`): supervised targets, no engine involved (no engine log-probs)."""
        block = self.last_block = self.checkpointer.prompt_cursor.take()
        examples = self.sampler.batch(block)
        end = [] if self.tokenizer.answer_end_id is None else [self.tokenizer.answer_end_id]
        responses = [self.tokenizer.encode_completion(ex.answer) + end for ex in examples]
        return Rollout(examples, [list(ex.prompt_ids) for ex in examples], responses, [], ["stop"] * len(examples))

    def _request(self, block: int) -> GenerateRequest:
        """Prompts and sampling parameters of a block: a pure function of the job and the block."""
        batch = self.sampler.batch(block)
        dropped = self.sampler.dropped(block)
        if dropped:
            print(f"hpcrl: prompt block {block}: skipped {len(dropped)} prompt(s) over {self.prompts.limit_reason} "
                  f"(data.overlong_prompts: drop; rows {', '.join(str(i + 1) for i in dropped[:10])}"
                  f"{' ...' if len(dropped) > 10 else ''})", flush=True)
        examples = [ex for ex in batch for _ in range(self.job.algorithm.group_size)]
        prompt_ids = [list(ex.prompt_ids) for ex in examples]
        r = self.job.rollout
        params = [{"temperature": r.temperature, "top_p": r.top_p, "max_new_tokens": r.max_new_tokens,
                   "stop_token_ids": list(self.tokenizer.stop_token_ids), "ignore_eos": r.ignore_eos,
                   "sampling_seed": sampling_seed(self.job.trainer.seed, block, i)}
                  for i in range(len(examples))]
        return self.rollouts.prepare(examples, prompt_ids, params)

    def score(self, step: int, rollout: Rollout) -> tuple[np.ndarray, int]:
        """The rollout's rewards (float32, in order) and how many scored 0 on a reward error; the
        step's first error is printed, naming the reward."""
        scores = self._score(rollout)
        scores.report(f"step {step}", self.job.reward.fn)
        self.samples.write(step, rollout, scores)  # logging.rollout_samples
        self.failed_steps.add(step, scores)  # reward.max_failed_steps: RewardFailing before the update
        return scores.rewards, scores.num_errors

    def _score(self, rollout: Rollout) -> Scores:
        texts = [self.tokenizer.decode(ids) for ids in rollout.response_ids]
        return self.reward_pool.score([(ex.prompt, text, ex.answer, ex.extra)
                                       for ex, text in zip(rollout.examples, texts)], self.checkpointer.poll)

    def _evaluator(self) -> Evaluator:
        """Evaluation on data.val_path (hpcrl/controller/evaluation.py); without it, never due."""
        job, ev, examples = self.job, self.job.eval, []
        if job.data.val_path and (ev.interval_steps > 0 or ev.before_train):  # validate() checked the combination
            examples, skipped = read_val_examples(open_examples(job, self.prompts, "data.val_path"),
                                                  ev.max_prompts, job.data.overlong_prompts == "drop")
            when = [f"every {ev.interval_steps} steps"] if ev.interval_steps > 0 else []
            when = (["before training"] if ev.before_train else []) + when
            print(f"hpcrl: evaluation {' and '.join(when)} on {len(examples)} prompts of "
                  f"{job.data.val_path}" + (f" ({skipped} overlong skipped)" if skipped else ""), flush=True)
        elif job.data.val_path:
            print(f"hpcrl: warning: data.val_path={job.data.val_path!r} is not evaluated: set "
                  "eval.interval_steps > 0 or eval.before_train: true", flush=True)
        return Evaluator(job, examples, self.rollouts, self.tokenizer.stop_token_ids, self._score)

    def evaluate_before_training(self) -> None:
        """The evaluations owed before this attempt's first step, each its own record: eval.before_train's
        of the initial policy at step -1 (once: a resumed run has it in its metrics history), and the
        one a preemption cut short after the checkpoint's step, of the policy it saved (the engines
        hold it after the initial push, as they did then)."""
        if self.checkpointer.resume_step() == 0 and self.evaluator.due(BEFORE_TRAINING):
            self.metrics.log(BEFORE_TRAINING, self.evaluate(BEFORE_TRAINING))
        pending = self.checkpointer.eval_state.pop("pending", None)
        if pending is not None and not self.evaluator.due(pending):  # eval.* or data.val_path changed
            print(f"hpcrl: warning: the evaluation after step {pending}, cut short by a preemption, is no evaluation "
                  "of this job's: not run", file=sys.stderr, flush=True)
        elif pending is not None:
            metrics = self.evaluate(pending)
            if self.checkpointer.eval_state.get("pending") is not None:  # preempted again
                raise Preempted(pending, f"signal {self.checkpointer.watch.signal_name}; the evaluation after "
                                         f"step {pending} abandoned again")
            record = self.metrics.log(pending, metrics)
            # a next attempt from the same checkpoint takes this record instead of evaluating again
            pending_eval.record_done(self.run_dir, self.checkpointer.restored_checkpoint, pending, record,
                                     self.checkpointer.eval_state)

    def evaluate(self, step: int) -> dict[str, Any]:
        """Validation metrics after `step`'s weight sync, or {} when `step` is no evaluation step."""
        if not self.evaluator.due(step):
            return {}
        self.phase(step, "eval")
        t0 = time.perf_counter()
        self.policy.collect_push()  # an asynchronous run's push: its wait counts in timing/eval_s
        try:
            metrics = self.evaluator.maybe_evaluate(step)
        except EvalAbandoned as exc:  # the step is done: logged without it, saved with it pending
            print(f"hpcrl: preempted ({exc.reason}); step {step} is saved with its evaluation pending, which the "
                  "resume runs first", file=sys.stderr, flush=True)
            self.checkpointer.eval_state = {**self.checkpointer.eval_state, "pending": step}
            return {}
        self.samples.write(step, *self.evaluator.last, evaluation=True)  # logging.rollout_samples
        metrics["timing/eval_s"] = round(time.perf_counter() - t0, 6)
        self.pipeline.busy.append(self.evaluator.generation_span)  # timing/engine_idle_s
        self.checkpointer.eval_state = {"last_step": step, "metrics": metrics}
        return metrics

    def finish(self) -> str:
        """Hash the final policy, write RUN_DIR/final.json, stop the workers."""
        self.phase(self.job.algorithm.num_steps, "finish")
        steps = self.job.algorithm.num_steps
        final = {"policy_sha256": self.policy.policy_sha256(steps), "num_steps": steps}
        if critic_enabled(self.job):
            final["critic_sha256"] = self.policy.critic_sha256(steps)
        self._write_json("final.json", final)
        self.stop_workers()
        return final["policy_sha256"]

    def stop_workers(self, exit_code: int = 0, wandb_wait_s: float | None = None) -> None:
        """Close the metrics (W&B's run ends with `exit_code`, within `wandb_wait_s` when given), stop
        the reward workers and let every worker exit cleanly (engines stopped)."""
        if self.metrics is not None:
            self.metrics.close(wandb_wait_s, exit_code)
            self.metrics = None
        self.phase_file.close()
        self.reward_pool.close()
        self.rollouts.shutdown()
        self.policy.shutdown()
