"""Advantage functions on hand-computed cases: Dr. GRPO, RLOO, REINFORCE++, GAE, whitening."""

import math
import statistics

import pytest
import torch

from hpcrl.algorithms import (dr_grpo_advantages, gae_advantages, per_token, reinforce_pp_advantages,
                              returns_to_go, rloo_advantages, token_rewards, whiten)


def test_dr_grpo_centres_without_dividing_by_std():
    adv = dr_grpo_advantages(torch.tensor([0.0, 0.0, 0.0, 1.0]), group_size=4)
    assert torch.allclose(adv, torch.tensor([-0.25, -0.25, -0.25, 0.75]))


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    # group 1: baselines (0 + 0.5) / 2, (1 + 0.5) / 2, (1 + 0) / 2; group 2 all equal
    adv = rloo_advantages(torch.tensor([1.0, 0.0, 0.5, 2.0, 2.0, 2.0]), group_size=3)
    assert torch.allclose(adv, torch.tensor([0.75, -0.75, 0.0, 0.0, 0.0, 0.0]))
    with pytest.raises(ValueError, match="group_size=1"):
        rloo_advantages(torch.tensor([1.0]), group_size=1)


def test_per_token_broadcasts_and_zeroes_padding():
    out = per_token(torch.tensor([2.0, -1.0]), torch.tensor([[1, 1, 0], [1, 0, 0]]))
    assert out.tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


def test_token_rewards_put_the_score_on_the_last_token_and_subtract_kl():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.5, 7.0]])
    r = token_rewards(torch.tensor([1.0, 0.0]), mask, kl, kl_coef=0.1)
    assert torch.allclose(r, torch.tensor([[-0.01, -0.02, 0.97], [-0.05, 0.05, 0.0]]))


def test_returns_to_go_with_discount():
    r = torch.tensor([[1.0, 2.0, 3.0, 5.0]])
    g = returns_to_go(r, torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    # G2 = 3, G1 = 2 + 0.5 * 3, G0 = 1 + 0.5 * 3.5; the padded reward 5 is ignored
    assert torch.allclose(g, torch.tensor([[2.75, 3.5, 3.0, 0.0]]))


def test_reinforce_pp_whitens_kl_penalised_returns_over_the_batch():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, -0.5, 7.0]])
    adv, ret = reinforce_pp_advantages(torch.tensor([1.0, 0.0]), mask, kl, kl_coef=0.1)
    # rewards [[-.01, -.02, .97], [-.05, .05, pad]] -> returns-to-go with gamma = 1:
    hand_returns = [0.94, 0.95, 0.97, 0.0, 0.05]
    assert torch.allclose(ret, torch.tensor([[0.94, 0.95, 0.97], [0.0, 0.05, 0.0]]), atol=1e-6)
    mean, std = statistics.fmean(hand_returns), statistics.stdev(hand_returns)  # unbiased over 5 tokens
    expected = [(x - mean) / std for x in hand_returns]
    got = [adv[0, 0], adv[0, 1], adv[0, 2], adv[1, 0], adv[1, 1]]
    assert [g.item() for g in got] == pytest.approx(expected, abs=1e-5)
    assert adv[1, 2].item() == 0.0


def test_gae_over_a_three_token_response_with_a_terminal_reward():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])  # position 3 is padding: its value must not leak
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # delta2 = 1 - 0.7 = 0.3 (V after the end is 0); delta1 = 0.9*0.7 - 0.6 = 0.03; delta0 = 0.9*0.6 - 0.5
    # A2 = 0.3; A1 = 0.03 + 0.72 * 0.3 = 0.246; A0 = 0.04 + 0.72 * 0.246 = 0.21712
    assert adv.tolist()[0] == pytest.approx([0.21712, 0.246, 0.3, 0.0], abs=1e-6)
    assert ret.tolist()[0] == pytest.approx([0.71712, 0.846, 1.0, 0.0], abs=1e-6)


def test_gae_with_lambda_and_gamma_one_is_monte_carlo_return_minus_value():
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                              torch.ones(1, 3), gamma=1.0, lam=1.0)
    assert adv.tolist()[0] == pytest.approx([0.5, 0.4, 0.3])
    assert ret.tolist()[0] == pytest.approx([1.0, 1.0, 1.0])


def test_gae_with_lambda_zero_is_the_one_step_td_error():
    adv, _ = gae_advantages(torch.tensor([[0.0, 1.0]]), torch.tensor([[0.2, 0.4]]), torch.ones(1, 2),
                            gamma=0.5, lam=0.0)
    assert adv.tolist()[0] == pytest.approx([0.5 * 0.4 - 0.2, 1.0 - 0.4])


def test_whiten_uses_the_valid_tokens_only():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 0]])
    out = whiten(x, mask)
    s = math.sqrt(5.0 / 3.0)  # unbiased variance of 1, 2, 3, 4 around 2.5
    assert out.flatten().tolist() == pytest.approx([-1.5 / s, -0.5 / s, 0.0, 0.5 / s, 1.5 / s, 0.0], abs=1e-6)
    rescaled = whiten(x, mask, shift_mean=False)
    assert rescaled[0, 0].item() == pytest.approx(-1.5 / s + 2.5, abs=1e-6)


def test_whiten_is_masked_mean_and_masked_var_bit_for_bit():
    from hpcrl.algorithms.aggregation import masked_mean, masked_var

    g = torch.Generator().manual_seed(0)
    for dtype, mask_dtype in ((torch.float32, torch.bool), (torch.float64, torch.int64)):
        x = torch.randn(37, 11, generator=g, dtype=dtype) * 3
        mask = (torch.rand(37, 11, generator=g) < 0.7).to(mask_dtype)
        mean = masked_mean(x, mask)
        want = (x - mean) * torch.rsqrt(masked_var(x, mask) + 1e-8)
        assert torch.equal(whiten(x, mask), want * mask.to(dtype))
        assert torch.equal(whiten(x, mask, shift_mean=False), (want + mean) * mask.to(dtype))


def test_whiten_of_one_or_no_valid_token_is_zero_not_nan():
    x = torch.tensor([[5.0, 7.0]])
    assert whiten(x, torch.tensor([[1, 0]])).tolist() == [[0.0, 0.0]]  # variance 0, not n - 1 = 0's nan
    assert whiten(x, torch.tensor([[0, 0]])).tolist() == [[0.0, 0.0]]
