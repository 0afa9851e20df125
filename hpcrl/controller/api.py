"""The controller's public API: what an RL algorithm's step function composes.

An algorithm is a module with one function, `step(rl: RL, step: int) -> None`, that reads like its
paper's pseudo-code (the built-ins are in hpcrl/dataflows/; `algorithm.name` takes a built-in name or
the import path of a user's module). Each primitive runs one phase on the worker groups, times it,
records it for failure reports and preemption, and logs its metrics into the step's record:

    rl.generate()                     -> Rollout     engines sample job.algorithm.group_size completions
                                                     of the next prompt block (rollout/*)
    rl.demonstrations()               -> Rollout     the next prompt block with the data's answers (SFT)
    rl.score(rollout)                 -> [B] rewards reward pool, deadlines (reward/*)
    rl.ref_logprobs(rollout)          -> [B, T]      frozen reference policy (Megatron)
    rl.values(rollout)                -> [B, T]      the critic's values (ppo, or critic.enabled)
    rl.update_critic(rollout, returns, old_values)
                                      -> metrics     the critic's clipped value-loss updates (critic/*)
    rl.update_policy(rollout, advantages, loss=..., ref_logprobs=..., tensors=...)
                                      -> metrics     one on-policy optimizer step of `loss` (a built-in or
                                                     `pkg.module:function`, hpcrl/algorithms/losses.py); then
                                                     the weight sync starts
    rl.sync_weights()                 -> metrics     while that sync is in flight, checks the engines'
                                                     log-probs of the update's rollout against the trainer's
                                                     (sync/logprob_max_abs_diff), then waits for it (sync/*;
                                                     asynchronous runs: the next phase needing it waits)
    rl.log(name=value, ...)                          any extra metric of the step

Advantages, losses and rewards are plain tensor functions (hpcrl/algorithms/). Everything a loss
needs travels as named tensors of the batch: per sequence [B] or per token [B, T] (T = the longest
response; `Rollout.response_mask_BT()`). The loop (hpcrl/controller/loop.py) owns what every
algorithm shares: the step range, evaluation, the metrics record and checkpoints.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import time
from types import ModuleType
from typing import Any

import numpy as np

from hpcrl.config.schema import (AlgorithmConfig, JobConfig, critic_enabled, data_parallel_size,
                                 rollout_correction, splits_into_mini_batches)
from hpcrl.controller.groups import Rollout
from hpcrl.controller.sync_check import sync_check_metrics
from hpcrl.user_module import import_user_module

BUILTIN_ALGORITHMS = ("grpo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "dapo", "ppo", "sft")
STEP_SIGNATURE = "def step(rl: hpcrl.controller.api.RL, step: int) -> None"


def load_algorithm(name: str) -> ModuleType:
    """The module of `algorithm.name`: a built-in (hpcrl/dataflows/<name>.py) or an importable module
    with a `step` function; ValueError naming the fix otherwise."""
    module_name = f"hpcrl.dataflows.{name}" if name in BUILTIN_ALGORITHMS else name
    neither = (f"neither a built-in algorithm ({', '.join(BUILTIN_ALGORITHMS)}) nor the import path of a "
               f"module (package.module) defining `{STEP_SIGNATURE}`")
    if ":" in name or not name.replace(".", "").replace("_", "").isalnum():
        raise ValueError(f"is {neither}")
    module = import_user_module(module_name, "cannot load the algorithm", "put it on PYTHONPATH",
                                missing=f"is {neither}")
    step = getattr(module, "step", None)
    if not callable(step):
        raise ValueError(f"module {module_name!r} has no function `step`; define `{STEP_SIGNATURE}`")
    try:
        inspect.signature(step).bind(None, 0)  # the loop calls step(rl, step)
    except TypeError as exc:
        raise ValueError(f"module {module_name!r}: `step{inspect.signature(step)}` cannot be called as "
                         f"step(rl, step) ({exc}); define `{STEP_SIGNATURE}`") from None
    except ValueError:
        pass  # a builtin or C callable without a signature: the first step shows
    return module


class AlgorithmError(RuntimeError):
    """A call of this API that cannot be carried out as made (the algorithm's code is at fault, not
    the run): the run stops with exit 2 and this message, which names the call and the fix."""


RESERVED_KEYS = ("step", "time")
"""Keys of every metrics record that rl.log must not replace (metrics.jsonl, resume)."""


class RL:
    """The API of one run (rank 0); the loop calls `begin_step` / `end_step` around each step."""

    def __init__(self, session: Any) -> None:
        self._s = session
        self.job: JobConfig = session.job
        self.algo: AlgorithmConfig = session.job.algorithm
        self.step = -1
        self._metrics: dict[str, Any] = {}
        self._timing: dict[str, float] = {}
        self._t0 = 0.0
        self._temperature = self.job.rollout.temperature
        # (rollout, trainer log-probs, scores, the step's mismatch/router_agreement or None)
        self._unchecked: list[tuple[Rollout, np.ndarray, Any, float | None]] = []
        self._rescore = self.job.rollout.max_staleness > 0  # the sync check scores the trained batch again

    # -- the loop's side ---------------------------------------------------------------------------

    def begin_step(self, step: int) -> None:
        self.step, self._metrics, self._timing, self._t0 = step, {}, {}, time.perf_counter()
        self._staleness: list[int] = []  # per completion generated this step: step - its policy version
        # every round of a step that generates and scores more than once (dapo's dynamic sampling)
        self._updated_since_generate = False  # a policy update on engine samples, no rl.generate() since
        self._generated = [0, 0]  # tokens, completions
        self._rewards: list[float] = []
        self._score_errors = 0
        self._s.profile_engines(step, start=True)  # logging.profile_steps

    def end_step(self) -> dict[str, Any]:
        """The step's metrics record (timing/* included), for the metrics logger."""
        self._check_logprobs()  # updates of a step that did not call sync_weights
        self._s.profile_engines(self.step, start=False)
        if self.step == self.algo.num_steps - 1:
            with _Timed(self._timing, "sync"):
                self._s.policy.collect_push()  # the last step's, left queued (sync_weights)
        saved_s = self._s.checkpointer.take_save_s()
        if saved_s is not None:
            self.log(**{"timing/save_s": round(saved_s, 6)})  # the save after the previous step
        if self._s.pushes:  # the weight pushes collected in this step
            pushed, self._s.pushes = self._s.pushes, []
            moved, seconds = sum(p["bytes"] for p in pushed), sum(p["seconds"] for p in pushed)
            self.log(**{"sync/bytes": moved, "sync/pushes": len(pushed),
                        "sync/gbps": moved * 8 / 1e9 / max(seconds, 1e-9)})
        timing = {f"timing/{k}_s": round(v, 6) for k, v in self._timing.items()}
        end = time.perf_counter()
        step_s = end - self._t0
        trainer_busy = sum(self._timing.get(k, 0.0) for k in ("logprobs", "train", "sync"))
        engine_busy = self._s.pipeline.busy_seconds(self._t0, end)
        if self._staleness:
            self.log(**{"rollout/staleness_mean": sum(self._staleness) / len(self._staleness),
                        "rollout/staleness_max": max(self._staleness)})
        return {**self._metrics, **timing, "timing/step_s": round(step_s, 6),
                "timing/trainer_idle_s": round(max(step_s - trainer_busy, 0.0), 6),
                "timing/engine_idle_s": round(max(step_s - engine_busy, 0.0), 6)}

    def _phase(self, name: str, timer: str | None = None) -> _Timed:
        self._s.phase(self.step, name)
        return _Timed(self._timing, timer or name)

    # -- the primitives ----------------------------------------------------------------------------

    def generate(self) -> Rollout:
        """The step's prompts (job.data), each sampled job.algorithm.group_size times, group after group."""
        with self._phase("generate", "rollout"):
            rollout, flight, stale = self._s.generate(self.step)
        rollout.steps = [self.step] * len(rollout.response_ids)  # select/concat carry it per completion
        self._updated_since_generate = False
        dropped = self._metrics.get("data/dropped_prompts", 0) + len(self._s.sampler.dropped(self._s.last_block))
        self._staleness += [self.step - v for v in rollout.versions or [flight.version]]
        if rollout.token_versions is not None:  # partial rollouts: completions a push cut
            spanning = sum(len(set(vs)) > 1 for vs in rollout.token_versions) / max(len(rollout.token_versions), 1)
            self.log(**{"rollout/spanning_frac": spanning})
        self._generated[0] += rollout.num_tokens
        self._generated[1] += len(rollout.response_ids)
        self.log(**{"rollout/tokens": self._generated[0],
                    "rollout/response_len": self._generated[0] / max(self._generated[1], 1),
                    "data/dropped_prompts": dropped,
                    "rollout/dropped_stale": self._metrics.get("rollout/dropped_stale", 0) + stale})
        return rollout

    def demonstrations(self) -> Rollout:
        """The next block of prompts with their data answers as responses (SFT targets; one row per
        prompt, no engine log-probs)."""
        with self._phase("generate", "rollout"):
            return self._s.demonstrations()

    def score(self, rollout: Rollout) -> np.ndarray:
        """Float32 [B] rewards of reward.fn; a completion whose reward raised or timed out scores 0."""
        with self._phase("reward"):
            rewards, errors = self._s.score(self.step, rollout)
        self._rewards += rewards.tolist()
        self._score_errors += errors
        mean, std = _mean_std(self._rewards)  # over every completion the step scored
        self.log(**{"reward/mean": mean, "reward/std": std, "reward/errors": self._score_errors})
        return rewards

    def ref_logprobs(self, rollout: Rollout) -> np.ndarray:
        """Float32 [B, T] log-probs of the response tokens under the frozen reference policy
        (needs algorithm.kl_coef > 0, which builds the reference model)."""
        if not self.algo.kl_coef > 0:
            raise AlgorithmError(f"algorithm {self.algo.name!r} calls rl.ref_logprobs, but the job builds no "
                                 "reference model: set algorithm.kl_coef > 0 (the KL penalty's coefficient)")
        self._check_rows("ref_logprobs", rollout)
        with self._phase("logprobs"):
            return self._s.policy.ref_logprobs(self.step, rollout, self._temperature)

    def values(self, rollout: Rollout) -> np.ndarray:
        """Float32 [B, T] values V_t of the critic (the state before response token t; 0 on padding).
        Needs a critic: algorithm.name ppo, or critic.enabled."""
        self._need_critic("values")
        with self._phase("values", "logprobs"):
            return self._s.policy.values(self.step, rollout)

    def update_critic(self, rollout: Rollout, returns: np.ndarray, old_values: np.ndarray, *,
                      epochs: int | None = None, mini_batch_size: int | None = None) -> dict[str, float]:
        """The critic's clipped value-loss updates (critic.value_clip) towards `returns` [B, T], with
        `old_values` [B, T] its values at rollout time (`values`); returns (and logs) critic/* metrics.
        Epochs and mini-batches as `update_policy`'s."""
        self._need_critic("update_critic")
        with self._phase("train_critic", "train"):
            out = self._s.policy.train_critic(
                self.step, rollout, returns, old_values, self.algo.ppo_epochs if epochs is None else epochs,
                self.algo.mini_batch_size if mini_batch_size is None else mini_batch_size)
        self.log(**{f"critic/{k}": v for k, v in out.items()})
        return out

    def _need_critic(self, primitive: str) -> None:
        if not critic_enabled(self.job):
            raise AlgorithmError(f"algorithm {self.algo.name!r} calls rl.{primitive} but this job has no critic: "
                               "set critic.enabled: true (algorithm.name: ppo always builds one)")

    def update_policy(self, rollout: Rollout, advantages: np.ndarray, *, loss: str = "grpo",
                      ref_logprobs: np.ndarray | None = None, tensors: dict[str, np.ndarray] | None = None,
                      epochs: int | None = None, mini_batch_size: int | None = None) -> dict[str, float]:
        """The policy updates of `loss` on the rollout; returns (and logs) train/* metrics (means over
        the optimizer steps). `epochs` / `mini_batch_size` default to algorithm.ppo_epochs /
        mini_batch_size: one pass over the whole batch is one on-policy step; more compute the old
        log-probs first (MegatronPolicy.update).

        `advantages` is [B] or [B, T]; `tensors` are further named [B] / [B, T] arrays for the loss.
        Then the weight sync of the updated policy starts; `sync_weights()` checks the engines'
        log-probs of the sampled tokens against this forward before the update while the sync is in
        flight (WeightSyncError above rollout.logprob_tolerance), and waits for it.
        """
        self._check_update("update_policy", rollout, advantages, loss, ref_logprobs, tensors, epochs,
                           mini_batch_size)
        self._check_sampled_by_this_policy(rollout)
        temperature = 1.0 if loss == "sft" else self._temperature  # the answers' NLL under the model itself
        if temperature != self._temperature and rollout.engine_logprobs:
            raise AlgorithmError(
                f"rl.update_policy(loss='sft') on completions the engines sampled at rollout.temperature="
                f"{self._temperature}: the sft loss is the NLL at temperature 1, so the sync check cannot "
                f"compare its log-probs with the engines'; use rollout.temperature: 1, or rl.demonstrations()")
        if rollout_correction(self.job) != "none" and rollout.engine_logprobs:
            tensors = {**(tensors or {}), "behaviour_logp": rollout.engine_logprobs_BT()}
        scored, rows = [], None  # asynchronous runs: the rows scored again, their scores
        if self._rescore and rollout.engine_logprobs:
            rows = [i for i in range(len(rollout.response_ids))
                    if i % self.algo.group_size < self.job.rollout.rescore_per_group]
            checked = rollout.select(rows)

        def before_push() -> None:
            """While the trainer trains (the engines hold the version this update starts from): the
            scores of the sync check, and the answers a push must not overtake (docs/async.md)."""
            if rows is not None:
                scored.append(self._scores(checked, self._s.rollouts.start(
                    self.step, self._s.rollouts.prepare_scoring(checked))))
            self._s.pipeline.collect_started()

        with self._phase("train"):
            train = self._s.policy.train(
                self.step, rollout, advantages, ref_logprobs, temperature, loss=loss, tensors=tensors,
                epochs=self.algo.ppo_epochs if epochs is None else epochs,
                mini_batch_size=self.algo.mini_batch_size if mini_batch_size is None else mini_batch_size,
                before_sync=before_push)
        self.log(**{("mismatch/" if k == "router_agreement" else "train/") + k: v
                    for k, v in train.metrics.items()})
        if rollout.engine_logprobs:  # demonstrations have none: no engine sampled them
            self._updated_since_generate = True
            agreement = train.metrics.get("router_agreement")
            if rows is None:
                self._unchecked.append((rollout, train.logprobs_BT, None, agreement))
            else:
                self._unchecked.append((checked, train.logprobs_BT[rows], scored[0], agreement))
        return train.metrics

    def _scores(self, rollout: Rollout, scoring: Any) -> list[list[float]]:
        """The engines' log-probs of the batch's response tokens from its scoring requests, which the
        version the trainer's forward runs must have answered."""
        logprobs, versions = self._s.rollouts.collect_scores(scoring, rollout)
        if set(versions) != {self.step}:
            raise AlgorithmError(f"step {self.step}: the engines scored the batch with policy versions "
                               f"{sorted(set(versions))}, the trainer's forward ran version {self.step}: "
                               f"with rollout.max_staleness >= 1 algorithm {self.algo.name!r} must call "
                               "rl.sync_weights() after every rl.update_policy()")
        return logprobs

    def _check_logprobs(self) -> None:
        """The sync check of the updates since the last one: the engines' log-probs of the tokens
        they sampled against the trainer's forward of the same weights (WeightSyncError beyond
        rollout.logprob_tolerance / logprob_mean_tolerance). An asynchronous run's batch was sampled
        by an older policy: the engines' log-probs are then those of the scoring requests
        `update_policy` sent while they held the version the trainer's forward ran."""
        r = self.job.rollout
        for rollout, trainer_BT, scores, agreement in self._unchecked:
            if scores is not None:
                rollout = dataclasses.replace(rollout, engine_logprobs=scores)
            self.log(**sync_check_metrics(rollout, trainer_BT, r.logprob_tolerance, r.logprob_mean_tolerance,
                                          self.step, agreement))
        self._unchecked = []

    def sync_weights(self) -> dict[str, float]:
        """Wait for the engines to hold the updated policy; {"bytes", "seconds"}. The sync check of
        the update's rollout runs first, while the trainer ranks push (they start when the update
        ends): it costs the step nothing unless it outlasts the push. With rollout.max_staleness
        >= 1 the wait is left to the next phase that needs the engines' new version (the next
        update's, usually; docs/async.md) and this returns {}."""
        with self._phase("sync"):
            self._check_logprobs()
            return self._s.push_weights(self.step) or {}

    @property
    def state(self) -> dict[str, Any]:
        """The algorithm's own JSON-able state across steps (e.g. an adaptive KL coefficient): saved in
        every checkpoint as of the last completed step, and restored on resume."""
        return self._s.checkpointer.algorithm_state

    def log(self, **metrics: Any) -> None:
        """Add metrics to the step's record (metrics.jsonl, TensorBoard): numbers (numpy and
        one-element torch values are taken as Python numbers), strings, bools or None; a key logged
        again replaces the step's earlier value."""
        for key, value in metrics.items():
            if type(value) not in _PLAIN:
                metrics[key] = _plain(key, value)
            if key in RESERVED_KEYS:
                raise AlgorithmError(f"rl.log({key}=...): {key!r} is every record's own key (metrics.jsonl); "
                                     "log the value under another name")
        self._metrics.update(metrics)

    # -- the checks of the calls' arguments -------------------------------------------------------

    def _check_sampled_by_this_policy(self, rollout: Rollout) -> None:
        """Synchronous runs: no second update of engine samples before new ones are generated (its
        forward runs the once-updated policy, which did not sample them: the sync check then failed
        as if the weight sync were broken). Asynchronous runs correct for staleness instead."""
        if self._rescore or not rollout.engine_logprobs:
            return
        earlier = sorted(set(rollout.steps or ()) - {self.step})
        if earlier:
            raise AlgorithmError(
                f"rl.update_policy in step {self.step}: the rollout holds completions rl.generate() handed out in "
                f"step(s) {earlier}, sampled by a policy since updated (the sync check then failed as if the weight "
                "sync were broken); a synchronous step updates on its own rl.generate()'s samples (off-policy "
                "batches: rollout.max_staleness)")
        if self._updated_since_generate:
            raise AlgorithmError(
                f"rl.update_policy in step {self.step}: a second update on engine samples of the policy the "
                "first update changed; several updates of one batch take epochs= / mini_batch_size= "
                "(algorithm.ppo_epochs), and a new batch needs rl.sync_weights() then rl.generate()")

    def _check_rows(self, call: str, rollout: Rollout) -> None:
        if not isinstance(rollout, Rollout) or not rollout.response_ids:
            what = "empty" if isinstance(rollout, Rollout) else type(rollout).__name__
            raise AlgorithmError(f"rl.{call}: the rollout is {what}; pass completions of rl.generate() or "
                                 "rl.demonstrations() (or a non-empty rollout.select(rows))")

    def _check_update(self, call: str, rollout: Rollout, advantages: Any, loss: str, ref: Any,
                      tensors: dict | None, epochs: int | None, mini_batch_size: int | None) -> None:
        """The arguments of an update against the rollout, before anything is sent to the trainer
        (where a mistake was a rank's traceback after the step's generation and rewards)."""
        from hpcrl.algorithms.losses import resolve_loss

        self._check_rows(call, rollout)
        B, T = len(rollout.response_ids), rollout.response_mask_BT().shape[1]
        try:
            resolve_loss(loss)
        except ValueError as exc:
            raise AlgorithmError(f"rl.{call}(loss={loss!r}): {exc}") from None
        named = {"advantages": advantages, **({"ref_logprobs": ref} if ref is not None else {}),
                 **{f"tensors[{k!r}]": v for k, v in (tensors or {}).items()}}
        for what, x in named.items():
            shapes = [(B, T)] if what == "ref_logprobs" else [(B,), (B, T)]
            if not isinstance(x, np.ndarray) or x.dtype.kind != "f" or x.shape not in shapes:
                got = f"{type(x).__name__} {getattr(x, 'dtype', '')} {list(getattr(x, 'shape', []))}".strip()
                raise AlgorithmError(f"rl.{call}: {what} is {got}; expected a float numpy array of shape "
                                     f"{' or '.join(str(list(sh)) for sh in shapes)} for this rollout of {B} "
                                     f"completions (T = {T}, its longest response; np.asarray(x, np.float32), "
                                     "or tensor.numpy())")
            if not np.isfinite(x).all():
                raise AlgorithmError(f"rl.{call}: {what} holds NaN or inf at rows "
                                     f"{sorted(set(np.argwhere(~np.isfinite(x))[:, 0].tolist()))[:8]}")
        if epochs is not None and not (isinstance(epochs, int) and epochs >= 1):
            raise AlgorithmError(f"rl.{call}(epochs={epochs!r}): passes over the batch must be an integer >= 1")
        if mini_batch_size:
            dp = data_parallel_size(self.job)
            if not isinstance(mini_batch_size, int) or mini_batch_size < 0 \
                    or not splits_into_mini_batches(B, mini_batch_size, dp):
                raise AlgorithmError(f"rl.{call}(mini_batch_size={mini_batch_size!r}): must divide the "
                                     f"rollout's {B} completions and be a multiple of the data-parallel size "
                                     f"{dp} (0: the whole batch)")


