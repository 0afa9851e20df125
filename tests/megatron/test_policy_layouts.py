"""MegatronPolicy under real mpiexec in five layouts: same weights -> same log-probs (= HF's), same
GRPO step -> same loss, metrics and exported weights; export -> load -> export is bit-identical;
ranks that share a parameter hold the same bytes after training.

Starting weights: TP1, EP2, TP2-EP2 and PP2 read a HF model directory written by `save_pretrained`
(per-expert safetensors in several files; TP2-EP2 reads transformers' fused expert layout), each
rank reading only its slices; TP2-ETP2 draws transformers' init from the seed. The directories hold
that same seed's weights, so every layout must agree and match `AutoModelForCausalLM.from_pretrained`.
The same launches then run the tiny DeepSeek-V3 (MLA, a dense layer, shared and grouped experts) from
its directory in the same layout (PP2 splits its 3 layers 2 + 1): log-probs equal to transformers',
its export equal to the directory bit for bit, and one train step equal to the 1-rank run's.

Each layout is one `mpiexec` launch of `_policy_worker.py` (init from a seed, log-probs for policy
and reference, three train steps with Adam, KL, an entropy bonus, grad clipping and micro-batching,
weight round trip, a critic); the 1-rank run is the baseline the others must match, within bounds
derived from fp32's rounding (`tol`). Each of these fails the TP2-EP2 layout (dev/LOG.md,
2026-12-04): a swapped expert (load and export both), the wrong TP slice of o_proj, the sequence-
parallel norms' gradients not all-reduced over TP. Both policies also replay (rollout.routing_replay
r3) the routes a reference engine returned for a batch, converted as a run converts them, and every
rank's routers take exactly the engine's top-k for each of their tokens and layers
(`check_engine_replay`); a replay that routes freely instead fails it (132 of the baseline's routes).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from mpi_launch import run_mpiexec
from numerics import hf_routing, reordered

from hpcrl.models.presets import load_hf_config

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
# Tolerances (tests/numerics.py): layouts compute the same sums in other orders (TP's split
# contractions and vocab, EP's token exchange, PP's micro-batches, other GEMM shapes). The tiny model's
# forward is a chain of D reductions -- 7 per layer (q/k/v, q.k, attention.v, o_proj, router, expert
# up, expert down), lm_head, the log-sum-exp -- none longer than N terms: the batch's positions (12
# rows of <= 10, summed by every weight gradient), hidden 64, vocab 64. A train step adds a backward
# chain and another forward one, and its Adam update moves at most 1.25 times any change of the
# gradient (adam_eps = lr in _policy_worker.py). Measured on AVX2 and AVX-512: 1-2 ulps everywhere.
D, N = 16, 128
TINY_QWEN = load_hf_config("tiny-qwen3-moe", None)
D_DS = 32  # tiny-deepseek-v3: 10 reductions per MLA layer (numerics.MLA_LAYER_DEPTH) x 3, lm_head, LSE


def tol(magnitude: float, steps: int = 0, extra: int = 0) -> float:
    """The bound for a quantity of `magnitude` computed after `steps` train steps, through `extra`
    reductions more than the forward (a mean over tokens, a value head)."""
    return reordered(N, (1 + 2 * steps) * D + extra, magnitude)


def check_close(what: str, a: torch.Tensor, b: torch.Tensor, steps: int = 0, extra: int = 0) -> None:
    diff = (a - b).abs().max().item()
    bound = tol(max(a.abs().max().item(), b.abs().max().item()), steps, extra)
    assert diff <= bound, f"{what}: max |difference| {diff:.3g} > bound {bound:.3g}"


def weights_close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int, lr: float = 1e-2,
                  grad_clip: float = 0.5) -> bool:
    """Weights after `steps` Adam steps: each update moves at most 1.25 x its gradient's error, and an
    element of a clipped gradient is at most grad_clip; plus one rounding of w - update per step."""
    bound = sum(1.25 * reordered(N, (1 + 2 * k) * D, grad_clip) for k in range(steps))
    bound += steps * 2.0 ** -23 * max(v.abs().max().item() for v in a.values())
    return max_diff(a, b) <= bound


def metrics_close(got: dict[str, float], want: dict[str, float], steps: int, max_numel: int) -> list:
    """The metrics of step `steps + 1` (means over tokens of functions of log-probs whose slope is at
    most 1 + max|log p| <= 8, entropy's; grad_norm: sums of squares over parameters of up to
    `max_numel` elements) that differ by more than their bound."""
    bad = []
    for key, value in want.items():
        if key == "grad_norm":
            bound = reordered(max_numel, (1 + 2 * steps) * D + 2, abs(value))
        else:
            bound = 8 * tol(max(1.0, abs(value)), steps, extra=1)
        if abs(got[key] - value) > bound:
            bad.append((key, got[key], value, bound))
    return bad


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny preset's weights under the workers' seed as HF model directories, both layouts."""
    from _policy_worker import SEED
    from hf_fixtures import model_dir

    from hpcrl.models.presets import load_hf_config

    from fp8_quantize import quantize_dir

    cfg = load_hf_config("tiny-qwen3-moe", None)
    root = tmp_path_factory.mktemp("hf")
    deepseek = model_dir(root / "deepseek", config=load_hf_config("tiny-deepseek-v3", None), seed=SEED,
                         tokenizer=False, perturb=0.3)
    # blocks of 20 x 24: TP and EP boxes start and end inside blocks (q_b_proj's 48 rows per TP rank)
    plain = {k: v for k, v in load_hf_config("tiny-deepseek-v3", None).items() if k != "rope_scaling"}
    return {"deepseek": deepseek, "deepseek-fp8": quantize_dir(deepseek, root / "deepseek-fp8", block=(20, 24)),
            # seed 13: the batch's routing is clear of near-ties (margin ratio 3.7; SEED's is 1.3)
            "deepseek-plain": model_dir(root / "deepseek-plain", config={**plain, "q_lora_rank": None}, seed=13,
                                        tokenizer=False, perturb=0.3),
            "dir": model_dir(root / "per-expert", config=cfg, seed=SEED, tokenizer=False),
            "fused-dir": model_dir(root / "fused", config=cfg, seed=SEED, tokenizer=False, fused=True)}


