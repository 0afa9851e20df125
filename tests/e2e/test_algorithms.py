"""Algorithms on the controller API, end to end: every built-in learns the copy task a little within
30 steps, and an out-of-tree algorithm (its own advantages; its own loss) changes the update."""

import json
import signal
import textwrap

import numpy as np
import pytest

from e2e_util import EXAMPLE, hpcrl, start_run, wait_for_step

pytestmark = pytest.mark.e2e
EXIT_REQUEUE = 3

SETTINGS = {"dr_grpo": ["--set", "algorithm.entropy_coef=0.03"],
            "rloo": ["--set", "algorithm.entropy_coef=0.02"],
            "reinforce_pp": ["--set", "algorithm.kl_coef=0.01", "--set", "data.num_prompts_per_step=64"],
            "gspo": []}  # its own clip range, the paper's 3e-4 / 4e-4 (hpcrl/dataflows/gspo.py DEFAULTS)

OWN_ADVANTAGES = textwrap.dedent('''
    """Plain REINFORCE advantages (reward minus a fixed 0.5 baseline, no groups) with GRPO's loss."""
    import numpy as np


    def step(rl, step):
        rollout = rl.generate()
        rewards = rl.score(rollout)
        rl.update_policy(rollout, (rewards - 0.5).astype(np.float32), loss="grpo")
        rl.log(**{"my/baseline": 0.5})
        rl.sync_weights()
''')

OWN_LOSS = textwrap.dedent('''
    """GRPO's advantages with a loss of its own: learn from the better-than-average completions only,
    -max(A, 0) * log pi over the global token count (at ratio 1 GRPO's gradient is -A * grad log pi,
    so this one differs wherever an advantage is negative)."""
    import torch

    from hpcrl.algorithms.advantages import group_advantages
    from hpcrl.algorithms.losses import policy_loss


    @policy_loss(metrics=("pg_loss", "mean_logp"))
    def reinforce(b, cfg):
        masked = b.mask_BT.to(b.logp_BT.dtype)
        pg = -(b.advantages_BT().clamp(min=0) * b.logp_BT * masked).sum() / b.num_tokens
        mean_logp = (b.logp_BT.detach() * masked).sum() / b.num_tokens
        return pg, {"pg_loss": pg.detach(), "mean_logp": mean_logp}


    def step(rl, step):
        rollout = rl.generate()
        rewards = rl.score(rollout)
        advantages = group_advantages(torch.from_numpy(rewards), rl.algo.group_size)
        rl.update_policy(rollout, advantages.numpy(), loss="my_loss_algo:reinforce")
        rl.sync_weights()
''')


def records_of(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(tmp_path, name: str, *settings: str, steps: int = 3, env_extra: dict | None = None):
    run_dir = tmp_path / name.replace(".", "_")
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", f"algorithm.name={name}",
                   "--set", f"algorithm.num_steps={steps}", "--set", "logging.progress=false", *settings,
                   timeout_s=280, env_extra=env_extra)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return records_of(run_dir), json.loads((run_dir / "final.json").read_text())["policy_sha256"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(SETTINGS))
def test_builtin_learns_in_30_steps(tmp_path, name):
    records, _ = run(tmp_path, name, *SETTINGS[name], steps=30)
    rewards = np.array([r["reward/mean"] for r in records])
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records)
    first5, last5 = rewards[:5].mean(), rewards[-5:].mean()
    assert last5 >= 3 * first5, (name, first5, last5, rewards.round(2).tolist())
    if name == "gspo":  # the run dir's resolved config shows the clip range it ran with
        algo = json.loads((tmp_path / name / "config.json").read_text())["algorithm"]
        assert (algo["clip_eps"], algo["clip_eps_high"]) == (3e-4, 4e-4)


@pytest.mark.timeout(600)
def test_dapo_learns_the_copy_example(tmp_path):
    """DAPO with its own clip range (0.2 / 0.28, unset here) to the example's bar in its 80 steps
    (reward/mean: the kept groups' mean)."""
    records, _ = run(tmp_path, "dapo", steps=80)
    algo = json.loads((tmp_path / "dapo" / "config.json").read_text())["algorithm"]
    assert (algo["clip_eps"], algo["clip_eps_high"]) == (0.2, 0.28)
    rewards = np.array([r["reward/mean"] for r in records])
    assert rewards[-5:].mean() >= 0.8, rewards.round(2).tolist()


