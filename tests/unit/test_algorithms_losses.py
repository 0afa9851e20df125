"""Per-token losses and aggregation on hand-computed cases: PPO/DAPO clip, dual clip, GSPO, value clip."""

import dataclasses
import math

import pytest
import torch

from hpcrl.algorithms import (GRPOLossConfig, adaptive_kl_coef, aggregate, entropy_from_logits, kl_estimate,
                              explained_variance, grpo_loss, gspo_loss, nll_loss, ppo_clip_loss,
                              sequence_log_ratio, value_loss)

V = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]])
M = torch.tensor([[1, 1, 0], [1, 0, 0]])
HAND = {"token-mean": 7 / 3, "seq-mean-token-mean": (1.5 + 4.0) / 2, "seq-mean-token-sum": (3 + 4) / 2,
        "seq-mean-token-sum-norm": (3 + 4) / (2 * 4)}


@pytest.mark.parametrize("mode", sorted(HAND))
def test_each_aggregation_mode_and_micro_batches_with_global_counts_add_up(mode):
    assert aggregate(V, M, mode, loss_agg_norm=4).item() == pytest.approx(HAND[mode])
    # micro-batches of different padded widths, each with the global counts (3 tokens, 2 sequences)
    first = aggregate(V[:1], M[:1], mode, num_tokens=3, num_seqs=2, loss_agg_norm=4)
    second = aggregate(V[1:, :1], M[1:, :1], mode, num_tokens=3, num_seqs=2, loss_agg_norm=4)
    assert first.item() + second.item() == pytest.approx(HAND[mode])