def launch(name: str, out: Path, model_dirs: dict[str, Path]) -> dict:
    ranks, flags, weights = LAYOUTS[name]
    if weights != "seed":
        flags = [*flags, "--model-dir", str(model_dirs[weights])]
    flags = [*flags, "--deepseek-dir", str(model_dirs["deepseek"]), "--deepseek-fp8-dir",
             str(model_dirs["deepseek-fp8"]), "--deepseek-plain-dir", str(model_dirs["deepseek-plain"])]
    run_mpiexec(ranks, WORKER, *flags, str(out), timeout_s=LAUNCH_TIMEOUT_S, label=name)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def baseline(tmp_path_factory: pytest.TempPathFactory, model_dirs: dict[str, Path]) -> dict:
    return launch("tp1-ep1", tmp_path_factory.mktemp("tp1-ep1") / "out.pt", model_dirs)


def hf_model(sd: dict[str, torch.Tensor] | None = None) -> torch.nn.Module:
    """HF transformers' Qwen3MoeForCausalLM of the tiny preset: the workers' init weights, or the
    checkpoint-named `sd`."""
    from _policy_worker import SEED

    from hpcrl.models.presets import load_hf_config
    from hpcrl.trainer.model import build_hf_model
    from moe.hf_megatron import HFModelDims, hf_checkpoint_to_fused

    cfg = load_hf_config("tiny-qwen3-moe", None)
    model = build_hf_model(cfg, SEED)
    if sd is not None:
        model.load_state_dict(hf_checkpoint_to_fused(sd, HFModelDims.from_hf_config(cfg)))
    return model


