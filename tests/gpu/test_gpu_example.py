"""GPU path: the tiny example on CUDA (Megatron + reference engine on the GPU, NCCL data plane
for the trainer) with `--set resources.device=cuda` (and resources.share_gpus on a one-GPU machine,
where trainer rank and engine share GPU 0), in float32 and in bfloat16 (`model.dtype`: bf16 parameters,
fp32 main parameters in Megatron's distributed optimizer, bf16 engine, the bf16 sync check). Skips
on CPU machines."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_util import DEEPSEEK_EXAMPLE, EXAMPLE, hpcrl, start_run, wait_for_step  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]


BF16 = ["--set", "model.dtype=bfloat16", "--set", "rollout.logprob_tolerance=1.0",
        "--set", "rollout.logprob_mean_tolerance=0.02"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_example_on_cuda(tmp_path, dtype):
    run_dir = tmp_path / "gpu"
    share = torch.cuda.device_count() < 2  # one trainer rank + one engine: a GPU each, else they share
    out, wall = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", "resources.device=cuda",
                      "--set", f"resources.share_gpus={str(share).lower()}",
                      "--set", "logging.progress=false", *(BF16 if dtype == "bfloat16" else []), timeout_s=840)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if dtype == "float32":
        assert all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records)
    else:  # bf16 on both sides: rounding moves single tokens, never the mean
        assert all(r["sync/logprob_mean_abs_diff"] < 0.02 and r["sync/logprob_max_abs_diff"] < 1.0 for r in records)
    rewards = [r["reward/mean"] for r in records]
    assert sum(rewards[-5:]) / 5 >= 0.8
    steps = sorted(r["timing/step_s"] for r in records[5:])
    print(f"cuda {dtype}: median step {steps[len(steps) // 2]:.3f} s, wall {wall:.0f} s")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("what", ["ppo", "tp2"])
def test_critic_and_tensor_parallel_on_cuda(tmp_path, what):
    """Two paths the float32 example does not take, a few steps each: PPO's critic (its value head is
    made after the body moved to the GPU; an fp32 run has no distributed optimizer to move it) and
    trainer.tp 2 (sequence parallel: without apex every norm is a WrappedTorchNorm, which hpcrl's norm
    fix lets run sequence parallel), here in micro-batches by tokens (trainer.max_tokens_per_micro_batch).
    PPO's old log-probs and values run as one micro-batch of all 128 rows (trainer.logprob_micro_batch_size)
    where its updates take two of 64. The sync check holds at fp32's tolerance."""
    run_dir = tmp_path / what
    share = torch.cuda.device_count() < 3  # trainer ranks + one engine: a GPU each, else they share
    sets = {"ppo": ["algorithm.name=ppo", "algorithm.ppo_epochs=2", "algorithm.mini_batch_size=64",
                    "trainer.logprob_micro_batch_size=128"],
            "tp2": ["trainer.num_procs=2", "trainer.tp=2", "trainer.etp=2",
                    "trainer.max_tokens_per_micro_batch=48"]}[what]
    out, _ = hpcrl("run", str(EXAMPLE), "--run-dir", str(run_dir), "--set", "resources.device=cuda",
                   "--set", f"resources.share_gpus={str(share).lower()}", "--set", "algorithm.num_steps=4",
                   "--set", "logging.progress=false", *(x for kv in sets for x in ("--set", kv)), timeout_s=540)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["sync/logprob_max_abs_diff"] < 1e-4 for r in records), records


@pytest.mark.timeout(900)
def test_deepseek_resume_on_cuda_is_bit_identical(tmp_path):
    """trainer.deterministic (the default) on a GPU: the DeepSeek example, top-4 of 8 experts, so
    Megatron's combine sums four expert outputs per token (scatter_add_'s float atomics would sum
    them in any order), run 6 steps uninterrupted and preempted by SIGUSR1 after 3 then resumed with
    every layer's activations recomputed (trainer.recompute_granularity full: the same kernels run
    again): the same rewards and the same final policy hash."""
    import signal

    from launch.result import REQUEUE_EXIT_CODE

    share = torch.cuda.device_count() < 2
    args = ["--set", "resources.device=cuda", "--set", f"resources.share_gpus={str(share).lower()}",
            "--set", "algorithm.num_steps=6", "--set", "logging.progress=false"]
    results = []
    for name in ("whole", "preempted"):
        run_dir = tmp_path / name
        if name == "preempted":
            proc = start_run(run_dir, *args, example=DEEPSEEK_EXAMPLE)
            wait_for_step(proc, run_dir, 3)
            proc.send_signal(signal.SIGUSR1)
            out = proc.communicate(timeout=300)[0]
            assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
        recompute = ["--set", "trainer.recompute_granularity=full"] if name == "preempted" else []
        done, _ = hpcrl("run", str(DEEPSEEK_EXAMPLE), "--run-dir", str(run_dir), *args, *recompute, timeout_s=400)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        final = json.loads((run_dir / "final.json").read_text())["policy_sha256"]
        results.append(([(r["step"], r["reward/mean"]) for r in records], final))
    assert results[0] == results[1]
