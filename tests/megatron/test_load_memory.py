"""O(shard) in numbers, and `hpcrl plan`'s trainer memory against what 4 real ranks hold.

On 4 trainer ranks at EP4 with the `small` preset (89% of its bytes are experts), loading the weights
from a HF model directory, drawing the sharded random init and exporting add less than half the full
fp32 model's bytes to each rank's peak RSS, beyond its own Megatron model; so do building PPO's critic
from the directory (beyond the critic's own params and grad buffers) and hashing it. A train step
(after the first, which allocates Adam's state) adds less than twice the rank's own parameter bytes.
Before, every rank held a full copy (start-up) and rank 0 gathered it (export, hash). The same ranks
then load, draw and export a small DeepSeek-V3 (`SMALL_DEEPSEEK`: MLA, a dense first layer, a shared
expert, 16 routed experts, 92% of its bytes) at EP4, under the same half-the-model bound.

In the same launch each rank records the bytes its model holds after a train step (weights, DDP grad
buffers, fp32 main shards, Adam moments, reference model): the small DeepSeek-V3 at EP4 (fp32) and
the tiny-deepseek-v3 preset at TP2-DP2-EP2 in bf16 (distributed optimizer) and TP2-PP2-EP2 (stages of
2 + 1 layers); `hpcrl plan`'s per-rank figures for those jobs (moe.trainer_memory through
hpcrl.models.job_model, as `hpcrl plan` builds them) must equal them, up to the distributed
optimizer's padding, which the plan leaves out and the test bounds from Megatron's padding rule.

Each phase's peak is the kernel's RSS high-water mark, reset at the phase's start (hpcrl.memwatch);
the figures are printed (pytest -s) and recorded in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from mpi_launch import run_mpiexec

WORKER = Path(__file__).with_name("_memory_worker.py")
pytestmark = [pytest.mark.megatron, pytest.mark.mpi, pytest.mark.timeout(900)]
LIMIT = 0.5
MIB = 1 << 20


def small_deepseek() -> dict:
    """tiny-deepseek-v3 widened (H 256, 4 layers: 1 dense + 3 MoE, 16 routed experts of Ie 512 in 4
    groups, 1 shared expert, q_lora 64, kv_lora 64), its MTP layer still in the config. Params: per MoE
    layer experts 16*3*512*256 = 6.29M, shared 0.39M, MLA 0.10M; dense layer 0.49M; embeddings 0.03M:
    20.7M, experts 91%; at EP4 a rank holds 0.09 + 0.91/4 = 0.32 of the model."""
    from hpcrl.models.presets import load_hf_config

    return {**load_hf_config("tiny-deepseek-v3", None), "hidden_size": 256, "intermediate_size": 512,
            "moe_intermediate_size": 512, "num_hidden_layers": 4, "n_routed_experts": 16, "q_lora_rank": 64,
            "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32}


def fp32_bytes(cfg: dict) -> int:
    """The full model's fp32 bytes: every tensor the trainer holds (moe.hf_megatron.hf_shapes)."""
    from moe.hf_megatron import HFModelDims

    return 4 * sum(math.prod(s) for s in HFModelDims.from_hf_config(cfg).hf_shapes().values())


