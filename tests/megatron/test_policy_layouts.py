"""MegatronPolicy under real mpiexec in five layouts: same weights -> same log-probs (= HF's), same
GRPO step -> same loss, metrics and exported weights; export -> load -> export is bit-identical.

Starting weights: TP1, EP2, TP2-EP2 and PP2 read a HF model directory written by `save_pretrained`
(per-expert safetensors in several files; TP2-EP2 reads transformers' fused expert layout), each
rank reading only its slices; TP2-ETP2 draws transformers' init from the seed. The directories hold that same seed's weights, so every layout must agree and
match `AutoModelForCausalLM.from_pretrained(dir)`.

Each layout is one `mpiexec` launch of `_policy_worker.py` (init from a seed, log-probs for policy
and reference, two train steps with Adam, KL, an entropy bonus, grad clipping and micro-batching, weight round
trip); the 1-rank run is the baseline the others must match.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpi_launch import run_mpiexec

WORKER = Path(__file__).with_name("_policy_worker.py")
LAUNCH_TIMEOUT_S = 420  # a hang guard, generous: 4 ranks on 2 shared cores import for ~40 s
pytestmark = [pytest.mark.megatron, pytest.mark.mpi, pytest.mark.timeout(900)]

# name -> (ranks, worker flags, weights: "dir" | "fused-dir" | "seed")
LAYOUTS = {
    "tp1-ep1": (1, [], "dir"),
    "tp1-ep2-allgather": (2, ["--ep", "2", "--dispatcher", "allgather"], "dir"),
    "tp2-ep2-etp1-alltoall": (4, ["--tp", "2", "--ep", "2", "--etp", "1", "--dispatcher", "alltoall"],
                              "fused-dir"),
    "tp1-ep2-pp2": (4, ["--ep", "2", "--pp", "2"], "dir"),
    # experts split over ETP (fc1 = [gate_r; up_r]); the alltoall dispatcher cannot do ETP on gloo
    "tp2-etp2-allgather": (2, ["--tp", "2", "--etp", "2", "--dispatcher", "allgather"], "seed"),
}
LOGP_TOL = 1e-5
VALUE_TOL = 5e-5  # values are H-long dot products of the final hidden state: more fp32 reordering under TP/EP
WEIGHT_TOL = 2e-5


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny preset's weights under the workers' seed as HF model directories, both layouts."""
    from _policy_worker import SEED
    from hf_fixtures import model_dir

    from hpcrl.models.presets import load_hf_config

    cfg = load_hf_config("tiny-qwen3-moe", None)
    root = tmp_path_factory.mktemp("hf")
    return {"dir": model_dir(root / "per-expert", config=cfg, seed=SEED, tokenizer=False),
            "fused-dir": model_dir(root / "fused", config=cfg, seed=SEED, tokenizer=False, fused=True)}


def launch(name: str, out: Path, model_dirs: dict[str, Path]) -> dict:
    ranks, flags, weights = LAYOUTS[name]
    if weights != "seed":
        flags = [*flags, "--model-dir", str(model_dirs[weights])]
    run_mpiexec(ranks, WORKER, *flags, str(out), timeout_s=LAUNCH_TIMEOUT_S, label=name)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> dict:
    return launch("tp1-ep1", tmp_path_factory.mktemp("tp1-ep1") / "out.pt", model_dirs)