def test_sum_norm_needs_a_constant():
    with pytest.raises(ValueError, match="loss_agg_norm"):
        aggregate(V, M, "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="loss_agg_norm"):
        GRPOLossConfig(loss_agg="seq-mean-token-sum-norm")


def test_grpo_loss_with_dr_grpo_aggregation():
    cfg = GRPOLossConfig(loss_agg="seq-mean-token-sum-norm", loss_agg_norm=8)
    logp = torch.zeros(2, 3)
    loss, _ = grpo_loss(logp, logp, None, torch.tensor([1.0, -2.0]), M, cfg)
    # ratio 1: -(2 tokens * 1 + 1 token * -2) / (2 sequences * 8)
    assert loss.item() == pytest.approx(0.0)
    loss, _ = grpo_loss(logp, logp, None, torch.tensor([1.0, 1.0]), M, cfg)
    assert loss.item() == pytest.approx(-3 / 16)


def _ppo(ratios, advs, **kw):
    logp = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    loss, metrics = ppo_clip_loss(logp, torch.zeros(1, len(ratios)), torch.tensor([advs]), **kw)
    loss.sum().backward()
    return loss.detach()[0].tolist(), logp.grad[0].tolist(), {k: v[0].tolist() for k, v in metrics.items()}


def test_dapo_asymmetric_clip():
    # ratio 1.25, A=+1: inside 1 + 0.28, so unclipped with gradient -ratio*A (PPO's 0.2 would clip it)
    # ratio 1.5, A=+1: clipped at 1.28; ratio 0.7, A=-1: clipped at 0.8; ratio 0.7, A=+1: not clipped
    loss, grad, m = _ppo([1.25, 1.5, 0.7, 0.7], [1.0, 1.0, -1.0, 1.0], clip_eps_low=0.2, clip_eps_high=0.28)
    assert loss == pytest.approx([-1.25, -1.28, 0.8, -0.7])
    assert grad == pytest.approx([-1.25, 0.0, 0.0, -0.7])
    assert m["clip_frac"] == [0.0, 1.0, 1.0, 0.0]
    assert m["clip_frac_high"] == [0.0, 1.0, 0.0, 0.0] and m["clip_frac_low"] == [0.0, 0.0, 1.0, 0.0]
    loss, grad, _ = _ppo([1.25], [1.0], clip_eps_low=0.2)  # symmetric PPO clips the first token
    assert loss == pytest.approx([-1.2]) and grad == [0.0]


def test_dual_clip_bounds_negative_advantage_tokens_with_exploded_ratios():
    loss, grad, _ = _ppo([5.0], [-1.0], clip_eps_low=0.2)
    assert loss == pytest.approx([5.0]) and grad == pytest.approx([5.0])
    loss, grad, m = _ppo([5.0, 5.0, 2.0], [-1.0, 1.0, -1.0], clip_eps_low=0.2, clip_ratio_c=3.0)
    # A<0: min(max(5, 1.2), 3) = 3, no gradient; A>0 is untouched (clipped at 1.2); ratio 2 < c: loss 2
    assert loss == pytest.approx([3.0, -1.2, 2.0]) and grad == pytest.approx([0.0, 0.0, 2.0])
    assert m["dual_clip_frac"] == [1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="clip_ratio_c"):
        _ppo([1.0], [1.0], clip_ratio_c=0.5)


def test_one_dimensional_advantages_are_refused_not_broadcast_along_t():
    logp = torch.zeros(2, 2)
    with pytest.raises(ValueError, match=r"adv_B\[:, None\]"):
        ppo_clip_loss(logp, logp, torch.ones(2))
    with pytest.raises(ValueError, match=r"adv_B\[:, None\]"):
        gspo_loss(logp, logp, torch.ones(2), torch.ones(2, 2))


def test_gspo_sequence_ratio_and_sequence_clip():
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.1, 0.3, 5.0], [0.05, -0.01, 0.02]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    # s_0 = exp((0.1 + 0.3) / 2) = exp(0.2) (padding ignored); s_1 = exp(0.06 / 3) = exp(0.02)
    assert sequence_log_ratio(logp, old, mask).tolist() == pytest.approx([0.2, 0.02])
    adv = torch.tensor([[1.0], [-1.0]])
    loss_BT, m = gspo_loss(logp, old, adv, mask, clip_eps_low=0.1, clip_eps_high=0.15)
    loss = aggregate(loss_BT, mask, "seq-mean-token-mean")
    # s_0 = 1.2214 > 1.15 with A > 0: clipped to -1.15; s_1 = 1.0202 in range with A < 0: +1.0202
    assert loss.item() == pytest.approx((-1.15 + math.exp(0.02)) / 2, abs=1e-6)
    loss.backward()
    # seq 0 clipped: no gradient; seq 1: d/dlogp_t of (1/2)(1/3)(-A) s_1 = s_1 / 6 on each token
    assert logp.grad[0].tolist() == [0.0, 0.0, 0.0]
    assert logp.grad[1].tolist() == pytest.approx([math.exp(0.02) / 6] * 3, abs=1e-6)
    assert m["clip_frac"][:, 0].tolist() == [1.0, 0.0]


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
    torch.manual_seed(0)
    old = -torch.rand(4, 5)
    logp = (old + 0.05 * torch.randn(4, 5)).requires_grad_(True)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 1, 0]])
    adv = torch.tensor([1.0, -0.5, 2.0, -1.0])
    loss_BT, _ = gspo_loss(logp, old, adv.unsqueeze(1), mask, clip_eps_low=0.01, clip_eps_high=0.02)
    aggregate(loss_BT, mask, "seq-mean-token-mean").backward()
    token_grad = logp.grad.clone()
    # the paper's eq. 5 written directly: -(1/G) sum_i min(s_i A_i, clip(s_i) A_i), s_i through autograd
    logp.grad = None
    s = torch.exp(((logp - old) * mask).sum(1) / mask.sum(1))
    (-torch.minimum(s * adv, s.clamp(0.99, 1.02) * adv).mean()).backward()
    assert torch.allclose(token_grad * mask, logp.grad * mask, atol=1e-7)


