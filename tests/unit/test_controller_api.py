"""The controller API's plug-in points: algorithm modules and policy losses by name or import path,
checked at validation with one message each."""

import sys
import textwrap

import numpy as np
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
    from hpcrl.controller.groups import Rollout

    seen = []

    class Policy:
        def train(self, step, rollout, advantages, ref_logprobs, temperature, **kw):
            seen.append(temperature)
            return SimpleNamespace(metrics={}, logprobs_BT=None)

    job = job_from_dict({"rollout": {"temperature": 0.7}})
    rl = RL(SimpleNamespace(job=job, policy=Policy(), phase=lambda step, name: None,
                            profile_engines=lambda step, start: None))
    rl.begin_step(0)
    demonstrations = Rollout([None], [[4]], [[5, 6]], [], ["stop"])
    rl.update_policy(demonstrations, np.zeros(1, dtype=np.float32), loss="sft")
    rl.update_policy(demonstrations, np.zeros(1, dtype=np.float32), loss="grpo")
    assert seen == [1.0, 0.7]
    sampled = Rollout([None], [[4]], [[5, 6]], [[-0.5, -0.1]], ["stop"])
    with pytest.raises(RuntimeError, match=r"loss='sft'.*rollout.temperature=0.7.*rl.demonstrations\(\)"):
        rl.update_policy(sampled, np.zeros(1, dtype=np.float32), loss="sft")


def _api_rl(job_dict: dict | None = None):
    """An RL whose trainer records the updates it is sent (no ranks), at step 0."""
    from types import SimpleNamespace

    from hpcrl.controller.api import RL

    class Policy:
        policy_step = None
        sent = []

        def train(self, step, rollout, advantages, *args, **kw):
            self.sent.append(advantages.shape)
            return SimpleNamespace(metrics={"loss": 0.5}, logprobs_BT=np.zeros((len(rollout.response_ids), 2)))

    session = SimpleNamespace(job=job_from_dict(job_dict or {}), policy=Policy(), phase=lambda step, name: None,
                              profile_engines=lambda step, start: None,
                              pipeline=SimpleNamespace(collect_started=lambda: None))
    rl = RL(session)
    rl.begin_step(0)
    return rl, session.policy


def _sampled(rows: int = 2):
    from hpcrl.controller.groups import Rollout

    return Rollout([None] * rows, [[4]] * rows, [[5, 6]] + [[5]] * (rows - 1), [[-0.5, -0.1]] + [[-0.2]] * (rows - 1),
                   ["stop"] * rows)


@pytest.mark.parametrize(("call", "message"), [
    (lambda rl: rl.update_policy(_sampled(), np.zeros(3, np.float32)),
     r"rl.update_policy: advantages is ndarray float32 \[3\]; expected a float numpy array of shape \[2\] or "
     r"\[2, 2\] for this rollout of 2 completions"),
    (lambda rl: rl.update_policy(_sampled(), [0.1, 0.2]), r"advantages is list"),
    (lambda rl: rl.update_policy(_sampled(), np.array([0.1, np.nan], np.float32)),
     r"advantages holds NaN or inf at rows \[1\]"),
    (lambda rl: rl.update_policy(_sampled(), np.zeros(2, np.float32), loss="gpro"),
     r"rl.update_policy\(loss='gpro'\): .*"),
    (lambda rl: rl.update_policy(_sampled(), np.zeros(2, np.float32), epochs=0), r"epochs=0\): passes"),
    (lambda rl: rl.update_policy(_sampled(), np.zeros(2, np.float32), mini_batch_size=3),
     r"mini_batch_size=3\): must divide the rollout's 2 completions"),
    (lambda rl: rl.update_policy(_sampled().select([]), np.zeros(0, np.float32)), r"the rollout is empty"),
    (lambda rl: rl.update_policy(_sampled(), np.zeros(2, np.float32), ref_logprobs=np.zeros(2, np.float32)),
     r"ref_logprobs is ndarray float32 \[2\]; expected .* \[2, 2\]"),
    (lambda rl: rl.ref_logprobs(_sampled()), r"rl.ref_logprobs, but the job builds no reference model"),
    (lambda rl: rl.log(step=3), r"rl.log\(step=...\): 'step' is every record's own key"),
    (lambda rl: rl.log(x=np.zeros(3)), r"rl.log\(x=...\): ndarray \(3,\) is not a metric value"),
], ids=["advantages-rows", "advantages-list", "advantages-nan", "loss", "epochs", "mini-batch", "empty",
        "ref-shape", "ref-without-kl", "reserved-key", "array-metric"])