@pytest.fixture(scope="module")
def launch(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from hf_fixtures import model_dir

    from hpcrl.models.presets import load_hf_config

    tmp = tmp_path_factory.mktemp("load-memory")
    source = model_dir(tmp / "small", config=load_hf_config("small-qwen3-moe", None), seed=3, tokenizer=False,
                       max_shard_size="20MB")
    ds_source = model_dir(tmp / "small-ds", config=small_deepseek(), seed=4, tokenizer=False,
                          max_shard_size="20MB")
    result = tmp / "result.json"
    run_mpiexec(4, WORKER, str(source), str(tmp / "export"), str(ds_source), str(tmp / "ds-export"),
                str(result), timeout_s=780)
    return {**json.loads(result.read_text()), "ds_source": ds_source}


def check_rises(name: str, run: dict, full_bytes: int, phases: set[str]) -> None:
    """Every rank's rise in every phase below LIMIT x the full fp32 model (a train step: below twice
    the rank's own parameters); the figures printed."""
    assert set(run["ranks"][0]["rises"]) == phases
    print(f"\n{name}, fp32 model {full_bytes / MIB:.1f} MiB; per-rank peak RSS rise (MiB), "
          f"limit {LIMIT} x model = {LIMIT * full_bytes / MIB:.1f}:")
    for rank, r in enumerate(run["ranks"]):
        own = f"own Megatron params {r['own_param_bytes'] / MIB:.1f}; " if "own_param_bytes" in r else ""
        print(f"  rank {rank}: {own}"
              + ", ".join(f"{k} {v / MIB:.1f} ({v / full_bytes:.2f}x)" for k, v in r["rises"].items()))
    for rank, r in enumerate(run["ranks"]):
        for phase, rise in r["rises"].items():
            if phase == "train_step":
                # On CPU, patch 17 keeps each fp32 parameter's autograd grad until the grad sync (at
                # most one more set of the rank's own 36 MiB): 48-50 MiB with it, 30-35 without
                # (dev/LOG.md, twenty-second session). A gathered model is 3x the own bytes at EP4.
                assert rise < 2 * r["own_param_bytes"], (rank, phase, rise / r["own_param_bytes"])
            else:
                assert rise < LIMIT * full_bytes, (name, rank, phase, rise / full_bytes)


def test_loading_and_exporting_stay_below_half_the_model_per_rank(launch: dict) -> None:
    from hpcrl.models.presets import load_hf_config

    out = launch["qwen"]
    # The weights arrived whole and in place: the trainer's hash is the directory's, and the export
    # of the sharded init hashes to the trainer's hash of it.
    assert out["loaded_sha"] == out["dir_sha"]
    assert out["exported_sha"] == out["drawn_sha"] != out["loaded_sha"]
    assert isinstance(out["critic_sha"], str) and len(out["critic_sha"]) == 64
    phases = {"load_hf_dir", "sharded_init", "export_hf_dir", "critic_from_dir", "critic_sha256",
              "train_step"}
    check_rises("small-qwen3-moe", out, fp32_bytes(load_hf_config("small-qwen3-moe", None)), phases)


def test_deepseek_v3_loads_and_exports_below_half_the_model_per_rank(launch: dict) -> None:
    out = launch["deepseek"]
    assert out["loaded_sha"] == out["dir_sha"]
    assert out["exported_sha"] == out["drawn_sha"] != out["loaded_sha"]
    check_rises("small DeepSeek-V3", out, fp32_bytes(small_deepseek()),
                {"load_hf_dir", "sharded_init", "export_hf_dir"})


def padding_bound(ddp_buffers: list[list[int]]) -> int:
    """Elements Megatron's distributed optimizer may add to a rank's DDP buffers beyond its
    parameters (param_and_grad_buffer.py, 0.16.1): each parameter starts at a multiple of 64 (< 64
    each), each bucket ends at a multiple of lcm(dp, 128) (< that each)."""
    return sum(63 * params + (math.lcm(dp, 128) - 1) * buckets for params, buckets, dp in ddp_buffers)


def planned(job_dict: dict) -> dict:
    """`hpcrl plan`'s per-rank trainer memory of the job, as arrays over ranks."""
    from hpcrl.config import job_from_dict
    from hpcrl.models.job_model import build_layouts, build_spec, trainer_build
    from moe.trainer_memory import trainer_memory

    job = job_from_dict(job_dict)
    spec = build_spec(job)
    trainer, _ = build_layouts(job, spec)
    return trainer_memory(spec, trainer, trainer_build(job))


@pytest.mark.parametrize("case", ["small-ep4", "tp2-dp2-ep2-bf16", "tp2-pp2-ep2"])
def test_plan_of_deepseek_v3_is_what_each_rank_holds(launch: dict, case: str) -> None:
    """Per rank: the plan's params (weights at the param dtype, the expert bias in fp32) and reference
    equal what the rank holds; fp32 grads and Adam moments too (non-distributed optimizer). With the
    distributed optimizer (bf16) the grad buffers lie between the plan and the plan plus the padding
    bound, each rank's main shard and moments within the padding of the plan's even split, and their
    sums over the ranks equal the plan's (each element owned by exactly one rank of its DP group)."""
    distributed = case.endswith("bf16")
    if case == "small-ep4":  # the worker's policy: model.dtype float32, no reference model
        held = [r["held"] for r in launch["deepseek"]["ranks"]]
        job = {"model": {"path": str(launch["ds_source"])}, "trainer": {"num_procs": 4, "ep": 4}}
    else:  # the worker's LAYOUTS, kl_coef > 0
        held = launch["layouts"][case]
        trainer = {"tp2-dp2-ep2-bf16": {"tp": 2, "ep": 2},
                   "tp2-pp2-ep2": {"tp": 2, "pp": 2, "ep": 2, "last_stage_layers": 1}}[case]
        job = {"model": {"preset": "tiny-deepseek-v3", "dtype": "bfloat16" if distributed else "float32"},
               "trainer": {"num_procs": 4, **trainer}, "algorithm": {"kl_coef": 0.05},
               "rollout": {"logprob_tolerance": 1.0, "logprob_mean_tolerance": 0.02}}
    want_reference = case != "small-ep4"
    plan = planned(job)
    for rank, h in enumerate(held):
        pad = 4 * padding_bound(h["ddp_buffers"]) if distributed else 0
        assert h["params"] == plan["params_bytes"][rank], (rank, h["params"], plan["params_bytes"][rank])
        assert h["reference"] == plan["reference_bytes"][rank] and (h["reference"] > 0) == want_reference
        assert 4 * h["grad_elements"] == plan["grads_bytes"][rank], (rank, h["grad_elements"])
        assert plan["grads_bytes"][rank] <= h["grads"] <= plan["grads_bytes"][rank] + pad, (rank, h, pad)
        assert abs(h["main"] - plan["main_params_bytes"][rank]) <= pad, (rank, h["main"], pad)
        assert abs(h["adam"] - plan["adam_state_bytes"][rank]) <= 2 * pad, (rank, h["adam"], pad)
    assert sum(h["main"] for h in held) == pytest.approx(plan["main_params_bytes"].sum(), abs=0.5)
    assert sum(h["adam"] for h in held) == pytest.approx(plan["adam_state_bytes"].sum(), abs=0.5)
    if not distributed:
        assert all(h["main"] == 0 for h in held)
