"""Rollout correction (TIS cap, MIS mask, mismatch metrics) and DAPO's helpers on hand-computed cases."""

import math

import pytest
import torch

from hpcrl.algorithms import (dynamic_sampling_batch, fill_groups, groups_with_signal, kept_counts, mis_mask,
                              mismatch_metrics, overlong_penalty, tis_weights)


def test_tis_weights_are_capped_detached_and_zero_on_padding():
    behaviour = torch.zeros(1, 4)
    old = torch.tensor([[math.log(1.5), math.log(3.0), math.log(0.5), 9.0]], requires_grad=True)
    w, m = tis_weights(old, behaviour, torch.tensor([[1, 1, 1, 0]]), cap=2.0)
    assert w[0].tolist() == pytest.approx([1.5, 2.0, 0.5, 0.0])
    assert not w.requires_grad
    assert m["tis_weight_mean"].item() == pytest.approx(4.0 / 3.0)
    assert m["tis_truncated_frac"].item() == pytest.approx(1.0 / 3.0)


def test_mis_masks_sequences_whose_ratio_leaves_the_band():
    lg = math.log
    old = torch.tensor([[lg(1.5), lg(1.5)], [lg(0.9), 0.0], [lg(0.3), 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    behaviour = torch.zeros(3, 2)
    # products: 2.25 (above 2), 0.9, 0.3 (below 0.5); geometric means: 1.5, 0.9, sqrt(0.3) = 0.548
    keep, m = mis_mask(old, behaviour, mask, lo=0.5, hi=2.0, level="sequence")
    assert keep.tolist() == [[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]]  # per token, 0 on padding
    assert m["mis_masked_frac"].item() == pytest.approx(2.0 / 3.0)
    keep, m = mis_mask(old, behaviour, mask, lo=0.5, hi=2.0, level="geometric")
    assert keep.tolist() == [[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]] and m["mis_masked_frac"].item() == 0.0
    with pytest.raises(ValueError, match="lo <= 1 <= hi"):
        mis_mask(old, behaviour, mask, lo=1.5, hi=2.0)


def test_mis_at_the_token_level_rejects_only_the_tokens_outside_the_band():
    lg = math.log
    old = torch.tensor([[lg(1.5), lg(2.5)], [lg(0.9), 7.0], [lg(0.3), 0.0]])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    keep, m = mis_mask(old, torch.zeros(3, 2), mask, lo=0.5, hi=2.0, level="token")
    # token ratios 1.5, 2.5 (out), 0.9, (padding), 0.3 (out), 1.0: 2 of the 5 tokens rejected
    assert keep.tolist() == [[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]
    assert m["mis_masked_frac"].item() == pytest.approx(2.0 / 5.0)
    # float32: four logs of magnitude < 1.3, each rounded within 2^-24 * 2, and their sum: < 1e-6 off
    expected = (lg(1.5) + lg(2.5) + lg(0.9) + lg(0.3)) / 5
    assert m["mis_log_ratio_mean"].item() == pytest.approx(expected, abs=1e-6)


def test_kept_counts_leave_out_rejected_tokens_and_wholly_rejected_sequences():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]])
    keep = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # row 0 keeps 2 of 3 tokens, row 1 loses both (it leaves the sequences), row 2 keeps its one,
    # row 3 has no tokens (it stays counted, as it is without MIS)
    assert kept_counts(mask, keep) == (3, 3)
    assert kept_counts(mask, mask.float()) == (6, 4)


def test_mismatch_metrics_estimate_the_engine_trainer_kl():
    old = torch.tensor([[math.log(2.0), math.log(0.5), 3.0]])
    m = mismatch_metrics(old, torch.zeros(1, 3), torch.tensor([[1, 1, 0]]))
    # d = (log 2, -log 2): k1 = mean(-d) = 0; k3 = mean(exp(d) - 1 - d) = ((1 - log 2) + (log 2 - 0.5)) / 2
    assert m["mismatch_kl_k1"].item() == pytest.approx(0.0, abs=1e-7)
    assert m["mismatch_kl_k3"].item() == pytest.approx(0.25)
    assert m["mismatch_abs_log_ratio"].item() == pytest.approx(math.log(2.0))
    same = mismatch_metrics(old, old, torch.ones(1, 3))
    assert all(v.item() == 0.0 for v in same.values())


def test_overlong_penalty_is_linear_in_the_buffer():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    # L_max = 20, L_cache = 4: free up to 16, then (16 - |y|) / 4, and -1 past L_max
    assert overlong_penalty(lengths, 20, 4).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])
    assert overlong_penalty(lengths, 20, 4, penalty_factor=0.5).tolist() == pytest.approx(
        [0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer_len"):
        overlong_penalty(lengths, 20, 0)


def test_groups_with_signal():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.5, 0.5, 0.7]])
    assert groups_with_signal(rewards).tolist() == [False, True, False, True]
    assert groups_with_signal(torch.tensor([[1.0], [0.0]])).tolist() == [True, True]