_PLAIN = (int, float, bool, str, type(None))


def _plain(key: str, value: Any) -> Any:
    """A metric value as a JSON value: a numpy scalar or one-element array/tensor as its Python
    number; AlgorithmError for anything else (json.dumps failed after the step's update)."""
    numel = value.numel() if callable(getattr(value, "numel", None)) else getattr(value, "size", None)
    if numel == 1 and callable(getattr(value, "item", None)):  # numpy scalars and arrays, torch tensors
        got = value.item()
        if type(got) in _PLAIN:
            return got
    raise AlgorithmError(f"rl.log({key}=...): {type(value).__name__} {getattr(value, 'shape', '')} is not a "
                         "metric value; log a number, a string, a bool or None (float(x) for a one-element "
                         "array or tensor, x.mean() for a summary)")


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and (population) std of a step's rewards in plain Python: between phases the controller's
    caches are cold, where numpy's two reductions cost ~0.1 ms and this a third of it."""
    mean = math.fsum(values) / max(len(values), 1)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / max(len(values), 1))


class _Timed:
    """Adds the wall time of a `with` block to timing[name]."""

    def __init__(self, timing: dict[str, float], name: str) -> None:
        self.timing, self.name = timing, name

    def __enter__(self) -> None:
        self._t0 = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        self.timing[self.name] = self.timing.get(self.name, 0.0) + time.perf_counter() - self._t0
