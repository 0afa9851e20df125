"""Per-algorithm defaults and the keys an algorithm does not read: each built-in declares the values
of clip_eps, clip_eps_high, kl_estimator and loss_agg it runs with (hpcrl/dataflows/<name>.py); an
unset key takes them when the config is built, the resolved config (config.json) shows them, a
key the job sets wins (also when it equals the generic default), and a key the algorithm never
reads, or one it fixes, is refused at validation naming the key and the algorithm."""

import importlib
import json

import pytest

from hpcrl.config import ConfigError, job_from_dict, load_job, to_dict, validate
from hpcrl.config.schema import AlgorithmConfig
from hpcrl.controller.api import BUILTIN_ALGORITHMS
from hpcrl.dataflows._declared import GENERIC_DEFAULTS, PER_ALGORITHM_KEYS, declared


def resolved(name: str, **keys) -> tuple:
    a = AlgorithmConfig(name=name, **keys)
    return a.clip_eps, a.clip_eps_high, a.kl_estimator, a.loss_agg


@pytest.mark.parametrize("name", BUILTIN_ALGORITHMS)
def test_the_declarations_read_from_source_are_the_modules_own(name):
    """The config reads DEFAULTS / FIXED from the module's source (torch-free); they must be what the
    module holds when imported, and every built-in declares its loss aggregation at least."""
    module = importlib.import_module(f"hpcrl.dataflows.{name}")
    defaults, fixed = declared(name)
    assert dict(defaults) == module.DEFAULTS and fixed == getattr(module, "FIXED", ())
    assert "loss_agg" in defaults and set(defaults) <= set(PER_ALGORITHM_KEYS)


def test_published_defaults_without_setting_anything():
    # GSPO (arXiv 2507.18071, section 5.1): 3e-4 / 4e-4; DAPO (arXiv 2503.14476, section 3.1): 0.2 / 0.28
    assert resolved("gspo") == (3e-4, 4e-4, None, "seq-mean-token-mean")
    assert resolved("dapo") == (0.2, 0.28, None, "token-mean")
    assert resolved("grpo") == (0.2, 0.2, "k3", "token-mean")
    assert resolved("dr_grpo") == (0.2, 0.2, "k3", "seq-mean-token-sum-norm")
    assert resolved("ppo") == resolved("reinforce_pp") == (0.2, 0.2, "k1", "token-mean")
    assert resolved("sft") == (None, None, None, "token-mean")
    assert resolved("my_pkg.my_algo") == (0.2, 0.2, "k3", "token-mean") == (
        GENERIC_DEFAULTS["clip_eps"], GENERIC_DEFAULTS["clip_eps"], GENERIC_DEFAULTS["kl_estimator"],
        GENERIC_DEFAULTS["loss_agg"])


def test_a_key_set_to_the_generic_default_is_not_unset():
    """gspo with clip_eps 0.2 written out runs at 0.2 (the upper range keeps gspo's own 4e-4);
    clip_eps_high 0 is the old spelling of 'the same as clip_eps'."""
    assert resolved("gspo", clip_eps=0.2) == (0.2, 4e-4, None, "seq-mean-token-mean")
    assert resolved("dapo", clip_eps_high=0.2)[:2] == (0.2, 0.2)
    assert resolved("grpo", clip_eps=0.1)[:2] == (0.1, 0.1)
    assert resolved("gspo", clip_eps_high=0.0)[:2] == (3e-4, 3e-4)