@pytest.mark.timeout(600)
def test_out_of_tree_advantages_and_loss_each_change_the_update(tmp_path):
    (tmp_path / "my_adv_algo.py").write_text(OWN_ADVANTAGES)
    (tmp_path / "my_loss_algo.py").write_text(OWN_LOSS)
    env = {"PYTHONPATH": str(tmp_path)}
    base_records, base = run(tmp_path, "grpo")
    adv_records, own_adv = run(tmp_path, "my_adv_algo", env_extra=env)
    loss_records, own_loss = run(tmp_path, "my_loss_algo", env_extra=env)
    # The same prompts and, at step 0, the same weights and samples: the rewards agree there; the
    # updates differ, so the final policies differ from GRPO's and from each other.
    assert base_records[0]["reward/mean"] == adv_records[0]["reward/mean"] == loss_records[0]["reward/mean"]
    assert len({base, own_adv, own_loss}) == 3
    assert adv_records[0]["my/baseline"] == 0.5
    assert all("train/mean_logp" in r and r["train/mean_logp"] < 0 for r in loss_records)
    assert all("train/kl" not in r for r in loss_records)  # its metrics are its own
    # At ratio 1 the loss is the token mean of -A. Step 0's rewards are about 0.02 (random weights),
    # so the fixed baseline gives every completion A ~ -0.5 and pg_loss ~ 0.48, while GRPO's
    # group-normalised advantages sum to 0 in every group: the own advantages reached the loss.
    assert adv_records[0]["train/pg_loss"] > 0.3, adv_records[0]
    assert abs(base_records[0]["train/pg_loss"]) < 0.2, base_records[0]


NAN_LOSS = textwrap.dedent('''
    import torch

    from hpcrl.algorithms.advantages import group_advantages


    def nan_loss(b, cfg):
        return b.logp_BT.sum() * float("nan"), {}


    def step(rl, step):
        rollout = rl.generate()
        rewards = rl.score(rollout)
        advantages = group_advantages(torch.from_numpy(rewards), rl.algo.group_size)
        rl.update_policy(rollout, advantages.numpy(), loss="my_nan_algo:nan_loss")
        rl.sync_weights()
''')


@pytest.mark.timeout(300)
def test_a_nan_loss_stops_the_run_naming_algorithm_and_step(tmp_path):
    (tmp_path / "my_nan_algo.py").write_text(NAN_LOSS)
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(tmp_path / "run"), "--set", "algorithm.name=my_nan_algo",
                   "--set", "algorithm.num_steps=2", "--set", "logging.progress=false", timeout_s=280,
                   env_extra={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 1
    assert "algorithm 'my_nan_algo', step 0: loss 'my_nan_algo:nan_loss' is nan" in out.stderr, out.stderr[-3000:]


def preempt_then_resume(run_dir, args: list[str], at_step: int) -> None:
    """`hpcrl run` with `args` into `run_dir`, SIGUSR1 once `at_step` steps are done (it must save and
    exit for requeue), then the same command again, which must resume and finish."""
    proc = start_run(run_dir, *args)
    wait_for_step(proc, run_dir, at_step)
    proc.send_signal(signal.SIGUSR1)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == EXIT_REQUEUE and "preempted" in log, log[-3000:]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), *args, timeout_s=400)
    assert out.returncode == 0 and "resumed from checkpoint step" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]


@pytest.mark.timeout(600)
def test_dapo_fills_its_batch_and_resumes_bit_identically_after_sigusr1(tmp_path):
    """Dynamic sampling draws extra prompt blocks (the checkpointed prompt cursor moves on), and the
    same run preempted by SIGUSR1 after step 2 and resumed replays the same prompts, samples and
    updates."""
    args = ["--set", "algorithm.name=dapo", "--set", "algorithm.num_steps=8",
            "--set", "algorithm.overlong_buffer_len=2", "--set", "checkpoint.interval_steps=10",
            "--set", "logging.progress=false"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(whole), *args, timeout_s=280)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first = records_of(whole)
    assert first[0]["dynamic_sampling/rounds"] > 1 and first[0]["dynamic_sampling/groups_dropped"] > 0, first[0]
    assert all(r["dynamic_sampling/groups_kept"] == 16 for r in first)
    # the step's metrics cover every round: all the completions generated (they were the last round's)
    for r in first:
        completions = r["rollout/tokens"] / r["rollout/response_len"]
        assert round(completions) == r["dynamic_sampling/groups_generated"] * 8, r  # group_size 8
    preempt_then_resume(cut, args, at_step=2)
    keys = ("reward/mean", "train/loss", "dynamic_sampling/rounds", "rollout/tokens")
    assert [[r[k] for k in keys] for r in records_of(cut)] == [[r[k] for k in keys] for r in first]
    assert (json.loads((cut / "final.json").read_text())["policy_sha256"]
            == json.loads((whole / "final.json").read_text())["policy_sha256"])