def hf_logprobs(batch, temperature: float, sd: dict[str, torch.Tensor] | None = None,
                model_dir: Path | None = None) -> torch.Tensor:
    """Log-probs of the response tokens from HF transformers' Qwen3MoeForCausalLM (init weights,
    the checkpoint-named `sd`, or `from_pretrained(model_dir)`)."""
    from transformers import AutoModelForCausalLM

    if model_dir is not None:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    else:
        model = hf_model(sd)
    with torch.no_grad():
        logits_BLV = model(batch.tokens_BL).logits.float() / temperature
    logp_BLV = torch.log_softmax(logits_BLV, dim=-1)
    pos_BT = batch.logit_positions_BT()
    logp_BTV = logp_BLV.gather(1, pos_BT.unsqueeze(-1).expand(-1, -1, logp_BLV.shape[-1]))
    logp_BT = logp_BTV.gather(2, batch.response_tokens_BT().unsqueeze(-1)).squeeze(-1)
    return torch.where(batch.response_mask_BT(), logp_BT, 0.0)


def routing_ratio(batch, sd: dict[str, torch.Tensor]) -> float:
    """numerics.hf_routing's margin ratio under the weights `sd`: above 1.5, every layout routes every
    token alike on any host, so the bounds compare the same routing."""
    return hf_routing(hf_model(sd), batch)[1]


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_baseline_matches_hf_and_round_trips(baseline: dict, model_dirs: dict[str, Path]) -> None:
    from hpcrl.trainer.policy import hf_state_dict_sha256

    batch = baseline["batch"]
    for key in ("sd0", "sd1", "sd2"):  # the weights the layouts' log-probs are compared at
        assert routing_ratio(batch, baseline[key]) > 1.5, f"a router near-tie at {key}: pick other rows"
    check_close("logp against HF", baseline["logp"], hf_logprobs(batch, 1.0, model_dir=model_dirs["dir"]))
    assert baseline["logp"].shape == (batch.batch_size, batch.response_width)
    assert baseline["logp"].dtype == torch.float32
    assert baseline["shard_boxes_match"] and baseline["replicas_agree"]
    check_close("logp against HF's init", baseline["logp"], hf_logprobs(batch, 1.0))
    check_close("logp_t07", baseline["logp_t07"], hf_logprobs(batch, 0.7))
    # After a step every weight (norms, router, experts) differs from its init: HF agrees too.
    check_close("logp_sd1", baseline["logp_sd1"], hf_logprobs(batch, 1.0, baseline["sd1"]))
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
    # The training forward's log-probs are the pre-update ones (the same weights through the
    # training forward's micro-batches): the on-policy step needs no separate old-log-prob pass, and
    # its ratio is 1 (nothing clipped).
    check_close("logp_m1", baseline["logp_m1"], baseline["logp"])
    check_close("logp_m3", baseline["logp_m3"], baseline["logp_sd2"])
    assert baseline["m3"]["clip_frac"] == 0.0 and baseline["m3"]["kl"] > 0
    assert max_diff(baseline["sd3"], baseline["sd2"]) > 1e-4
    _check_critic(baseline, baseline["head"])
    check_engine_replay(baseline, "engine", TINY_QWEN)
    check_deepseek(baseline, baseline, model_dirs["deepseek"], model_dirs["deepseek-fp8"])
    check_deepseek_plain(baseline, model_dirs["deepseek-plain"])