def hf_logprobs(batch, temperature: float, sd: dict[str, torch.Tensor] | None = None,
                model_dir: Path | None = None) -> torch.Tensor:
    """Log-probs of the response tokens from HF transformers' Qwen3MoeForCausalLM (init weights,
    the checkpoint-named `sd`, or `from_pretrained(model_dir)`)."""
    from _policy_worker import SEED
    from transformers import AutoModelForCausalLM

    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_checkpoint_to_fused

    cfg = load_hf_config("tiny-qwen3-moe", None)
    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    else:
        model = build_hf_model(cfg, SEED)
    if sd is not None:
        model.load_state_dict(hf_checkpoint_to_fused(sd, HFModelDims.from_hf_config(cfg)))
    with torch.no_grad():
        logits_BLV = model(batch.tokens_BL).logits.float() / temperature
    logp_BLV = torch.log_softmax(logits_BLV, dim=-1)
    pos_BT = batch.logit_positions_BT()
    logp_BTV = logp_BLV.gather(1, pos_BT.unsqueeze(-1).expand(-1, -1, logp_BLV.shape[-1]))
    logp_BT = logp_BTV.gather(2, batch.response_tokens_BT().unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask_BT(), logp_BT, 0.0)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_baseline_matches_hf_and_round_trips(baseline: dict, model_dirs: dict[str, Path]) -> None:
    from hpcrl.trainer.policy import hf_state_dict_sha256

    batch = baseline["batch"]
    assert (baseline["logp"] - hf_logprobs(batch, 1.0, model_dir=model_dirs["dir"])).abs().max() < LOGP_TOL
    assert baseline["logp"].shape == (batch.batch_size, batch.response_width)
    assert baseline["logp"].dtype == torch.float32
    assert baseline["shard_boxes_match"]
    assert (baseline["logp"] - hf_logprobs(batch, 1.0)).abs().max() < LOGP_TOL
    assert (baseline["logp_t07"] - hf_logprobs(batch, 0.7)).abs().max() < LOGP_TOL
    # After a step every weight (norms, router, experts) differs from its init: HF agrees too.
    assert (baseline["logp_sd1"] - hf_logprobs(batch, 1.0, baseline["sd1"])).abs().max() < LOGP_TOL
    assert (baseline["logp_sd1"] - baseline["logp"]).abs().max() > 1e-3
    assert (baseline["logp"][~batch.response_mask_BT()] == 0).all()
    assert (baseline["logp"][batch.response_mask_BT()] < 0).all()
    assert torch.equal(baseline["ref"], baseline["logp"])  # the reference starts as the policy
    assert baseline["sha_reloaded"] == hf_state_dict_sha256(baseline["sd1"])
    assert baseline["sha0"] == hf_state_dict_sha256(baseline["sd0"])
    # The step moved the weights, the second step saw KL to the reference and clipped ratios.
    assert max_diff(baseline["sd1"], baseline["sd0"]) > 1e-3
    m1, m2 = baseline["m1"], baseline["m2"]
    assert set(m1) == {"loss", "pg_loss", "kl", "entropy", "clip_frac", "grad_norm", "aux_loss"}
    assert m1["kl"] == 0.0 and m2["kl"] > 0 and m2["clip_frac"] > 0
    assert m1["grad_norm"] > 0.5  # > grad_clip, so clipping was active
    assert 0.5 < m1["aux_loss"] < 4 and 0 < m1["entropy"] < 4.2  # log(64) = 4.16
    # The training forward's log-probs are the pre-update ones: the on-policy step needs no
    # separate old-log-prob pass, and its ratio is 1 (nothing clipped).
    assert (baseline["logp_m1"] - baseline["logp"]).abs().max() < 1e-6
    assert (baseline["logp_m3"] - baseline["logp_sd2"]).abs().max() < 1e-6
    assert baseline["m3"]["clip_frac"] == 0.0 and baseline["m3"]["kl"] > 0
    assert max_diff(baseline["sd3"], baseline["sd2"]) > 1e-4
    _check_critic(baseline)