def test_value_clipping_takes_the_pessimistic_branch():
    old = torch.full((1, 4), 0.5)
    values = torch.tensor([[0.9, 0.6, 0.1, 1.2]], requires_grad=True)
    returns = torch.ones(1, 4)
    loss, m = value_loss(values, old, returns, clip_eps_value=0.2)
    # V=0.9: clipped 0.7 -> max(0.01, 0.09); V=0.6 in range; V=0.1: clipped 0.3 -> max(0.81, 0.49);
    # V=1.2: clipped 0.7 -> max(0.04, 0.09)
    assert loss[0].tolist() == pytest.approx([0.045, 0.08, 0.405, 0.045])
    loss.sum().backward()
    assert values.grad[0].tolist() == pytest.approx([0.0, -0.4, -0.9, 0.0])
    assert m["vf_clip_frac"][0].tolist() == [1.0, 0.0, 0.0, 1.0]
    plain, _ = value_loss(values, old, returns, clip_eps_value=None)
    assert plain[0].tolist() == pytest.approx([0.005, 0.08, 0.405, 0.02])


def test_explained_variance():
    r = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert explained_variance(r, r, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(r, 2.0), r, mask).item() == pytest.approx(0.0)
    # residual (0, 0, 1.5): var 0.75 against var(R) = 1
    assert explained_variance(torch.tensor([[1.0, 2.0, 1.5, 0.0]]), r, mask).item() == pytest.approx(0.25)


def test_adaptive_kl_coefficient():
    # KL three times the target: error clipped to +0.2; 100 samples over a horizon of 1000
    assert adaptive_kl_coef(0.1, 0.3, 0.1, 1000, 100) == pytest.approx(0.102)
    assert adaptive_kl_coef(0.1, 0.09, 0.1, 1000, 100) == pytest.approx(0.1 * (1 - 0.1 * 0.1))


def test_sft_nll_and_entropy():
    assert nll_loss(torch.tensor([[math.log(0.5)]])).item() == pytest.approx(math.log(2.0))
    ent = entropy_from_logits(torch.tensor([[[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]]]))
    assert ent[0].tolist() == pytest.approx([math.log(4.0), 0.0], abs=1e-6)


def test_grpo_loss_is_the_composition_of_the_pieces():
    torch.manual_seed(1)
    old = -torch.rand(3, 4)
    logp = old + 0.3 * torch.randn(3, 4)
    ref = old + 0.1 * torch.randn(3, 4)
    adv = torch.tensor([1.0, -0.5, 0.25])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]])
    cfg = GRPOLossConfig(clip_eps=0.2, kl_coef=0.05, kl_estimator="k3", loss_agg="seq-mean-token-mean")
    loss, _ = grpo_loss(logp, old, ref, adv, mask, cfg, num_tokens=7, num_seqs=3)
    pg_BT, _ = ppo_clip_loss(logp, old, adv[:, None], clip_eps_low=0.2)
    composed = aggregate(pg_BT, mask, "seq-mean-token-mean", 7, 3) + 0.05 * aggregate(
        kl_estimate(logp, ref, "k3"), mask, "seq-mean-token-mean", 7, 3)
    assert torch.equal(loss, composed)


def _loss_batch(weights=None):
    from hpcrl.algorithms.losses import LossBatch

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    return LossBatch(logp, logp.detach(), None, torch.ones(2, 2, dtype=torch.bool), 4, 2,
                     {"advantages": torch.tensor([1.0, -1.0])}, weights)