@pytest.mark.timeout(600)
def test_sft_then_grpo_from_its_export_is_a_two_command_pipeline(tmp_path):
    """sft on the copy task's answers (no generation), `hpcrl export`, then grpo with model.path = the
    export: the RL run starts far above random init's ~0.03 reward."""
    records, _ = run(tmp_path, "sft", steps=30)
    nll = [r["train/nll"] for r in records]
    assert nll[-1] < 0.5 * nll[0] and "sync/logprob_max_abs_diff" not in records[0], nll
    exported = tmp_path / "sft_hf"
    out, _ = hpcrl("export", str(tmp_path / "sft"), "--out", str(exported), timeout_s=120)
    assert out.returncode == 0, out.stderr[-2000:]
    rl_records, _ = run(tmp_path, "grpo", "--set", f"model.path={exported}", steps=1)
    assert rl_records[0]["reward/mean"] >= 0.5, rl_records[0]


PPO = ["--set", "algorithm.name=ppo", "--set", "algorithm.ppo_epochs=2", "--set", "algorithm.mini_batch_size=64",
       "--set", "algorithm.kl_coef=0.02", "--set", "algorithm.kl_target=20", "--set", "critic.value_clip=0",
       "--set", "algorithm.lr_schedule=linear"]


@pytest.mark.timeout(900)
def test_ppo_learns_the_copy_example_and_resumes_bit_identically_after_sigusr1(tmp_path):
    """PPO with the Megatron critic to the example's bar in its 80 steps (lr decaying linearly); the
    critic's explained variance rises; the adaptive KL coefficient moves. The same run preempted by
    SIGUSR1 at step 40 (checkpoint, exit for requeue) and resumed ends with the same policy and critic
    hashes and the same per-step rewards, critic losses, KL coefficients and learning rates (its state
    restored, the schedule continued)."""
    args = [*PPO, "--set", "checkpoint.interval_steps=50", "--set", "logging.progress=false"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(whole), *args, timeout_s=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    first = records_of(whole)
    rewards = np.array([r["reward/mean"] for r in first])
    assert rewards[-5:].mean() >= 0.8, rewards.round(2).tolist()
    ev = np.array([r["critic/explained_variance"] for r in first])
    assert ev[-20:].mean() > ev[:20].mean() + 0.3, ev.round(2).tolist()
    assert first[-1]["train/kl_coef"] != first[0]["train/kl_coef"] == 0.02
    assert [r["train/lr"] for r in first] == pytest.approx([3e-3 * (1 - s / 80) for s in range(80)])
    assert [r["critic/lr"] for r in first] == [r["train/lr"] for r in first]
    assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in first)

    preempt_then_resume(cut, args, at_step=40)
    keys = ("reward/mean", "train/loss", "critic/vf_loss", "critic/values_mean", "train/kl_coef", "train/lr")
    assert [[r[k] for k in keys] for r in records_of(cut)] == [[r[k] for k in keys] for r in first]
    final, resumed = (json.loads((d / "final.json").read_text()) for d in (whole, cut))
    assert resumed["policy_sha256"] == final["policy_sha256"]
    assert resumed["critic_sha256"] == final["critic_sha256"] and len(final["critic_sha256"]) == 64


SIGNAL_AFTER_CRITIC = textwrap.dedent('''
    import os
    import signal

    from hpcrl.dataflows import ppo

    DEFAULTS = ppo.DEFAULTS


    def step(rl, step):
        """ppo; at step PREEMPT_AT_STEP, a preemption signal right after the critic's update."""
        if os.environ.get("PREEMPT_AT_STEP") == str(step):
            update_critic = rl.update_critic

            def then_signal(*args, **kwargs):
                out = update_critic(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGTERM)  # what the launcher forwards a USR1 as
                return out

            rl.update_critic = then_signal
        ppo.step(rl, step)
''')


@pytest.mark.timeout(600)
def test_a_step_whose_critic_was_updated_is_not_abandoned(tmp_path):
    """ppo updates its critic before its policy. A preemption signal between the two, with too little
    grace left to finish (HPCRL_SIGNAL_DELAY_S), abandoned the step at the policy update and saved the
    previous step with this step's critic: the resumed run updated it twice (other critic hash, step
    1's critic metrics apart, an audit's run). Once an update is sent, the step is finished and saved."""
    (tmp_path / "ppo_signalled.py").write_text(SIGNAL_AFTER_CRITIC)
    # critic.warmup_steps=1: step 0 trains only the critic and pushes nothing (step 1 failed on that:
    # the engines' policy counted as a version behind)
    args = ["--set", "algorithm.name=ppo_signalled", "--set", "critic.enabled=true", "--set",
            "critic.warmup_steps=1", "--set", "algorithm.num_steps=3", "--set", "checkpoint.interval_steps=0",
            "--set", "logging.progress=false"]
    env = {"PYTHONPATH": str(tmp_path), "HPCRL_SIGNAL_DELAY_S": "0.5"}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(whole), *args, timeout_s=280, env_extra=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(cut), *args, timeout_s=280,
                   env_extra={**env, "PREEMPT_AT_STEP": "1"})
    assert out.returncode == EXIT_REQUEUE and "checkpoint of step 1 saved" in out.stderr, out.stderr[-3000:]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(cut), *args, timeout_s=280, env_extra=env)
    assert out.returncode == 0 and "resumed from checkpoint step 1" in out.stdout, out.stdout[-3000:]
    keys = ("reward/mean", "critic/vf_loss", "critic/explained_variance", "train/loss")
    assert [[r.get(k) for k in keys] for r in records_of(cut)] == [[r.get(k) for k in keys] for r in records_of(whole)]
    final, resumed = (json.loads((d / "final.json").read_text()) for d in (whole, cut))
    assert resumed["critic_sha256"] == final["critic_sha256"]
    assert resumed["policy_sha256"] == final["policy_sha256"]
    assert "train/loss" not in records_of(whole)[0] and "train/loss" in records_of(whole)[1]  # the warmup


