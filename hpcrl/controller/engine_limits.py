"""The engines' longest input, read once they are up, against the longest request a step sends.

Validation bounds a request by the model's context (`validate_data.prompt_limit`, CONTEXT_RESERVE):
prompt + rollout.max_new_tokens <= context - 7, as the sync check scores prompt and response as one
input and a partial rollout resumes from both. A running SGLang engine can take less: its longest
input, /server_info `max_req_input_len`, is min(context_len, KV pool) - 6 (managers/tp_worker.py
`get_worker_info`), and a pool smaller than the context only shows once the engine has measured its
GPU. There SGLang would clip max_new_tokens (responses end early, finish_reason "length") and refuse
the sync check's inputs, so the run stops at start, naming what to change (`hpcrl plan` estimates the
pool before allocation: hpcrl/rollout/kv_pool.py).
"""

from __future__ import annotations

from typing import Any

from hpcrl.config import ConfigError, JobConfig
from hpcrl.config.validate_data import longest_prompt


def check_engine_inputs(job: JobConfig, engines: list[Any], tok: Any = None) -> None:
    """ConfigError on rollout.max_new_tokens when the longest prompt a step may hold (`longest_prompt`)
    plus rollout.max_new_tokens reaches an engine's max_req_input_len (engines without the field pass).
    `engines`: EngineClients; `tok`: the job's tokenizer, if loaded."""
    prompt, prompt_from = longest_prompt(job, tok)
    new = job.rollout.max_new_tokens
    for i, engine in enumerate(engines):
        info = engine.server_info()
        limit = info.get("max_req_input_len")
        if limit is None or prompt + new < limit:
            continue
        pool = info.get("max_total_num_tokens")
        held = f"; its KV pool holds {pool:,} tokens" if pool else ""
        raise ConfigError("rollout.max_new_tokens", new,
                          f"with prompts of up to {prompt} tokens ({prompt_from}), a request of "
                          f"{prompt + new} tokens reaches engine {i}'s longest input, max_req_input_len="
                          f"{limit} (SGLang's min(context, KV pool) - 6{held}): it would cut responses short "
                          f"and refuse the sync check; set data.max_prompt_tokens <= {limit - 1 - new}, "
                          "lower rollout.max_new_tokens, or give the engines more KV cache "
                          "(--mem-fraction-static in rollout.server_args; `hpcrl plan` shows the pool)")