def test_api_calls_that_cannot_be_carried_out_are_named_before_the_trainer_sees_them(call, message):
    """Each was a trainer rank's traceback after the step's generation and rewards (or, for rl.log,
    json.dumps failing after the update): an AlgorithmError naming the call (exit 2)."""
    from hpcrl.controller.api import AlgorithmError

    rl, policy = _api_rl()
    with pytest.raises(AlgorithmError, match=message):
        call(rl)
    assert policy.sent == []


def test_rl_log_takes_numpy_and_torch_numbers_as_python_numbers():
    import torch

    rl, _ = _api_rl()
    rl.log(a=np.float32(0.5), b=torch.tensor(2.0), c=np.array([3]), d="text", e=None)
    record = rl._metrics
    assert record == {"a": 0.5, "b": 2.0, "c": 3, "d": "text", "e": None}
    assert all(type(v) in (float, int, str, type(None)) for v in record.values())


def test_a_second_update_of_the_same_engine_samples_is_named():
    """Its forward ran the once-updated policy, which did not sample them: the sync check failed as if
    the weight sync were broken. A new rl.generate() in between is what makes it right."""
    from hpcrl.controller.api import AlgorithmError

    rl, policy = _api_rl()
    rollout = _sampled()
    rl.update_policy(rollout, np.zeros(2, np.float32))
    with pytest.raises(AlgorithmError, match=r"a second update on engine samples of the policy the first "
                                             r"update changed; several updates of one batch take epochs="):
        rl.update_policy(rollout, np.zeros(2, np.float32))
    assert policy.sent == [(2,)]


def test_an_update_on_samples_an_earlier_step_generated_is_named():
    """A rollout kept from an earlier step (or a part of it, concatenated with this step's) was sampled
    by a policy updated since: the sync check failed as if the weight sync were broken."""
    from hpcrl.controller.api import AlgorithmError
    from hpcrl.controller.groups import Rollout

    rl, policy = _api_rl()
    kept = _sampled()
    kept.steps = [0, 0]  # as rl.generate() stamps them
    rl.begin_step(1)
    fresh = _sampled()
    fresh.steps = [1, 1]
    for rollout in (kept, Rollout.concat([fresh, kept.select([1])])):
        with pytest.raises(AlgorithmError, match=r"rl.update_policy in step 1: the rollout holds completions "
                                                 r"rl.generate\(\) handed out in step\(s\) \[0\]"):
            rl.update_policy(rollout, np.zeros(len(rollout.response_ids), np.float32))
    rl.update_policy(fresh, np.zeros(2, np.float32))
    assert policy.sent == [(2,)]


def test_rl_state_is_what_a_checkpoint_keeps_from_the_step_that_set_it():
    """A resumed run read its state back from JSON (int keys as strings) while an uninterrupted one
    kept Python's; a value JSON cannot hold failed at the save on the trainer, by default the last
    step's (the run ended without a checkpoint)."""
    from hpcrl.controller.api import AlgorithmError
    from hpcrl.controller.checkpointing import Checkpointer

    ckpt = Checkpointer.__new__(Checkpointer)  # only its state: no trainer, no signal handlers
    ckpt.algorithm_state = {"kl_coef": 0.1, "seen": {0: (1, 2)}}
    assert ckpt._state_as_saved() == {"kl_coef": 0.1, "seen": {"0": [1, 2]}}
    assert ckpt.algorithm_state == {"kl_coef": 0.1, "seen": {"0": [1, 2]}}  # the live state too
    ckpt.algorithm_state["ids"] = {1, 2}
    with pytest.raises(AlgorithmError, match=r"rl.state holds a value a checkpoint cannot keep \(.*set.*\)"):
        ckpt._state_as_saved()