def check_deepseek(run: dict, baseline: dict, path: Path, fp8_path: Path) -> None:
    """The DeepSeek-V3 part of a launch: the directory read by slices exports bit for bit and hashes
    as its tensors; log-probs equal transformers' `from_pretrained` (routing clear of near-ties) and the
    1-rank run's; one train step gives the 1-rank run's metrics and weights, within D_DS's bounds. Its
    FP8 copy, each rank dequantizing its own slices, exports the element-wise dequantized weights
    exactly, and its log-probs equal transformers' on those weights."""
    from transformers import AutoModelForCausalLM

    from moe.digest import state_dict_digest
    from moe.hf_checkpoint import HFCheckpoint
    from moe.hf_megatron import HFModelDims
    from numerics import hf_routing

    batch = run["batch"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with HFCheckpoint(path, HFModelDims.from_hf_config(model.config.to_dict())) as ckpt:
        source = {n: ckpt.read(n) for n in ckpt.expected}
    assert list(run["ds_sd0"]) == list(source) and all(torch.equal(run["ds_sd0"][n], source[n]) for n in source)
    assert run["ds_sha0"] == state_dict_digest(source)
    assert hf_routing(model, batch)[1] > 1.5, "a DeepSeek router near-tie: pick other rows"

    def close(what: str, a: torch.Tensor, b: torch.Tensor, steps: int = 0) -> None:
        diff, mag = (a - b).abs().max().item(), max(a.abs().max().item(), b.abs().max().item())
        assert diff <= reordered(N, (1 + 2 * steps) * D_DS, mag), (what, diff)

    close("deepseek logp against HF", run["ds_logp"], hf_logprobs(batch, 1.0, model_dir=path))
    close("deepseek logp against 1 rank", run["ds_logp"], baseline["ds_logp"])
    for key, value in baseline["ds_m1"].items():
        bound = reordered(max(v.numel() for v in source.values()), D_DS + 2, abs(value)) if key == "grad_norm" \
            else 8 * reordered(N, D_DS + 1, max(1.0, abs(value)))
        assert abs(run["ds_m1"][key] - value) <= bound, (key, run["ds_m1"][key], value)
    bound = 1.25 * reordered(N, D_DS, 0.5) + 2.0 ** -23 * max(v.abs().max().item() for v in source.values())
    assert max_diff(run["ds_sd1"], baseline["ds_sd1"]) <= bound
    assert max_diff(run["ds_sd1"], run["ds_sd0"]) > 1e-3  # the step moved the weights

    check_engine_replay(run, "ds_engine", model.config.to_dict())
    # r2's record of the routes every rank took, put together on every rank: the 1-rank run's
    # (the same weights route every token alike: hf_routing's margin check above)
    assert torch.equal(run["ds_recorded"], baseline["ds_recorded"])
    assert run["ds_recorded"].shape[:2] == batch.tokens_BL.shape

    from fp8_quantize import dequantized_state_dict
    from moe.hf_megatron import hf_checkpoint_to_fused

    dequantized = dequantized_state_dict(fp8_path)
    assert list(run["ds_fp8_sd"]) == list(source)
    assert all(torch.equal(run["ds_fp8_sd"][n], dequantized[n].float()) for n in source)
    assert max_diff(run["ds_fp8_sd"], source) > 0  # FP8 rounding moved the weights: not the bf16 dir again
    model.load_state_dict(hf_checkpoint_to_fused(dequantized, HFModelDims.from_hf_config(model.config.to_dict())))
    assert hf_routing(model, batch)[1] > 1.5, "a router near-tie under the FP8 weights: pick other rows"
    with torch.no_grad():
        logits_BLV = model(batch.tokens_BL).logits.float()
    logp_BLV = torch.log_softmax(logits_BLV, dim=-1)
    pos_BT = batch.logit_positions_BT()
    want = logp_BLV.gather(1, pos_BT.unsqueeze(-1).expand(-1, -1, logp_BLV.shape[-1])).gather(
        2, batch.response_tokens_BT().unsqueeze(-1)).squeeze(-1)
    close("deepseek FP8 logp against HF", run["ds_fp8_logp"], torch.where(batch.response_mask_BT(), want, 0.0))


def check_deepseek_plain(run: dict, path: Path) -> None:
    """DeepSeek-V3 without q_lora and YaRN (V2-Lite's q_proj, plain RoPE) in this layout: read by slices,
    exported bit for bit, log-probs equal to transformers' within D_DS's bound."""
    from transformers import AutoModelForCausalLM

    from moe.hf_checkpoint import HFCheckpoint
    from moe.hf_megatron import HFModelDims
    from numerics import hf_routing

    batch = run["batch"]
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    assert model.config.q_lora_rank is None
    with HFCheckpoint(path, HFModelDims.from_hf_config(model.config.to_dict())) as ckpt:
        assert all(torch.equal(run["dsp_sd0"][n], ckpt.read(n)) for n in ckpt.expected)
    assert hf_routing(model, batch)[1] > 1.5, "a router near-tie: pick other rows"
    want = hf_logprobs(batch, 1.0, model_dir=path)
    diff, mag = (run["dsp_logp"] - want).abs().max().item(), want.abs().max().item()
    assert diff <= reordered(N, D_DS, mag), diff


def replay_misses(replayed: list, routes_BLNK: torch.Tensor, top_k: int) -> int:
    """How many (row, position, MoE layer) routes of `replayed` (every rank's routers' maps: its pipeline
    stage's MoE layers, its TP rank's sequence chunk, its DP rank's micro-batches) differ as sets from
    the batch's `routes_BLNK` [B, S, N, K] (padded as the policy pads it, filler routes included);
    AssertionError when, put back together, some (row, position, layer) was never routed."""
    from hpcrl.trainer.batch import TrainBatch
    from hpcrl.trainer.routing_replay import agreement

    tp, dp = 1 + max(t for _, t, _, _ in replayed), 1 + max(r for r, _, _, _ in replayed)
    B, S = routes_BLNK.shape[:2]
    L = -(-S // tp) * tp
    n_mb = len(replayed[0][3])
    mb = replayed[0][3][0].shape[0] // (L // tp)
    tokens = torch.zeros(B, S, dtype=torch.int64)
    given = TrainBatch(tokens, torch.ones(B, dtype=torch.int64), torch.zeros(B, dtype=torch.int64),
                       routes_BLNK).padded(dp * n_mb * mb, L).routes_BLNK
    seen = torch.zeros(given.shape[:3], dtype=torch.int64)
    misses = 0
    for dp_rank, tp_rank, j, maps in replayed:
        for m, map_TE in enumerate(maps):
            b0, s0 = (dp_rank * n_mb + m) * mb, tp_rank * (L // tp)
            want_TK = given[b0: b0 + mb, s0: s0 + L // tp, j].transpose(0, 1).reshape(-1, top_k)
            every = torch.ones(want_TK.shape[0], dtype=torch.bool)
            same, total = agreement(map_TE, want_TK, every)
            misses += total - same
            seen[b0: b0 + mb, s0: s0 + L // tp, j] += 1
    # each position once per TP replica group; DP ranks hold other rows, EP ranks of a DP rank the same
    assert torch.equal(seen.clamp(max=1), torch.ones_like(seen)), "some (row, position, layer) was never routed"
    return misses


def check_engine_replay(run: dict, prefix: str, cfg: dict) -> None:
    """rollout.routing_replay r3 under this layout with a reference engine's routes (_policy_worker.
    engine_replay): the batch carries, for every token the engine fed forward, exactly the top-k the
    engine returned for each MoE layer (after the server's encoding and the controller's RouteFormat);
    every rank's routers took exactly those sets for each of its tokens and layers (filler routes on
    padding too); the trainer's routers by themselves route some of those (token, layer) pairs
    elsewhere, so a replay that did not take the engine's routes would fail; and the same check fails
    when two tokens' routes are swapped."""
    from moe.hf_megatron import HFModelDims

    d = HFModelDims.from_hf_config(cfg)
    batch, raw, own = run[f"{prefix}_batch"], run[f"{prefix}_raw"], run[f"{prefix}_own"]
    routes = batch.routes_BLNK
    lengths = (batch.prompt_lens_B + batch.response_lens_B).tolist()
    assert routes is not None and len(raw) == batch.batch_size
    for b, (n, engine_TLK) in enumerate(zip(lengths, raw, strict=True)):
        assert engine_TLK.dtype == torch.int32 and engine_TLK.shape == (n - 1, d.num_layers, d.top_k)
        dense = [i for i in range(d.num_layers) if i not in d.moe_layers]
        assert (engine_TLK[:, dense] == 0).all()
        assert torch.equal(routes[b, : n - 1].long().sort(-1).values,
                           engine_TLK[:, list(d.moe_layers)].long().sort(-1).values), b
    real_BS = torch.arange(batch.seq_len)[None] < torch.tensor(lengths)[:, None] - 1  # tokens fed forward
    differ_BSN = (own.long().sort(-1).values != routes.long().sort(-1).values).any(-1) & real_BS[..., None]
    assert differ_BSN.any(), "the engine's routes equal the trainer's own: the check could not fail"
    misses = replay_misses(run[f"{prefix}_replayed"], routes, d.top_k)
    assert misses == 0, f"{prefix}: {misses} (row, position, MoE layer) routes were not the engine's"
    b, s, j = differ_BSN.nonzero()[0].tolist()  # a real token whose engine routes are not the trainer's
    other = next(t for t in range(lengths[b] - 1)
                 if not torch.equal(routes[b, t, j].sort().values, routes[b, s, j].sort().values))
    swapped = routes.clone()
    swapped[b, [s, other]] = swapped[b, [other, s]]
    assert replay_misses(run[f"{prefix}_replayed"], swapped, d.top_k) > 0, \
        "a swap of two tokens' routes went unseen"


def check_variants(run: dict, numel: int, tp: int) -> None:
    """Under PP2 and under TP2 (sequence parallel), with r3 (_policy_worker.variant_steps): full recompute
    and the MoE layers' recompute run the same step as no recompute on the engine's routes, bit for bit
    (the same ops on the same inputs), every training route the engine's; a recompute that replayed the
    latest micro-batch's routes instead of its own fails it (PP2; the tiny DeepSeek-V3 too, 2 + 1 layers). Micro-batches by tokens (several
    lengths, each a multiple of tp) run the same step up to the order of the sums, without the
    load-balancing loss (a function of each micro-batch's tokens): the log-probs and metrics within the
    bounds of one step."""
    for prefix in ("variant", "ds_variant") if "ds_variant_none" in run else ("variant",):
        step, sha = run[f"{prefix}_none"]
        assert step["router_agreement"] == 1.0
        for name in ("full", "moe"):
            got, got_sha = run[f"{prefix}_{name}"]
            assert torch.equal(got.pop("logprobs_BT"), step["logprobs_BT"]), (prefix, name)
            assert got == {k: v for k, v in step.items() if k != "logprobs_BT"}, (prefix, name)
            assert got_sha == sha, (prefix, name)
    (tokens, _), (plain, _) = run["variant_tokens"], run["variant_none_no_aux"]
    lengths = run["variant_lengths"]
    assert len(set(lengths)) > 1 and all(n % tp == 0 for n in lengths), lengths
    check_close("logp, split by tokens", tokens.pop("logprobs_BT"), plain.pop("logprobs_BT"))
    assert tokens["router_agreement"] == 1.0
    assert not (bad := metrics_close(tokens, plain, 0, numel)), bad


def hf_final_hidden(batch, sd: dict[str, torch.Tensor]) -> torch.Tensor:
    """HF transformers' last hidden states (after the final norm) of `sd`'s model, [B, L, H]."""
    with torch.no_grad():
        return hf_model(sd)(batch.tokens_BL, output_hidden_states=True).hidden_states[-1].float()


def _check_critic(run: dict, head: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The critic of `run`: V_t is the value head on the final hidden state at the position that
    predicts response token t (HF agrees, on the run's own policy weights sd3 and `head`), 0 on
    padding; its clipped value loss trains it and leaves the policy alone."""
    batch, mask = run["batch"], run["batch"].response_mask_BT()
    w, b = head
    hidden = hf_final_hidden(batch, run["sd3"])
    pos = batch.logit_positions_BT()
    at_pos = hidden.gather(1, pos.unsqueeze(-1).expand(-1, -1, hidden.shape[-1]))
    expected = torch.where(mask, at_pos @ w + b, 0.0)
    check_close("v0", run["v0"], expected, extra=1)  # the head's H-long sum
    assert (run["v0"][~mask] == 0).all() and run["v0"][mask].abs().max() > 0
    cm1, cm2 = run["cm1"], run["cm2"]
    assert set(cm1) == {"vf_loss", "vf_clip_frac", "values_mean", "grad_norm"}
    assert cm1["vf_clip_frac"] == 0.0 and cm2["vf_clip_frac"] > 0  # the first step starts at V_old
    assert cm2["vf_loss"] < cm1["vf_loss"] and (run["v1"] - run["v0"]).abs().max() > 1e-3
    assert max_diff(run["policy_after_critic"], run["sd3"]) == 0.0


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
        check_close("logp against HF", run["logp"], hf)
    assert run["shard_boxes_match"], "moe.layouts.TrainerLayout disagrees with Megatron's shards (shard sync)"
    assert run["replicas_agree"], "ranks sharing a parameter hold different values after training"
    assert max_diff(run["sd0"], baseline["sd0"]) == 0.0
    # Forwards on the same weights: the step-0 log-probs, and the later ones against HF on the run's
    # own weights (the weights are compared with the baseline's below).
    check_close("logp", run["logp"], baseline["logp"])
    check_close("logp_t07", run["logp_t07"], baseline["logp_t07"])
    check_close("logp_sd1", run["logp_sd1"], hf_logprobs(run["batch"], 1.0, run["sd1"]))
    check_close("logp_m3", run["logp_m3"], hf_logprobs(run["batch"], 1.0, run["sd2"]))
    assert torch.equal(run["ref"], run["logp"])
    numel = max(v.numel() for v in baseline["sd0"].values())
    for steps, key in enumerate(("m1", "m2", "m3")):
        assert set(run[key]) == set(baseline[key])
        assert not (bad := metrics_close(run[key], baseline[key], steps, numel)), (key, bad)
    for steps, key in ((1, "sd1"), (2, "sd2"), (3, "sd3")):
        assert weights_close(run[key], baseline[key], steps), (key, max_diff(run[key], baseline[key]))
    from hpcrl.trainer.policy import hf_state_dict_sha256

    assert run["sha_reloaded"] == hf_state_dict_sha256(run["sd1"])
    # The critic under this layout hashes its shards as its full tensors hash, and computes and
    # learns what the 1-rank critic does. (Its head lives on the last stage: rank 0 reports it only
    # without PP, so the expected hash uses the baseline's head, the same draw from the seed.)
    assert run["critic_sha0"] == critic_hash({**run, "head": baseline["head"]})
    _check_critic(run, baseline["head"])
    for steps, key in ((4, "v1"), (5, "v2")):  # the policy's 3 steps, then the critic's
        check_close(key, run[key], baseline[key], steps, extra=1)
    for steps, key in ((3, "cm1"), (4, "cm2")):
        assert not (bad := metrics_close(run[key], baseline[key], steps, numel)), (key, bad)
    check_engine_replay(run, "engine", TINY_QWEN)
    if "pp2" in name or "tp2" in name:
        check_variants(run, numel, tp=2 if "tp2" in name else 1)
        # trainer.logprob_micro_batch_size: one forward micro-batch (the stages exchange its shape) where
        # training runs several; the same log-probs up to the order of the sums
        assert run["whole_micro_batches"][0] == 1 < run["whole_micro_batches"][1], run["whole_micro_batches"]
        check_close("logp, one forward micro-batch", run["logp_whole"], run["logp"])
    check_deepseek(run, baseline, model_dirs["deepseek"], model_dirs["deepseek-fp8"])
    check_deepseek_plain(run, model_dirs["deepseek-plain"])