def test_set_overrides_and_the_resolved_config(tmp_path):
    job_file = tmp_path / "job.yaml"
    job_file.write_text("algorithm: {name: grpo, clip_eps: 0.1}\n")
    job = load_job(job_file, ["algorithm.name=gspo", "algorithm.clip_eps_high=5e-4"])
    assert (job.algorithm.clip_eps, job.algorithm.clip_eps_high) == (0.1, 5e-4)  # both set by the job
    job = load_job(job_file, ["algorithm.name=dapo", "algorithm.clip_eps=null"])  # null: dapo's
    assert (job.algorithm.clip_eps, job.algorithm.clip_eps_high) == (0.2, 0.28)
    # the run dir's config.json holds the values used, and is itself a valid job file
    config = json.loads(json.dumps(to_dict(job)))
    assert config["algorithm"]["clip_eps_high"] == 0.28 and config["algorithm"]["kl_estimator"] is None
    again = job_from_dict(config)
    validate(again)
    assert again.algorithm == job.algorithm


@pytest.mark.parametrize("name", BUILTIN_ALGORITHMS)
def test_every_builtins_resolved_config_validates_and_resolves_to_itself(name):
    job = job_from_dict({"algorithm": {"name": name}})
    validate(job)
    again = job_from_dict(to_dict(job))
    validate(again)
    assert again == job


@pytest.mark.parametrize(("algorithm", "message"), [
    ({"name": "sft", "clip_eps": 0.2}, "algorithm.clip_eps=0.2: sft has no importance ratio to clip"),
    ({"name": "sft", "clip_eps_high": 0.28}, "algorithm.clip_eps_high=0.28: sft has no importance ratio"),
    ({"name": "gspo", "kl_estimator": "k3"}, "algorithm.kl_estimator='k3': gspo has no KL term"),
    ({"name": "dapo", "kl_estimator": "k1"}, "algorithm.kl_estimator='k1': dapo has no KL term"),
    ({"name": "gspo", "loss_agg": "token-mean"}, "gspo always uses seq-mean-token-mean"),
    ({"name": "dr_grpo", "loss_agg": "token-mean"}, "dr_grpo always uses seq-mean-token-sum-norm"),
    ({"name": "sft", "loss_agg": "seq-mean-token-mean"}, "sft always uses token-mean"),
    ({"name": "sft", "kl_coef": 0.1}, "algorithm.kl_coef=0.1: sft's loss has no KL term"),
    ({"name": "sft", "norm_adv_by_std": False}, "algorithm.norm_adv_by_std=False: sft has no advantages"),
    ({"name": "sft", "rollout_correction": "tis"}, "sft trains on the data's answers, which no engine"),
    ({"tis_cap": 3.0}, "algorithm.tis_cap=3.0: applies to algorithm.rollout_correction: tis (this job has"),
    ({"rollout_correction": "tis", "mis_high": 3.0}, "algorithm.mis_high=3.0: applies to algorithm.rollout_"),
    ({"mis_level": "token"}, "algorithm.mis_level='token': applies to algorithm.rollout_correction: mis"),
    ({"loss_agg_norm": 64.0}, "is the constant of loss_agg seq-mean-token-sum-norm, and grpo aggregates"),
])
def test_keys_the_algorithm_does_not_read_are_refused(algorithm, message):
    with pytest.raises(ConfigError, match="algorithm.") as err:
        validate(job_from_dict({"algorithm": algorithm}))
    assert message in str(err.value)


@pytest.mark.parametrize("algorithm", [
    {"name": "grpo", "clip_eps_high": 0.28},            # GRPO's loss clips higher too
    {"name": "rloo", "clip_eps_high": 0.28},
    {"name": "dr_grpo", "clip_eps_high": 0.28, "loss_agg": "seq-mean-token-sum-norm", "loss_agg_norm": 64.0},
    {"name": "ppo", "kl_estimator": "k3", "kl_coef": 0.05},   # the KL in the reward
    {"name": "reinforce_pp", "kl_estimator": "k2", "kl_coef": 0.05},
    {"name": "gspo", "loss_agg": "seq-mean-token-mean", "clip_eps": 0.001},
    {"rollout_correction": "mis", "mis_level": "token", "mis_low": 0.9},
])
def test_keys_the_algorithm_reads_validate(algorithm):
    validate(job_from_dict({"algorithm": algorithm}))
