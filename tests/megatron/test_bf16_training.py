"""bfloat16 training on CPU under real mpiexec (`model.dtype: bfloat16`): bf16 parameters under
Megatron's Float16Module, fp32 main parameters and Adam moments in Megatron's distributed optimizer
sharded over two DP ranks (steered by an lr schedule), the checkpoint that keeps them, and resume under
other layouts.

`hpcrl plan`'s bfloat16 build is what the 2-rank run holds. Three launches of `_bf16_worker.py`: 2
ranks at DP2 train, save and resume in place; 1 rank and 2 ranks at EP2 (experts not data-parallel)
resume that checkpoint and save it again, which must give the same tensors bit for bit. bf16 log-probs
are checked against fp32's on the same weights within bf16's worst-case rounding (BF16_ROUNDINGS),
every token routed to every expert. The same code runs on GPUs (tests/gpu/test_bf16_training.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpi_launch import run_mpiexec
from numerics import U_BF16, logit_bound, logprob_bound, reordered

WORKER = Path(__file__).with_name("_bf16_worker.py")
LAUNCH_TIMEOUT_S = 300  # a hang guard: each launch takes ~10 s alone
pytestmark = [pytest.mark.megatron, pytest.mark.mpi, pytest.mark.timeout(900)]
# bf16 against fp32 on the same (bf16) weights: in Megatron's bf16 forward every op's output is a bf16
# tensor, each rounded by at most U_BF16 = 2^-8 of itself and passed on with gain <= 1 (normalised
# layers), magnitude max|logit|. Per layer at most 24 roundings: input norm, q/k/v, q/k norms, RoPE
# (two products and a sum), scores, softmax, attention.v, o_proj, residual add, pre-MLP norm, router
# probs, fc1, silu, times up, times prob, fc2, the sum over 4 experts (3), residual add; then the final
# norm and lm_head. The worker routes every token to every expert (_bf16_worker.every_expert): no
# top-k choice that rounding could flip.
BF16_ROUNDINGS = 24 * 2 + 2


def fp32_reference(sd: dict[str, torch.Tensor], batch) -> tuple[torch.Tensor, float]:
    """HF transformers' fp32 log-probs of the response tokens on the checkpoint-named (bf16) weights
    `sd`, and how far a bf16 forward's may lie from them."""
    from _bf16_worker import every_expert

    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_checkpoint_to_fused

    cfg = every_expert(load_hf_config("tiny-qwen3-moe", None))
    model = build_hf_model(cfg, 0)
    model.load_state_dict(hf_checkpoint_to_fused({k: v.float() for k, v in sd.items()},
                                                 HFModelDims.from_hf_config(cfg)))
    with torch.no_grad():
        logits_BLV = model(batch.tokens_BL).logits.float()
    logp_BTV = torch.log_softmax(logits_BLV, -1).gather(
        1, batch.logit_positions_BT().unsqueeze(-1).expand(-1, -1, logits_BLV.shape[-1]))
    logp_BT = logp_BTV.gather(2, batch.response_tokens_BT().unsqueeze(-1)).squeeze(-1)
    max_logit = logits_BLV.abs().max().item()
    apart = BF16_ROUNDINGS * U_BF16 * max_logit + logit_bound(cfg, max_logit, batch.seq_len)  # + fp32's
    return torch.where(batch.response_mask_BT(), logp_BT, 0.0), logprob_bound(apart, cfg["vocab_size"])


def launch(ranks: int, ckpt: Path, out: Path, *flags: str) -> dict:
    run_mpiexec(ranks, WORKER, *flags, str(ckpt), str(out), timeout_s=LAUNCH_TIMEOUT_S)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def dp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    root = tmp_path_factory.mktemp("bf16-dp2")
    return launch(2, root / "ckpt", root / "out.pt"), root / "ckpt"


