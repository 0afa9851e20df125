"""GRPO advantages and loss on hand-computed cases."""

import math

import pytest
import torch

from hpcrl.algorithms.grpo import GRPOLossConfig, aggregate, group_advantages, grpo_loss, kl_estimate


def test_group_advantages_normalise_within_each_group():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5])
    adv = group_advantages(rewards, group_size=4)
    # group 1: mean 0.5, unbiased std = sqrt(4 * 0.25 / 3) = 0.57735
    s = math.sqrt(1.0 / 3.0)
    expected = torch.tensor([0.5 / s, -0.5 / s, -0.5 / s, 0.5 / s, 0.0, 0.0, 0.0, 0.0])
    assert torch.allclose(adv, expected, atol=1e-5)


def test_group_advantages_without_std_are_centred_rewards():
    adv = group_advantages(torch.tensor([3.0, 1.0]), group_size=2, norm_by_std=False)
    assert adv.tolist() == [1.0, -1.0]


def test_kl_estimators_on_a_known_log_ratio():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    r = math.log(2.0)  # logp - ref
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(r)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.5 * r * r)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(0.5 - math.log(0.5) - 1.0)
    with pytest.raises(ValueError, match="kl_estimator='k9'"):
        kl_estimate(logp, ref, "k9")


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_term_ignores_padding_whatever_its_log_prob(estimator):
    """Padding holds ref 0 and the forward's log p(pad | pad), which a low temperature can push below
    -88: k3's exp(88) overflows float32 and inf * mask 0 is NaN, in the loss and in the gradient. The
    masked term is the one of the real tokens alone, whatever the padding holds."""
    real_logp, real_ref = torch.tensor([[-1.0, -2.0]]), torch.tensor([[-1.1, -1.9]])
    expected = kl_estimate(real_logp, real_ref, estimator).mean()
    for pad_logp in (-1.0, -90.0, -1e4):
        logp = torch.tensor([[-1.0, -2.0, pad_logp]], requires_grad=True)
        ref, old = torch.tensor([[-1.1, -1.9, 0.0]]), torch.tensor([[-1.0, -2.0, 0.0]])
        mask = torch.tensor([[True, True, False]])
        loss, m = grpo_loss(logp, old, ref, torch.tensor([0.5]), mask,
                            GRPOLossConfig(kl_coef=0.001, kl_estimator=estimator), num_tokens=2, num_seqs=1)
        loss.backward()
        assert m["kl"].item() == pytest.approx(expected.item(), rel=1e-6), pad_logp
        assert torch.isfinite(logp.grad).all() and logp.grad[0, 2] == 0.0, (pad_logp, logp.grad)


def test_aggregation_modes():
    v = torch.tensor([[1.0, 2.0, 9.0], [4.0, 0.0, 0.0]])
    m = torch.tensor([[1, 1, 0], [1, 0, 0]])
    assert aggregate(v, m, "token-mean").item() == pytest.approx((1 + 2 + 4) / 3)
    assert aggregate(v, m, "seq-mean-token-mean").item() == pytest.approx((1.5 + 4.0) / 2)
    assert aggregate(v, m, "seq-mean-token-sum").item() == pytest.approx((3 + 4) / 2)
    # global counts make micro-batch losses add up to the full-batch loss
    assert aggregate(v[:1], m[:1], "token-mean", num_tokens=3).item() + aggregate(
        v[1:], m[1:], "token-mean", num_tokens=3).item() == pytest.approx(7 / 3)


def test_grpo_loss_on_policy_equals_minus_mean_advantage_and_clips_off_policy():
    cfg = GRPOLossConfig(clip_eps=0.2)
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5]], requires_grad=True)
    old = logp.detach().clone()
    adv = torch.tensor([1.0, -2.0])
    mask = torch.ones(2, 2)
    loss, metrics = grpo_loss(logp, old, None, adv, mask, cfg)
    # ratio 1 everywhere: loss = -mean over tokens of A = -(1 + 1 - 2 - 2) / 4
    assert loss.item() == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -ratio*A at ratio 1 is -A / num_tokens
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.5, 0.5]]))
    assert metrics["clip_frac"].item() == 0.0
    # a ratio of 2 with A > 0 is clipped at 1.2: loss -1.2 * A and no gradient
    lp = torch.tensor([[math.log(2.0)]], requires_grad=True)
    loss, metrics = grpo_loss(lp, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1), cfg)
    assert loss.item() == pytest.approx(-1.2)
    loss.backward()
    assert lp.grad.item() == 0.0 and metrics["clip_frac"].item() == 1.0


def test_grpo_loss_adds_weighted_kl():
    cfg = GRPOLossConfig(kl_coef=0.1, kl_estimator="k1")
    logp = torch.tensor([[-1.0]])
    loss, metrics = grpo_loss(logp, logp, torch.tensor([[-3.0]]), torch.tensor([0.0]), torch.ones(1, 1), cfg)
    assert metrics["kl"].item() == pytest.approx(2.0)
    assert loss.item() == pytest.approx(0.2)


def test_grpo_clip_frac_counts_the_clipped_branch_taken_not_the_band():
    """verl's pg_clipfrac: a token counts when its clipped term is the larger loss, i.e. the ratio left
    the band on the side its advantage pushes it: rho > 1 + eps with A > 0, rho < 1 - eps with A < 0.
    A ratio outside the band on the other side keeps its gradient and does not count."""
    cfg = GRPOLossConfig(clip_eps=0.2)
    ratios = [1.5, 1.5, 0.5, 0.5]  # above the band twice, below it twice
    logp = torch.tensor([[math.log(r)] for r in ratios], requires_grad=True)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    loss, metrics = grpo_loss(logp, torch.zeros(4, 1), None, adv, torch.ones(4, 1), cfg)
    assert metrics["clip_frac"].item() == 0.5  # tokens 0 (A > 0, high) and 3 (A < 0, low)
    loss.backward()
    # the clipped ones have no gradient; the others d(-rho A)/dlogp / 4 = -rho A / 4
    assert logp.grad[:, 0].tolist() == pytest.approx([0.0, 1.5 / 4, -0.5 / 4, 0.0])


def test_grpo_loss_clips_higher_with_clip_eps_high():
    """algorithm.clip_eps_high reaches GRPO's loss too: [1 - 0.2, 1 + 0.28] keeps a ratio of 1.25 with
    A > 0 unclipped (its gradient flows), where the symmetric 0.2 clips it."""
    lp = torch.tensor([[math.log(1.25)]], requires_grad=True)
    loss, m = grpo_loss(lp, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1),
                        GRPOLossConfig(clip_eps=0.2, clip_eps_high=0.28))
    assert loss.item() == pytest.approx(-1.25) and m["clip_frac"].item() == 0.0
    loss, m = grpo_loss(lp, torch.zeros(1, 1), None, torch.tensor([1.0]), torch.ones(1, 1),
                        GRPOLossConfig(clip_eps=0.2))
    assert loss.item() == pytest.approx(-1.2) and m["clip_frac"].item() == 1.0
