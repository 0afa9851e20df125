"""hpcrl/algorithms: advantages and per-token losses of the RL algorithms, as pure tensor functions.

One module per concept, each docstring stating its math, paper and simplifications (docs/algorithms.md
has them all on one page):

    advantages          GRPO, Dr. GRPO and RLOO outcome advantages
    reinforce_pp        per-token rewards with a KL penalty, returns-to-go, REINFORCE++ advantages
    gae                 generalized advantage estimation and returns for PPO's critic
    aggregation         loss aggregation modes with global counts; masked mean/var and whitening
    kl                  k1/k2/k3 KL estimators; the adaptive KL coefficient
    policy_loss         PPO's clipped loss with decoupled (DAPO clip-higher) and dual clip
    gspo                GSPO's sequence-level ratio and clip (token stop-gradient form)
    value               the critic's clipped value loss; explained variance
    rollout_correction  TIS weights, MIS rejection masks and counts, engine/trainer mismatch metrics
    dapo                overlong reward shaping; dynamic-sampling filter, fill and batch
    sft                 the SFT negative log-likelihood; entropy from logits
    grpo                GRPO's loss (clipped surrogate + KL term), built from the pieces above
    losses              the policy losses the trainer runs by name, their contract (LossBatch, call_loss)

The three constants below are importable without torch (config validation uses them); every other
name is loaded from its module on first access.
"""

from __future__ import annotations

import importlib
from typing import Any

KL_ESTIMATORS = ("k1", "k2", "k3")
LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
MIS_LEVELS = ("sequence", "geometric", "token")

_LAZY = {
    "group_advantages": "advantages", "dr_grpo_advantages": "advantages", "rloo_advantages": "advantages",
    "per_token": "advantages",
    "token_rewards": "reinforce_pp", "returns_to_go": "reinforce_pp",
    "reinforce_pp_advantages": "reinforce_pp",
    "gae_advantages": "gae",
    "aggregate": "aggregation", "masked_mean": "aggregation", "masked_var": "aggregation",
    "whiten": "aggregation",
    "kl_estimate": "kl", "adaptive_kl_coef": "kl",
    "ppo_clip_loss": "policy_loss",
    "gspo_loss": "gspo", "sequence_log_ratio": "gspo",
    "value_loss": "value", "explained_variance": "value",
    "tis_weights": "rollout_correction", "mis_mask": "rollout_correction",
    "sequence_is_log_ratio": "rollout_correction", "mismatch_metrics": "rollout_correction",
    "kept_counts": "rollout_correction",
    "overlong_penalty": "dapo", "groups_with_signal": "dapo", "fill_groups": "dapo", "FillResult": "dapo",
    "dynamic_sampling_batch": "dapo", "DynamicBatch": "dapo",
    "nll_loss": "sft", "entropy_from_logits": "sft",
    "GRPOLossConfig": "grpo", "grpo_loss": "grpo",
}

__all__ = ["KL_ESTIMATORS", "LOSS_AGGS", "MIS_LEVELS", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'hpcrl.algorithms' has no attribute {name!r}")
    return getattr(importlib.import_module(f"hpcrl.algorithms.{module}"), name)


def __dir__() -> list[str]:
    return sorted(__all__)
