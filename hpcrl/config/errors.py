"""The user-facing configuration error, and the helpers its messages share."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any


class ConfigError(ValueError):
    """A bad job file or override. The message names the YAML path, the bad value and the fix."""

    def __init__(self, path: str, value: object, hint: str) -> None:
        self.path = path
        self.value = value
        self.hint = hint
        super().__init__(f"{path}={value!r}: {hint}")


SYNONYMS = {
    "learning_rate": "lr", "clip_ratio": "clip_eps", "clip_ratio_low": "clip_eps",
    "clip_ratio_high": "clip_eps_high", "kl_loss_coef": "kl_coef", "entropy_coeff": "entropy_coef",
    "n": "group_size", "rollout_n": "group_size", "num_generations": "group_size",
    "max_response_length": "max_new_tokens", "max_completion_length": "max_new_tokens",
    "max_prompt_length": "max_prompt_tokens", "total_training_steps": "num_steps",
    "train_batch_size": "num_prompts_per_step", "tensor_model_parallel_size": "tp",
    "pipeline_model_parallel_size": "pp", "expert_model_parallel_size": "ep", "gpu": "cuda",
    "expert_tensor_parallel_size": "etp", "context_parallel_size": "cp",
    "ppo_micro_batch_size_per_gpu": "micro_batch_size",
    "log_prob_micro_batch_size_per_gpu": "logprob_micro_batch_size",
    "log_prob_micro_batch_size": "logprob_micro_batch_size",
    "use_dynamic_bsz": "max_tokens_per_micro_batch", "ppo_max_token_len_per_gpu": "max_tokens_per_micro_batch",
    "max_tokens_per_gpu": "max_tokens_per_micro_batch",
    "recompute_activations": "recompute_granularity", "gradient_checkpointing": "recompute_granularity",
    "enable_gradient_checkpointing": "recompute_granularity", "activation_checkpointing": "recompute_granularity",
}
"""What verl, TRL and Megatron users write -> hpcrl's name, for the suggestions of `did_you_mean`."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the choice `word` is another framework's name of (SYNONYMS: a
    dotted `word` keeps its section), else for the closest of `choices`, or '' when none is close."""
    choices = list(choices)
    head, dot, last = str(word).rpartition(".")
    if last in SYNONYMS and f"{head}{dot}{SYNONYMS[last]}" in choices:
        return f" (did you mean {f'{head}{dot}{SYNONYMS[last]}'!r}?)"
    close = difflib.get_close_matches(str(word), choices, n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def job_field(job: Any, path: str) -> Any:
    """The value at a dotted YAML path of a JobConfig ("algorithm.lr")."""
    obj: Any = job
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj
