"""The controller API's plug-in points: algorithm modules and policy losses by name or import path,
checked at validation with one message each."""

import sys
import textwrap

import pytest

from hpcrl.config.errors import ConfigError
from hpcrl.config.load import job_from_dict
from hpcrl.config.validate import ALGORITHMS, validate
from hpcrl.controller.api import BUILTIN_ALGORITHMS, load_algorithm


def test_validation_lists_the_builtins_the_api_has():
    assert ALGORITHMS == BUILTIN_ALGORITHMS
    for name in BUILTIN_ALGORITHMS:
        assert callable(load_algorithm(name).step)


@pytest.fixture
def user_modules(tmp_path, monkeypatch):
    (tmp_path / "algo_ok.py").write_text("def step(rl, step):\n    pass\n")
    (tmp_path / "algo_nostep.py").write_text("STEP = 1\n")
    (tmp_path / "algo_onearg.py").write_text("def step(rl):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in ("algo_ok", "algo_nostep", "algo_onearg"):
        sys.modules.pop(name, None)


@pytest.mark.parametrize("name, message", [
    ("grpoo", "neither a built-in algorithm (grpo, dr_grpo, rloo, reinforce_pp, gspo, dapo, ppo, sft)"),
    ("no_such_pkg.algo", "cannot import module 'no_such_pkg.algo'"),
    ("algo_nostep", "module 'algo_nostep' has no function `step`"),
    ("algo_onearg", "module 'algo_onearg': `step(rl)` cannot be called as step(rl, step)"),
    ("algo_ok:step", "nor the import path of a module (package.module)"),
])
def test_bad_algorithm_names_are_refused_at_validation(user_modules, name, message):
    with pytest.raises(ConfigError, match="algorithm.name=") as err:
        validate(job_from_dict({"algorithm": {"name": name}}))
    assert message in str(err.value)


def test_a_user_algorithm_module_validates(user_modules):
    validate(job_from_dict({"algorithm": {"name": "algo_ok"}}))


def test_keys_an_algorithm_ignores_are_refused():
    with pytest.raises(ConfigError, match="algorithm.kl_coef=0.1: gspo's loss has no KL term"):
        validate(job_from_dict({"algorithm": {"name": "gspo", "kl_coef": 0.1}}))
    with pytest.raises(ConfigError, match="algorithm.norm_adv_by_std=False: rloo computes its own"):
        validate(job_from_dict({"algorithm": {"name": "rloo", "norm_adv_by_std": False}}))


def test_losses_resolve_by_name_or_path(tmp_path, monkeypatch):
    from hpcrl.algorithms.losses import BUILTIN_LOSSES, resolve_loss

    assert resolve_loss("grpo").metrics == ("pg_loss", "kl", "clip_frac")
    assert set(BUILTIN_LOSSES) == {"grpo", "dr_grpo", "gspo", "ppo", "sft"}
    (tmp_path / "loss_mod.py").write_text(textwrap.dedent('''
        from hpcrl.algorithms.losses import policy_loss

        @policy_loss(metrics=("a",))
        def mine(b, cfg):
            return b.logp_BT.sum(), {"a": b.logp_BT.sum()}
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    loss = resolve_loss("loss_mod:mine")
    assert loss.name == "loss_mod:mine" and loss.metrics == ("a",)
    for spec, message in (("nope", "neither a built-in loss"), ("loss_mod:other", "has no function 'other'"),
                          ("missing_mod:f", "cannot import module 'missing_mod'")):
        with pytest.raises(ValueError, match=message):
            resolve_loss(spec)
    sys.modules.pop("loss_mod", None)


def test_mini_batches_must_split_the_batch_over_data_parallel_ranks():
    job = {"data": {"num_prompts_per_step": 4}, "algorithm": {"group_size": 4, "mini_batch_size": 6}}
    with pytest.raises(ConfigError, match=r"algorithm.mini_batch_size=6: must divide the batch of 16"):
        validate(job_from_dict(job))
    job["algorithm"]["mini_batch_size"] = 4
    job["trainer"] = {"num_procs": 8, "ep": 1}
    with pytest.raises(ConfigError, match="multiple of the data-parallel size 8"):
        validate(job_from_dict(job))
    job["trainer"] = {"num_procs": 2}
    validate(job_from_dict(job))


def test_sfts_mini_batches_split_its_demonstrations():
    """sft's batch is one demonstration per prompt (4 here), not prompts x group_size (16): a
    mini_batch_size of 8 was accepted and then trained the 4 rows in one step without a word."""
    job = {"data": {"num_prompts_per_step": 4}, "algorithm": {"name": "sft", "group_size": 4,
                                                              "mini_batch_size": 8}}
    with pytest.raises(ConfigError, match=r"algorithm.mini_batch_size=8: must divide the batch of 4 "
                                          r"demonstrations \(data.num_prompts_per_step\)"):
        validate(job_from_dict(job))
    job["algorithm"]["mini_batch_size"] = 2
    validate(job_from_dict(job))
    # and its demonstrations split over the data-parallel ranks (3 x group_size 4 would)
    job = {"data": {"num_prompts_per_step": 3}, "algorithm": {"name": "sft", "group_size": 4},
           "trainer": {"num_procs": 2}}
    with pytest.raises(ConfigError, match=r"data.num_prompts_per_step=3: a step's 3 demonstrations \(sft\) do "
                                          r"not split evenly over the dp=2"):
        validate(job_from_dict(job))


def test_dapo_keys_apply_to_dapo_only():
    with pytest.raises(ConfigError, match=r"algorithm.overlong_buffer_len=2: applies to algorithm.name: dapo only"):
        validate(job_from_dict({"algorithm": {"overlong_buffer_len": 2}}))
    with pytest.raises(ConfigError, match=r"algorithm.kl_coef=0.1: dapo's loss has no KL term"):
        validate(job_from_dict({"algorithm": {"name": "dapo", "kl_coef": 0.1}}))
    with pytest.raises(ConfigError, match=r"overlong_buffer_len=9: must be at most rollout.max_new_tokens=8"):
        validate(job_from_dict({"algorithm": {"name": "dapo", "overlong_buffer_len": 9}}))
    validate(job_from_dict({"algorithm": {"name": "dapo", "overlong_buffer_len": 2}}))


def test_sft_targets_are_the_answers_then_a_stop_token():
    from hpcrl.tasks.tokenizer import CharTokenizer

    tok = CharTokenizer()
    assert tok.encode_completion("abc") == tok.encode("abc", add_bos=False)
    assert tok.encode_completion("abc")[0] != tok.bos_id


def test_the_sft_loss_is_the_nll_at_temperature_one():
    """rollout.temperature scales the logits of sampled tokens; an answer's NLL is the model's own
    (temperature 1): at 0.7 the fit would come out flatter by that factor. On completions the engines
    sampled at 0.7 the sync check could not compare the two: refused, naming the way out."""
    from types import SimpleNamespace

    import numpy as np

    from hpcrl.controller.api import RL

    seen = []

    class Policy:
        def train(self, step, rollout, advantages, ref_logprobs, temperature, **kw):
            seen.append(temperature)
            return SimpleNamespace(metrics={}, logprobs_BT=None)

    job = job_from_dict({"rollout": {"temperature": 0.7}})
    rl = RL(SimpleNamespace(job=job, policy=Policy(), phase=lambda step, name: None))
    rl.begin_step(0)
    demonstrations = SimpleNamespace(engine_logprobs=None, response_ids=[[5, 6]])
    rl.update_policy(demonstrations, np.zeros(1, dtype=np.float32), loss="sft")
    rl.update_policy(demonstrations, np.zeros(1, dtype=np.float32), loss="grpo")
    assert seen == [1.0, 0.7]
    sampled = SimpleNamespace(engine_logprobs=[[-0.5, -0.1]], response_ids=[[5, 6]])
    with pytest.raises(RuntimeError, match=r"loss='sft'.*rollout.temperature=0.7.*rl.demonstrations\(\)"):
        rl.update_policy(sampled, np.zeros(1, dtype=np.float32), loss="sft")