def test_bf16_trains_with_fp32_main_params_and_resumes_bit_identical(dp2: tuple[dict, Path]) -> None:
    from _bf16_worker import SEED, every_expert, spread_weights
    from _policy_worker import make_batch

    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_fused_to_checkpoint

    run, _ = dp2
    assert run["main_ok0"] and run["main_ok2"], "main params must be fp32 and round to the bf16 params"
    batch = make_batch()
    # the bf16 parameters are the seed's fp32 init rounded to bf16, bit for bit
    cfg = every_expert(load_hf_config("tiny-qwen3-moe", None))
    init = hf_fused_to_checkpoint(build_hf_model(cfg, SEED).state_dict(), HFModelDims.from_hf_config(cfg))
    assert list(run["sd0"]) == sorted(init)
    assert all(torch.equal(run["sd0"][k], init[k].to(torch.bfloat16)) for k in init)
    assert all(torch.equal(run["sd_spread"][k], v) for k, v in spread_weights(cfg).items())
    # bf16 log-probs against fp32 ones on the same weights, at init and on larger weights
    for logp, sd in ((run["logp0"], run["sd0"]), (run["logp_spread"], run["sd_spread"])):
        want, bound = fp32_reference(sd, batch)
        diff = (logp - want).abs().max().item()
        assert 0 < diff <= bound, f"bf16 log-probs {diff:.3g} from fp32's > bound {bound:.3g}"
    assert run["sd3"]["lm_head.weight"].dtype == torch.bfloat16
    assert torch.equal(run["ref0"], run["logp0"])  # the reference is the same bf16 model
    assert len({run["sha0"], run["sha2"], run["sha3"]}) == 3  # the steps move the bf16 weights
    assert run["m2"]["kl"] > 0 and run["m1"]["grad_norm"] > 0.5
    # resume in place: the same bf16 params, then the same step bit for bit
    assert run["sha2_loaded"] == run["sha2"]
    assert run["sha3_resumed"] == run["sha3"] and run["m3_resumed"] == run["m3"]
    # the fp32 main params carry the state: rebuilt from the bf16 params, the step differs
    assert run["sha3_main_lost"] != run["sha3"]
    # an lr schedule steers the distributed optimizer: lr 0 (warmup) moves nothing, the peak does
    assert run["lr_at0"] == 0.0 and run["lr_at1"] == 1e-2
    assert run["sha_lr0"] == run["sha_before_lr0"] != run["sha_lr1"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_bf16_checkpoint_resumes_under_another_layout(ranks: int, dp2: tuple[dict, Path], tmp_path: Path) -> None:
    from checkpoints import open_checkpoint

    run, ckpt = dp2
    other = launch(ranks, tmp_path / "ckpt", tmp_path / "out.pt", "--ep", str(ranks), "--resume", str(ckpt))
    assert other["meta"]["adam_step"] == 2.0
    assert other["sha2"] == run["sha2"]
    # resaved from 1 rank (DP1) or EP2 (experts on one DP rank each): every tensor bit for bit
    with open_checkpoint(str(ckpt), 2) as a, open_checkpoint(str(tmp_path / "ckpt"), 2) as b:
        names = sorted(a.tensor_names())
        # the DP2 save: each rank wrote its own rows of every tensor the two hold alike (two shard
        # files), not a copy each; for the joined fp32 main parameters and moments a GPU held every
        # joined tensor until the commit
        for name in names:
            files = {s.file for s in a.manifest.tensors[name].slices}
            assert len(files) == 2, (name, files)
        assert names == sorted(b.tensor_names())
        assert {n.split("/")[0] for n in names} == {"policy", "ref", "main", "adam"}
        assert {a.dtype(n) for n in names if n.startswith("main/")} == {torch.float32}
        assert [n for n in names if not torch.equal(a.read(n), b.read(n))] == []
    # The third step from there. Every layout cuts the same micro-batches of 3 rows, so the on-policy
    # pg_loss (ratio exactly 1) sums the same per-micro-batch terms in another order, and so does the
    # whole loss without EP (1 rank: the same forwards). Under EP2 the experts' bf16 GEMMs take both
    # ranks' tokens (other shapes), and bf16's worst case (BF16_ROUNDINGS) bounds the KL term only about
    # as loosely as the loss's own size; that resume is checked by the checkpoint bits above.
    terms = 1 + 0.05 * run["m3"]["kl"]  # sum|terms|: |advantage| <= 1 (a mean over tokens), kl_coef x KL
    bound = reordered(4, 2, terms)  # four micro-batch terms, summed on each rank, then over the ranks
    assert abs(other["m3"]["pg_loss"] - run["m3"]["pg_loss"]) <= bound
    if ranks == 1:
        assert abs(other["m3"]["loss"] - run["m3"]["loss"]) <= bound


def test_plan_of_the_bf16_build_is_what_the_ranks_hold(dp2: tuple[dict, Path]) -> None:
    """Per rank: bf16 params and reference, fp32 grads, fp32 main params and Adam m, v sharded over
    the 2 DP ranks. Megatron pads the distributed optimizer's buffers (each param to 64 elements, each
    bucket to the DP size): grads and the larger shard are a little above the plan's even split."""
    from hpcrl.config import job_from_dict
    from hpcrl.plan_cmd import plan_job

    held = dp2[0]["held"]  # name -> [sum over the 2 ranks, max]
    job = job_from_dict({"model": {"preset": "tiny-qwen3-moe", "dtype": "bfloat16"}, "trainer": {"num_procs": 2},
                         "algorithm": {"kl_coef": 0.05},
                         "rollout": {"logprob_tolerance": 1.0, "logprob_mean_tolerance": 0.02}})
    t = plan_job(job)["trainer"]
    assert t["build"]["param_dtype"] == "bfloat16" and t["build"]["built_by_run_today"]
    assert held["params"][1] == t["params_bytes_per_gpu"] and held["reference"][1] == t["reference_bytes_per_gpu"]
    assert held["main"][0] == 2 * t["main_params_bytes_per_gpu"]  # each element on exactly one DP rank
    assert held["adam"][0] == 2 * t["adam_state_bytes_per_gpu"]
    for name, planned in (("grads", t["grads_bytes_per_gpu"]), ("main", t["main_params_bytes_per_gpu"]),
                          ("adam", t["adam_state_bytes_per_gpu"])):
        assert planned <= held[name][1] <= 1.01 * planned, (name, held[name], planned)


def test_bf16_and_float32_checkpoints_resume_each_other(dp2: tuple[dict, Path], tmp_path: Path) -> None:
    """A float32 run resumes the bf16 checkpoint from its fp32 main parameters; a bf16 run resumes
    that float32 checkpoint into the very state the first bf16 run saved."""
    from checkpoints import open_checkpoint

    _, ckpt = dp2
    launch(1, tmp_path / "fp32", tmp_path / "fp32.pt", "--dtype", "float32", "--resume", str(ckpt))
    launch(1, tmp_path / "bf16", tmp_path / "bf16.pt", "--resume", str(tmp_path / "fp32"))
    with (open_checkpoint(str(ckpt), 2) as bf16, open_checkpoint(str(tmp_path / "fp32"), 2) as fp32,
          open_checkpoint(str(tmp_path / "bf16"), 2) as again):
        names = sorted(bf16.tensor_names())
        for name in fp32.tensor_names():  # policy/ from main/, moments as they were; no main/
            first = bf16.read(name.replace("policy/", "main/", 1))
            assert fp32.dtype(name) == torch.float32 or name.startswith("ref/"), name
            assert torch.equal(fp32.read(name).to(first.dtype), first), name
        assert sorted(again.tensor_names()) == names
        assert [n for n in names if not torch.equal(bf16.read(n), again.read(n))] == []
