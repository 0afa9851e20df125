"""rollout.ep and rollout.dp_attention reach SGLang (--ep-size, --attn-dp-size; their spellings and
values are checked against SGLang's parser in tests/conformance/test_launch_args.py): SGLang engines
on the broadcast route only, in a layout that splits the model as `hpcrl plan` checks it, and set by
the job's keys, not by rollout.server_args."""

from __future__ import annotations

import pytest

from hpcrl.config import ConfigError, JobConfig, validate
from hpcrl.rollout.worker import sglang_command


def _job(ep: int = 1, dp_attention: int = 1, tp: int = 4, server_args=(), **rollout) -> JobConfig:
    """The tiny preset (4 heads, 2 KV heads, 4 experts) on SGLang engines of `tp` GPUs."""
    job = JobConfig()
    job.model.dtype = "bfloat16"
    job.rollout.logprob_tolerance, job.rollout.logprob_mean_tolerance = 1.0, 0.02  # the bf16 sync check
    job.resources.device = "cuda"
    job.rollout.backend, job.rollout.tp_per_engine = "sglang", tp
    job.rollout.ep, job.rollout.dp_attention = ep, dp_attention
    job.rollout.server_args = list(server_args)
    for key, value in rollout.items():
        setattr(job.rollout, key, value)
    return job


def test_the_engines_get_the_jobs_ep_and_dp_attention(tmp_path):
    (tmp_path / "model_config.json").write_text("{}")
    job = _job(ep=4, dp_attention=2)
    validate(job)
    cmd = sglang_command(job, tmp_path, "h", 1)
    assert cmd[cmd.index("--tp-size"):cmd.index("--tp-size") + 6] == ["--tp-size", "4", "--ep-size", "4",
                                                                      "--attn-dp-size", "2"]
    validate(_job(dp_attention=4, tp=8))  # 4 heads over attention TP 8 / 4 = 2 (not over tp 8)
    plain = sglang_command(_job(), tmp_path, "h", 1)
    assert "--ep-size" not in plain and "--attn-dp-size" not in plain


@pytest.mark.parametrize(("job", "path", "words"), [
    (_job(ep=3), "rollout.ep", "ep=3 must divide tp_per_engine=4"),
    (_job(ep=4, tp=8), "rollout.tp_per_engine", "do not split over 8 GPUs"),
    (_job(dp_attention=3), "rollout.dp_attention", "dp_attention=3 must divide tp_per_engine=4"),
    (_job(ep=2, weight_sync="shard"), "rollout.ep", "hpcrl's shard loader writes SGLang's default layout"),
    (_job(dp_attention=2, backend="reference", tp=1), "rollout.dp_attention",
     "the reference engine runs one GPU per engine"),
    (_job(server_args=["--ep-size", "4"]), "rollout.server_args[0]", "set rollout.ep (hpcrl passes it on"),
    (_job(server_args=["--attn-dp-size=2"]), "rollout.server_args[0]", "set rollout.dp_attention"),
    (_job(server_args=["--dp-size", "2"]), "rollout.server_args[0]",
     "rollout.dp_attention (DP attention) or rollout.num_engines (replicas)"),
], ids=["ep-divides-tp", "heads", "dp-divides-tp", "shard-route", "reference", "server-args-ep",
        "server-args-attn-dp", "server-args-dp"])
def test_layouts_that_cannot_run_name_the_key(job, path, words):
    with pytest.raises(ConfigError) as exc:
        validate(job)
    assert exc.value.path == path and words in str(exc.value), str(exc.value)
