"""The controller's step loop (rank 0): the job's algorithm, one step at a time, then what every
algorithm shares. The algorithm's own dataflow is its `step` function (hpcrl/dataflows/, or a
user's module), written against the public API of hpcrl/controller/api.py; GRPO's reads:

    rollout = rl.generate()                  sampler -> engines (HTTP /generate): tokens + log-probs
    rewards = rl.score(rollout)              reward pool (worker processes, deadlines)
    advantages = group_advantages(rewards)   a tensor function (hpcrl/algorithms)
    ref = rl.ref_logprobs(rollout)           frozen reference (Megatron), only with a KL penalty
    rl.update_policy(rollout, advantages, loss="grpo", ref_logprobs=ref)
                                             Megatron step of the loss (its forward gives the old
                                             log-probs); the trainer ranks then start the sync
    rl.sync_weights()                        Megatron shards -> engines; meanwhile the check:
                                             engine vs trainer log-probs of the rollout

then: Evaluator (every eval.interval_steps) -> MetricsLogger.log -> Checkpointer.maybe_save; and
before the first step, with eval.before_train, an evaluation of the initial policy.
"""

from __future__ import annotations

from hpcrl.controller.api import RL, load_algorithm
from hpcrl.controller.session import Session


def run(s: Session) -> None:
    """Run the job's algorithm for `algorithm.num_steps` steps from the checkpointer's resume step."""
    algorithm = load_algorithm(s.job.algorithm.name)
    rl = RL(s)
    s.evaluate_before_training()
    for step in range(s.checkpointer.resume_step(), s.job.algorithm.num_steps):
        rl.begin_step(step)
        algorithm.step(rl, step)
        rl.log(**s.evaluate(step))
        s.metrics.log(step, rl.end_step())
        s.checkpointer.maybe_save(step)