ENGINE_DIES_WITH_THE_SIGNAL = textwrap.dedent('''
    import json
    import os
    import signal
    import time

    from hpcrl.dataflows import grpo

    DEFAULTS = grpo.DEFAULTS


    def step(rl, step):
        """grpo; after step ENGINE_DIES_AT_STEP's weight sync, preemption as Slurm delivers it to a whole
        job step: the controller gets the signal and the engine server is killed (the evaluation that
        follows fails on it)."""
        grpo.step(rl, step)
        if os.environ.get("ENGINE_DIES_AT_STEP") == str(step):
            engine = json.loads((rl._s.run_dir / "logs" / "engine0.json").read_text())["pid"]
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(engine, signal.SIGKILL)
            time.sleep(1)
''')


@pytest.mark.timeout(600)
def test_a_failed_worker_after_an_update_saves_no_step_under_an_older_label(tmp_path):
    """A preemption that also killed a worker after step 1's update (here: its evaluation's engine):
    the trainers hold step 1's weights, and saving them as step 0 (the last completed step) made the
    resumed run train step 1 twice (its sync check failed on every token, an audit's run). Nothing is
    saved then; the resumed run starts over and ends as the uninterrupted one."""
    (tmp_path / "grpo_engine_dies.py").write_text(ENGINE_DIES_WITH_THE_SIGNAL)
    (tmp_path / "val.jsonl").write_text("".join(json.dumps({"prompt": c, "answer": c * 4}) + "\n" for c in "abcd"))
    args = ["--set", "algorithm.name=grpo_engine_dies", "--set", "algorithm.num_steps=3", "--set",
            "checkpoint.interval_steps=0", "--set", f"data.val_path={tmp_path / 'val.jsonl'}", "--set",
            "eval.interval_steps=1", "--set", "eval.num_samples=1", "--set", "eval.temperature=1.0",
            "--set", "logging.progress=false"]
    env = {"PYTHONPATH": str(tmp_path)}
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(whole), *args, timeout_s=280, env_extra=env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(cut), *args, timeout_s=280,
                   env_extra={**env, "ENGINE_DIES_AT_STEP": "1"})
    assert out.returncode == EXIT_REQUEUE, out.stdout[-3000:] + out.stderr[-3000:]
    assert "the trainers no longer hold step 0's state, so nothing is saved" in out.stderr, out.stderr[-3000:]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(cut), *args, timeout_s=280, env_extra=env)
    assert out.returncode == 0 and "resumed from" not in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    final, resumed = (json.loads((d / "final.json").read_text()) for d in (whole, cut))
    assert resumed["policy_sha256"] == final["policy_sha256"]


@pytest.mark.timeout(300)
def test_an_algorithm_that_misuses_the_api_stops_with_exit_2_naming_the_call(tmp_path):
    """A user algorithm whose step logs under a record's own key (after step 0 is checkpointed): the
    run stops with exit 2, the algorithm, the step and the call named, no traceback, the checkpoint
    kept (an API misuse was a controller failure with a traceback, or a trainer rank's)."""
    (tmp_path / "logs_step.py").write_text(textwrap.dedent('''
        from hpcrl.dataflows import grpo

        DEFAULTS = grpo.DEFAULTS


        def step(rl, step):
            grpo.step(rl, step)
            if step == 1:
                rl.log(step=step)
    '''))
    args = ["--set", "algorithm.name=logs_step", "--set", "algorithm.num_steps=3", "--set",
            "checkpoint.interval_steps=1", "--set", "logging.progress=false"]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(tmp_path / "run"), *args, timeout_s=280,
                   env_extra={"PYTHONPATH": str(tmp_path)})
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert ("hpcrl run stopped: algorithm.name='logs_step', in step 1: rl.log(step=...): 'step' is every "
            "record's own key") in out.stderr, out.stderr[-3000:]
    assert "the latest checkpoint (step 0) is kept" in out.stderr and "Traceback" not in out.stderr