def hf_final_hidden(batch, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF transformers' last hidden states (after the final norm) of `sd`'s model, [B, L, H]."""
    from _policy_worker import SEED

    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_checkpoint_to_fused

    cfg = load_hf_config("tiny-qwen3-moe", None)
    model = build_hf_model(cfg, SEED)
    model.load_state_dict(hf_checkpoint_to_fused(sd, HFModelDims.from_hf_config(cfg)))
    with torch.no_grad():
        return model(batch.tokens_BL, output_hidden_states=True).hidden_states[-1].float()


def _check_critic(run: dict) -> None:
    """The critic of the 1-rank run: V_t is the value head on the final hidden state at the position
    that predicts response token t (HF agrees), 0 on padding; its clipped value loss trains it and
    leaves the policy alone."""
    batch, mask = run["batch"], run["batch"].response_mask_BT()
    w, b = run["head"]
    hidden = hf_final_hidden(batch, run["sd3"])
    pos = batch.logit_positions_BT()
    expected = torch.where(mask, (hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1])) @ w) + b, 0.0)
    assert (run["v0"] - expected).abs().max() < LOGP_TOL
    assert (run["v0"][~mask] == 0).all() and run["v0"][mask].abs().max() > 0
    cm1, cm2 = run["cm1"], run["cm2"]
    assert set(cm1) == {"vf_loss", "vf_clip_frac", "values_mean", "grad_norm"}
    assert cm1["vf_clip_frac"] == 0.0 and cm2["vf_clip_frac"] > 0  # the first step starts at V_old
    assert cm2["vf_loss"] < cm1["vf_loss"] and (run["v1"] - run["v0"]).abs().max() > 1e-3
    assert max_diff(run["policy_after_critic"], run["sd3"]) == 0.0
    assert run["critic_sha0"] == critic_hash(run)


def critic_hash(run: dict) -> str:
    """The critic's hash from its full tensors: the policy's (sd3) without lm_head, plus the head."""
    from moe.digest import state_dict_digest

    w, b = run["head"]
    body = {k: v for k, v in run["sd3"].items() if k != "lm_head.weight"}
    return state_dict_digest({**body, "value_head.weight": w, "value_head.bias": b})


@pytest.mark.parametrize("name", [n for n in LAYOUTS if n != "tp1-ep1"])
def test_layout_matches_baseline(name: str, baseline: dict, tmp_path: Path, model_dirs: dict[str, Path]) -> None:
    run = launch(name, tmp_path / "out.pt", model_dirs)
    assert run["sha0"] == baseline["sha0"], "weights from the seed or the HF dir must be layout-independent"
    if LAYOUTS[name][2] != "seed":  # each rank read its slices of the directory: HF's own loader agrees
        hf = hf_logprobs(run["batch"], 1.0, model_dir=model_dirs[LAYOUTS[name][2]])
        assert (run["logp"] - hf).abs().max() < LOGP_TOL
    assert run["shard_boxes_match"], "moe.layouts.TrainerLayout disagrees with Megatron's shards (shard sync)"
    assert max_diff(run["sd0"], baseline["sd0"]) == 0.0
    assert (run["logp"] - baseline["logp"]).abs().max() < LOGP_TOL
    assert (run["logp_t07"] - baseline["logp_t07"]).abs().max() < LOGP_TOL
    # What the rollout engine checks after a weight sync: HF on the exported weights agrees.
    assert (run["logp_sd1"] - hf_logprobs(run["batch"], 1.0, run["sd1"])).abs().max() < LOGP_TOL
    assert torch.equal(run["ref"], run["logp"])
    assert (run["logp_m3"] - baseline["logp_m3"]).abs().max() < LOGP_TOL
    for step in ("m1", "m2", "m3"):
        assert set(run[step]) == set(baseline[step])
        for key, value in baseline[step].items():
            got = run[step][key]
            assert abs(got - value) < 1e-5 * max(1.0, abs(value)), (step, key, got, value)
    assert max_diff(run["sd1"], baseline["sd1"]) < WEIGHT_TOL
    assert max_diff(run["sd2"], baseline["sd2"]) < WEIGHT_TOL
    assert max_diff(run["sd3"], baseline["sd3"]) < WEIGHT_TOL
    from hpcrl.trainer.policy import hf_state_dict_sha256

    assert run["sha_reloaded"] == hf_state_dict_sha256(run["sd1"])
    # The critic under this layout hashes its shards as its full tensors hash, and computes and
    # learns what the 1-rank critic does. (Its head lives on the last stage: rank 0 reports it only
    # without PP, so the expected hash uses the baseline's head, the same draw from the seed.)
    assert run["critic_sha0"] == critic_hash({**run, "head": baseline["head"]})
    for key in ("v0", "v1", "v2"):
        assert (run[key] - baseline[key]).abs().max() < VALUE_TOL, key
    for step in ("cm1", "cm2"):
        for key, value in baseline[step].items():
            assert abs(run[step][key] - value) < 1e-5 * max(1.0, abs(value)), (step, key, run[step][key], value)