ROUNDS = [torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]),   # keeps groups 1, 3
          torch.tensor([[0.0, 1.0], [1.0, 1.0], [1.0, 0.0], [0.0, 1.0]])]   # keeps 0, 2, 3


def _generator():
    calls = []

    def generate_round(r):
        calls.append(r)
        return ROUNDS[r]
    return generate_round, calls


def test_dynamic_sampling_fills_the_batch_from_several_rounds():
    gen, calls = _generator()
    res = fill_groups(gen, num_groups=3, max_rounds=5)
    assert res.kept == [(0, 1), (0, 3), (1, 0)] and calls == [0, 1] and res.filled
    # dropped: (0, 0), (0, 2), (1, 1); surplus (passing but not needed): (1, 2), (1, 3)
    assert res.metrics() == {"rounds": 2.0, "groups_generated": 8.0, "groups_dropped": 3.0,
                             "groups_dropped_frac": 3 / 8, "groups_surplus": 2.0, "groups_padded": 0.0,
                             "groups_kept": 3.0}


def test_dynamic_sampling_cap():
    gen, calls = _generator()
    with pytest.raises(RuntimeError, match="max_rounds=1"):
        fill_groups(gen, num_groups=3, max_rounds=1)
    assert calls == [0]
    gen, _ = _generator()
    partial = fill_groups(gen, num_groups=3, max_rounds=1, on_short="partial")
    assert partial.kept == [(0, 1), (0, 3)] and not partial.filled
    gen, _ = _generator()
    padded = fill_groups(gen, num_groups=3, max_rounds=1, on_short="pad")
    assert padded.kept == [(0, 1), (0, 3), (0, 0)] and padded.num_groups_padded == 1 and not padded.filled


def test_public_names_resolve_to_functions_not_modules():
    import types

    import hpcrl.algorithms as algorithms
    for name in algorithms.__all__:
        assert not isinstance(getattr(algorithms, name), types.ModuleType), name


def _dapo_rounds(rounds):
    """generate_round over fixed (task rewards, lengths) pairs, as the dapo dataflow's."""
    return lambda r: (torch.tensor(rounds[r][0]), torch.tensor(rounds[r][1]))


# Group size 2, max_new_tokens 4, overlong buffer 2: a length of 3 costs 0.5, of 4 costs 1.
# Round 0: all wrong (lengths differ), signal, all right (lengths differ); round 1: signal, all right.
DAPO_ROUNDS = [([0.0, 0.0, 1.0, 0.0, 1.0, 1.0], [2, 4, 1, 1, 3, 4]),
               ([0.0, 1.0, 1.0, 1.0], [4, 2, 2, 2])]


def test_dapo_filters_on_correctness_and_shapes_after():
    """DAPO keeps a group when 0 < #correct < G, tested on the task reward before the overlong penalty:
    the all-wrong and all-right groups of round 0 differ in their shaped rewards only (0 vs -1 and
    -0.5 vs 0), and are dropped; their advantages would otherwise be length alone."""
    batch = dynamic_sampling_batch(_dapo_rounds(DAPO_ROUNDS), group_size=2, num_groups=2, max_rounds=3,
                                   max_len=4, overlong_buffer_len=2)
    assert batch.rows == [2, 3, 6, 7]  # round 0's second group, round 1's first
    assert batch.fill.num_groups_dropped == 3 and batch.fill.num_rounds == 2  # round 1's all-right too
    assert batch.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert batch.shaped.tolist() == [1.0, 0.0, -1.0, 1.0]  # round 1's first response is 4 long
    # group-normalised shaped rewards: (x - mean) / (unbiased std + 1e-6), std of two values |a - b| / sqrt 2
    r = 1 / math.sqrt(2)
    assert batch.advantages.tolist() == pytest.approx([r, -r, -r, r], rel=1e-5)


def test_dapo_padded_groups_get_no_advantage_from_their_lengths():
    """At the round cap the batch is topped up with dropped groups: their task rewards are all equal,
    so their advantages are 0 even where the length penalty differs."""
    batch = dynamic_sampling_batch(_dapo_rounds(DAPO_ROUNDS), group_size=2, num_groups=2, max_rounds=1,
                                   max_len=4, overlong_buffer_len=2)
    assert batch.rows == [2, 3, 0, 1] and batch.fill.num_groups_padded == 1
    assert batch.shaped.tolist()[2:] == [0.0, -1.0]
    assert batch.advantages.tolist()[2:] == [0.0, 0.0]
    unshaped = dynamic_sampling_batch(_dapo_rounds(DAPO_ROUNDS), group_size=2, num_groups=2, max_rounds=3,
                                      max_len=4)
    assert unshaped.shaped.tolist() == unshaped.rewards.tolist() == [1.0, 0.0, 0.0, 1.0]
