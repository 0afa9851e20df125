"""Rollout correction (TIS cap, MIS mask, mismatch metrics) and DAPO's helpers on hand-computed cases."""

import math

import pytest
import torch

from hpcrl.algorithms import (fill_groups, groups_with_signal, mis_mask, mismatch_metrics,
                              overlong_penalty, tis_weights)


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
    assert keep.tolist() == [0.0, 1.0, 0.0]
    assert m["mis_masked_frac"].item() == pytest.approx(2.0 / 3.0)
    keep, m = mis_mask(old, behaviour, mask, lo=0.5, hi=2.0, level="geometric")
    assert keep.tolist() == [1.0, 1.0, 1.0] and m["mis_masked_frac"].item() == 0.0
    with pytest.raises(ValueError, match="lo <= 1 <= hi"):
        mis_mask(old, behaviour, mask, lo=1.5, hi=2.0)


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