def test_tis_weights_a_loss_never_applies_stop_the_step_naming_the_loss():
    """algorithm.rollout_correction tis: a loss that neither calls b.corrected() nor reads
    b.correction_BT leaves the weights out; call_loss refuses it (the step would log train/tis_*
    metrics of a correction that did not happen). Without weights (none, mis) nothing is asked."""
    from hpcrl.algorithms.losses import PolicyLoss, call_loss, resolve_loss
    from hpcrl.config.schema import AlgorithmConfig

    weights = torch.tensor([[0.5, 1.0], [2.0, 1.0]])
    cfg = AlgorithmConfig(name="my.algo")
    for name in ("grpo", "dr_grpo", "gspo", "ppo"):  # the built-ins that run with a correction
        call_loss(resolve_loss(name), _loss_batch(weights), dataclasses.replace(cfg, loss_agg_norm=4.0))

    def plain(b, cfg):
        return -(b.advantages_BT() * b.logp_BT).sum() / b.num_tokens, {}

    def reads(b, cfg):
        return -(b.correction_BT * b.advantages_BT() * b.logp_BT).sum() / b.num_tokens, {}

    with pytest.raises(ValueError, match="loss 'mine:plain' never applied algorithm.rollout_correction: tis"):
        call_loss(PolicyLoss("mine:plain", plain, ()), _loss_batch(weights), cfg)
    with pytest.raises(ValueError, match="loss 'sft' never applied"):
        call_loss(resolve_loss("sft"), _loss_batch(weights), cfg)
    value, _ = call_loss(PolicyLoss("mine:reads", reads, ()), _loss_batch(weights), cfg)
    assert value.item() == pytest.approx(-(0.5 * -1 + 1.0 * -2 - 2.0 * -0.5 - 1.0 * -0.7) / 4)
    call_loss(PolicyLoss("mine:plain", plain, ()), _loss_batch(None), cfg)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo", "ppo"])
def test_algorithm_clip_ratio_c_turns_dual_clip_on_in_the_built_in_losses(name):
    """Sequence 1 (advantage -1) has ratios e^2 and e^0.5: off, its loss is the ratio itself (7.39);
    with algorithm.clip_ratio_c 3 it is at most 3. Sequence 0 (advantage +1) is untouched."""
    from hpcrl.algorithms.losses import LossBatch, call_loss, resolve_loss
    from hpcrl.config.schema import AlgorithmConfig

    old = torch.tensor([[-1.0, -2.0], [-3.0, -1.0]])
    logp = old + torch.tensor([[0.1, -0.1], [2.0, 0.5]])

    def loss(c):
        cfg = AlgorithmConfig(name=name, clip_ratio_c=c, loss_agg_norm=2.0)
        b = LossBatch(logp.clone().requires_grad_(True), old, None, torch.ones(2, 2, dtype=torch.bool), 4, 2,
                      {"advantages": torch.tensor([1.0, -1.0]) if name != "ppo" else
                       torch.tensor([[1.0, 1.0], [-1.0, -1.0]])}, None)
        return call_loss(resolve_loss(name), b, cfg)[0].item()

    off, on = loss(None), loss(3.0)
    ratios = (logp - old).exp()
    seq0 = -torch.minimum(ratios[0], ratios[0].clamp(0.8, 1.2)).sum().item()  # A = +1: PPO's pessimistic term
    unclipped, dual = seq0 + ratios[1].sum().item(), seq0 + 3.0 + ratios[1, 1].item()
    # token-mean over the 4 tokens; dr_grpo's sums over 2 sequences x loss_agg_norm 2 divide by 4 too
    assert off == pytest.approx(unclipped / 4, rel=1e-6)
    assert on == pytest.approx(dual / 4, rel=1e-6)


@pytest.mark.parametrize("name", ["grpo", "dr_grpo"])
def test_sequence_losses_name_token_level_advantages(name):
    """grpo and dr_grpo take one advantage per sequence; [B, T] advantages (ppo's) are named, not left
    to a broadcast error inside the clipped ratio."""
    from hpcrl.algorithms.losses import LossBatch, call_loss, resolve_loss
    from hpcrl.config.schema import AlgorithmConfig

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]], requires_grad=True)
    b = LossBatch(logp, logp.detach(), None, torch.ones(2, 2, dtype=torch.bool), 4, 2,
                  {"advantages": torch.ones(2, 2)}, None)
    with pytest.raises(ValueError, match=rf"loss '{name}' takes per-sequence advantages \[B\], got shape \(2, 2\)"):
        call_loss(resolve_loss(name), b, AlgorithmConfig(name=name, loss_agg_norm=2.0))
